"""Reading a checkpoint from fastpersistd's memory tier (daemon/memory.py):
a trainer restarted on the daemon's node loads what the daemon just saved
without reading the disk.

find() asks the daemon (MemoryCopy, with the socket's or the token's
access, within LOOKUP_TIMEOUT: a daemon that is down or slow costs a load
at most that) for the checkpoint at a path. The daemon answers with the
manifest it committed there and the directory in the shared-memory
directory (FASTPERSIST_SHM_DIR, as for segments) that holds each data file
byte for byte. The copy is used only if the manifest at the path is still
that one, byte for byte (read here too: the daemon checked it as well);
then MemorySource reads the files there exactly as LocalSource reads a
checkpoint directory, with the same engine and the same checks (sizes,
headers, every CRC32C: a mismatch is ChecksumMismatchError naming file and
tensor). The files are tmpfs pages: reading them is a memory copy.

A copy may be evicted while it is read (a file gone: CorruptCheckpointError);
loading.fallback reads the disk then, as for a corrupt copy.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch

from .. import knobs
from ..engine import Engine, Segment
from ..errors import CheckpointError, ManifestError
from ..format.bounds import MAX_MANIFEST_BYTES
from ..format.manifest import MANIFEST_NAME, FileRecord, Manifest
from ..protocol.client import DaemonClient
from ..protocol.shm import COPY_NAME
from .packed import Span
from .source import LocalSource, Progress

# How long a load waits for the daemon's answer before it reads the disk.
LOOKUP_TIMEOUT = 2.0


class MemorySource:
    """The daemon's copy in memory (`copy`, a directory of data files) of
    the committed checkpoint at `path`, whose manifest is `manifest`."""

    def __init__(self, path: Path, copy: Path, manifest: Manifest,
                 engine: Engine | None = None) -> None:
        self.path, self.copy = path, copy
        self._files = LocalSource(copy, engine, manifest)

    @property
    def where(self) -> str:
        return str(self.path)

    def manifest(self) -> Manifest:
        return self._files.manifest()

    def read_tensors(self, manifest: Manifest, *, verify: bool, progress: Progress | None = None,
                     spans: Mapping[int, Span] | None = None,
                     into: Mapping[int, torch.Tensor] | None = None) -> list[torch.Tensor]:
        return self._files.read_tensors(manifest, verify=verify, progress=progress, spans=spans,
                                        into=into)

    def read_to_device(self, manifest: Manifest, device: torch.device, *, verify: bool,
                       ring_bytes: int, progress: Progress | None = None,
                       into: Mapping[int, torch.Tensor] | None = None
                       ) -> list[torch.Tensor] | None:
        return self._files.read_to_device(manifest, device, verify=verify, ring_bytes=ring_bytes,
                                          progress=progress, into=into)

    def check_file(self, f: FileRecord) -> None:
        self._files.check_file(f)

    def read_ranges(self, f: FileRecord, segments: Sequence[Segment], *, checksum: bool
                    ) -> list[int] | None:
        return self._files.read_ranges(f, segments, checksum=checksum)


def find(address: str, path: Path, timeout: float = LOOKUP_TIMEOUT
         ) -> tuple[MemorySource | None, str]:
    """(the daemon's memory copy of the checkpoint at `path`, "") if the
    daemon at `address` holds a valid one; else (None, why not)."""
    deadline = time.monotonic() + timeout
    try:
        client = DaemonClient(address)
    except CheckpointError as exc:
        return None, str(exc)
    try:
        client.info(cached=True, timeout=timeout)
        reply = client.memory_copy(client.relative(path),
                                   max(0.05, deadline - time.monotonic()))
    except CheckpointError as exc:  # down, slow, older than MemoryCopy, outside its root
        return None, str(exc)
    finally:
        client.close()
    if not reply.directory:
        return None, reply.reason
    if not COPY_NAME.match(reply.directory):
        return None, f"fastpersistd named a copy {reply.directory[:80]!r}, not one of its own"
    here = _manifest_bytes(path)
    if here != reply.manifest:
        return None, "the manifest at the path is not the one the daemon holds a copy of"
    try:
        manifest = Manifest.from_json(here, str(path))
    except ManifestError as exc:
        return None, str(exc)
    return MemorySource(path, Path(knobs.shm_dir()) / reply.directory, manifest), ""


def _manifest_bytes(path: Path) -> bytes | None:
    try:
        with open(path / MANIFEST_NAME, "rb") as f:
            data = f.read(MAX_MANIFEST_BYTES + 1)
    except OSError:
        return None
    return data if len(data) <= MAX_MANIFEST_BYTES else None


__all__ = ["LOOKUP_TIMEOUT", "MemorySource", "find"]
