"""fastpersist: durable PyTorch checkpoints at the speed of the disk.

    fastpersist.save(state_dict, "ckpt/step-100")   # durable when it returns
    state = fastpersist.load("ckpt/step-100")
"""

from ._version import __version__
from .api import load, save
from .errors import (
    CheckpointError,
    CheckpointExistsError,
    CheckpointIOError,
    CheckpointNotFoundError,
    CheckpointPermissionError,
    ChecksumMismatchError,
    CorruptCheckpointError,
    DiskFullError,
    ManifestError,
    PickleNotAllowedError,
    TruncatedFileError,
    UnsupportedValueError,
)

__all__ = [
    "CheckpointError",
    "CheckpointExistsError",
    "CheckpointIOError",
    "CheckpointNotFoundError",
    "CheckpointPermissionError",
    "ChecksumMismatchError",
    "CorruptCheckpointError",
    "DiskFullError",
    "ManifestError",
    "PickleNotAllowedError",
    "TruncatedFileError",
    "UnsupportedValueError",
    "__version__",
    "load",
    "save",
]
