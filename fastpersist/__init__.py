"""fastpersist: durable PyTorch checkpoints at the speed of the disk.

    fastpersist.save(state_dict, "ckpt/step-100")   # durable when it returns
    state = fastpersist.load("ckpt/step-100")
"""

from ._version import __version__
from .api import load, save
from .async_save import CheckpointAbortedError, SaveFuture, async_save
from .checkpointer import Checkpointer
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
    "CheckpointAbortedError",
    "CheckpointError",
    "CheckpointExistsError",
    "CheckpointIOError",
    "CheckpointNotFoundError",
    "CheckpointPermissionError",
    "Checkpointer",
    "ChecksumMismatchError",
    "CorruptCheckpointError",
    "DiskFullError",
    "ManifestError",
    "PickleNotAllowedError",
    "SaveFuture",
    "TruncatedFileError",
    "UnsupportedValueError",
    "__version__",
    "async_save",
    "load",
    "save",
]
