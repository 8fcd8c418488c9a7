"""fastpersist: durable PyTorch checkpoints at the speed of the disk.

    fastpersist.save(state_dict, "ckpt/step-100")   # durable when it returns
    state = fastpersist.load("ckpt/step-100")
"""

import sys as _sys
from typing import TYPE_CHECKING, Any

from ._version import __version__
from .errors import (
    CheckpointAbortedError,
    CheckpointError,
    CheckpointExistsError,
    CheckpointIOError,
    CheckpointNotFoundError,
    CheckpointPermissionError,
    ChecksumMismatchError,
    CorruptCheckpointError,
    DaemonError,
    DaemonMayStillCommitError,
    DaemonUnavailableError,
    DiskFullError,
    DistributedCheckpointError,
    ManifestError,
    PickleNotAllowedError,
    PostCommitError,
    StateMismatchError,
    TensorIndexError,
    TensorNotFoundError,
    TierError,
    TruncatedFileError,
    UnknownFileFormatError,
    UnsupportedPathError,
    UnsupportedValueError,
)

if TYPE_CHECKING:
    from .api import async_save, load, open, prepare_staging, save
    from .checkpointer import Checkpointer
    from .saving.futures import SaveFuture
    from .saving.preemption import HandOff, exit_on_preemption, hand_off

# The torch-facing API is imported on first use, so that the parts that need no
# torch (format, engine, commit) import without it.
_LAZY = {
    "load": ".api",
    "open": ".api",
    "save": ".api",
    "async_save": ".api",
    "prepare_staging": ".api",
    "SaveFuture": ".saving.futures",
    "HandOff": ".saving.preemption",
    "exit_on_preemption": ".saving.preemption",
    "hand_off": ".saving.preemption",
    "Checkpointer": ".checkpointer",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'fastpersist' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)


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
    "DaemonError",
    "DaemonMayStillCommitError",
    "DaemonUnavailableError",
    "DiskFullError",
    "DistributedCheckpointError",
    "HandOff",
    "ManifestError",
    "PickleNotAllowedError",
    "PostCommitError",
    "SaveFuture",
    "StateMismatchError",
    "TensorIndexError",
    "TensorNotFoundError",
    "TierError",
    "TruncatedFileError",
    "UnknownFileFormatError",
    "UnsupportedPathError",
    "UnsupportedValueError",
    "__version__",
    "async_save",
    "exit_on_preemption",
    "hand_off",
    "load",
    "open",
    "prepare_staging",
    "save",
]

# A process that imported torch first will save or load: the torch-facing API
# (some 70 modules) is imported now, with the library, as torch.save comes with
# torch, instead of inside the first fastpersist.save, where it cost 0.04-0.13 s
# with cached bytecode and 0.10-0.28 s without, 4% to a quarter of a 2 GiB save
# here (issue 37).
# Without torch (the daemon, fpctl's listings) it stays lazy.
# (sys.modules["torch"] is None where an import of torch was blocked.)
if _sys.modules.get("torch") is not None:
    from .api import async_save, load, open, prepare_staging, save
