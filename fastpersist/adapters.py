"""The adapters' contract: everything `fastpersist/integrations/` may use
beyond the public API (the package's names and `fastpersist.errors`).

An adapter translates a framework's calls (Lightning's CheckpointIO,
transformers' Trainer, accelerate's hooks, DCP's StorageWriter, torchtitan's
CheckpointManager) into these; it holds no I/O, staging or format logic of
its own. `tests/test_architecture.py` fails when an integration imports any
other fastpersist module, so a new need is added here, on purpose, or the
logic it wants moves into the core. Keep this list short: each name is a
promise to every adapter.

Paths and checkpoints:
    checkpoint_path(path)       a local checkpoint path, as save and load take it
    through_link(target)        where a save of `target` goes (a link to a directory)
    is_checkpoint(path)         a committed fastpersist checkpoint directory
    delete_checkpoint(path)     atomically (renamed aside first)
    point_latest(dir_fd, name)  a directory's `latest` file made to name `name`, atomically
                                and durably (DeepSpeed's pointer to its newest tag)
    fsync_dir(path)             a directory's new entries made durable
    replace_file(path, data)    a small file replaced atomically and durably (its
                                temporary named as `fpctl gc` collects it)
Saving:
    settings()                  the FASTPERSIST_* knobs (daemon, file_bytes, ...)
    pipeline_for(daemon, ...)   a save pipeline of the adapter's own
    StagingPool                 reused staging buffers (DCP's stager)
    gc_paused()                 the GC paused around many small objects
DCP's storage (a distributed save planned by DCP: distributed/external.py):
    jobs_for(daemon), Job, ItemWritten, StoredTensor, global_manifest
    dtype_name(dtype)           the stored name of a torch dtype (None: not storable)
    Manifest, parse_json        the manifest, and strict bounded JSON
    plain_tree, plain_value     plain values (no tensors) as a state tree, and back
Reading (DCP's StorageReader: integrations/dcp/reader.py):
    source_for(path)            the checkpoint's Source (tensors/source.py): its
                                manifest, file checks, ranges read with CRC32Cs
    FileRecord, TensorRecord, Segment, dtype_of(name)
    os_error(exc, what)         an OSError as the CheckpointError it means
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from .api import pipeline_for
from .distributed.external import ItemWritten, Job, jobs_for
from .distributed.layout import global_manifest
from .engine import Segment
from .errors import ManifestError
from .format import dtypes
from .format.manifest import MANIFEST_NAME, FileRecord, Manifest, TensorRecord, parse_json
from .format.tree import check_tree
from .gcpause import paused as gc_paused
from .knobs import current as settings
from .loading.load import source_for
from .saving.staging import StagingPool
from .storage.commit import delete_checkpoint, os_error, through_link, write_durably
from .storage.dirs import fsync_dir
from .storage.leftovers import leftover_name
from .storage.local_path import checkpoint_path
from .storage.retention import point_latest
from .tensors import state
from .tensors.plan import StoredTensor


def is_checkpoint(path: str | os.PathLike[str]) -> bool:
    """Whether `path` is a committed fastpersist checkpoint (its manifest is there)."""
    return (Path(path) / MANIFEST_NAME).is_file()


def replace_file(path: str | os.PathLike[str], data: bytes) -> None:
    """Replace the file `path` with `data`: a crash leaves the old file or the
    new one, and at worst a temporary that `fpctl gc` knows (leftover_name)."""
    target = Path(path)
    tmp = target.with_name(leftover_name(target.name, "tmp"))
    try:
        write_durably(tmp, data)
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(target.parent)  # the rename itself survives a power loss


def dtype_name(dtype: torch.dtype) -> str | None:
    """The name a tensor of `dtype` is stored under, or None if it cannot be stored."""
    return dtypes.to_name(dtype)


def dtype_of(name: str) -> torch.dtype:
    """The torch dtype of a stored dtype name (a manifest's names are checked)."""
    return dtypes.from_name(name)


def plain_tree(value: Any) -> tuple[Any, bool]:
    """The state tree (JSON) of a value, as fastpersist.save stores one, and
    whether it holds tensors (which a plain tree cannot). Raises
    UnsupportedValueError for what would need pickle."""
    tree, leaves = state.encode(value)
    return tree, bool(leaves)


def plain_value(tree: Any, where: str) -> Any:
    """The value of a plain tree (plain_tree's), checked as a load checks
    one; ManifestError naming `where` if it is malformed or holds a tensor."""
    check_tree(tree, [], where)

    def no_tensor(node: dict[str, Any]) -> torch.Tensor:
        raise ManifestError(f"{where}: holds a tensor")

    return state.decode(tree, no_tensor, where=where)


__all__ = [
    "FileRecord", "ItemWritten", "Job", "Manifest", "Segment", "StagingPool", "StoredTensor",
    "TensorRecord", "checkpoint_path", "delete_checkpoint", "dtype_name", "dtype_of",
    "fsync_dir", "gc_paused", "global_manifest", "is_checkpoint", "jobs_for", "os_error",
    "parse_json", "pipeline_for", "plain_tree", "plain_value", "point_latest", "replace_file",
    "settings",
    "source_for", "through_link",
]
