"""Memory-only checkpoints (Checkpointer(memory_every=...), Begin's
durability "memory"): fastpersistd's memory tier holds them and nothing is
on disk, so there is no manifest at the path to compare the daemon's with
(memory_read.find refuses such a copy for that reason, and must).

find() asks the daemon at a path where no checkpoint is committed on disk;
a copy it reports as memory-only is read and checked as memory_read reads
any copy (each file's size, its header, every tensor's CRC32C), with no
disk behind it: an evicted copy, a dead daemon or a failed check is an
error for the caller (Checkpointer.load_latest falls back to the newest
disk checkpoint). steps() lists the memory-only step-N checkpoints the
daemon holds in a directory (List's memory_only).

A memory-only checkpoint outlives the trainer (the daemon holds it), not
the daemon nor the node.
"""

from __future__ import annotations

from pathlib import Path

from .. import knobs
from ..errors import CheckpointError, ManifestError
from ..format.manifest import MANIFEST_NAME, Manifest
from ..protocol.client import DaemonClient
from ..storage.retention import step_of
from . import memory_read
from .memory_read import LOOKUP_TIMEOUT, MemorySource


def find(address: str, path: Path, timeout: float = LOOKUP_TIMEOUT
         ) -> tuple[MemorySource | None, str]:
    """(the memory-only checkpoint at `path`, "") if the daemon at `address`
    holds one there; else (None, why not)."""
    if (path / MANIFEST_NAME).exists():
        return None, f"a checkpoint is committed on disk at {path}"
    reply, why = memory_read.ask_copy(address, path, timeout)
    if reply is None:
        return None, why
    if not reply.memory_only:
        return None, "fastpersistd's copy is of a checkpoint on disk, which is not there"
    try:
        manifest = Manifest.from_json(reply.manifest, str(path))
    except ManifestError as exc:
        return None, str(exc)
    return MemorySource(path, Path(knobs.shm_dir()) / reply.directory, manifest), ""


def steps(address: str, directory: Path, timeout: float = LOOKUP_TIMEOUT
          ) -> tuple[list[int], str]:
    """(the steps of the memory-only step-N checkpoints that the daemon at
    `address` holds in `directory`, ascending; "") or ([], why not)."""
    try:
        client = DaemonClient(address)
    except CheckpointError as exc:
        return [], str(exc)
    try:
        client.info(cached=True, timeout=timeout)
        reply = client.list(client.relative(directory), timeout=timeout)
    except CheckpointError as exc:
        return [], str(exc)
    finally:
        client.close()
    found = (step_of(e.name) for e in reply.memory_only)
    return sorted(s for s in found if s is not None), ""


__all__ = ["find", "steps"]
