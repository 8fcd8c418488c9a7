"""Reading a checkpoint from fastpersistd's memory tier (daemon/memory.py):
a trainer restarted on the daemon's node loads what the daemon just saved
without reading the disk.

find() asks the daemon (MemoryCopy, with the socket's or the token's
access, within LOOKUP_TIMEOUT: a daemon that is down or slow costs a load
at most that) for the checkpoint at a path. The daemon answers with the
manifest it committed there and the directory in the shared-memory
directory (FASTPERSIST_SHM_DIR, as for segments) that holds each data file
byte for byte. The copy is used only if the manifest at the path is still
that one, byte for byte (read here too: the daemon checked it as well).

MemorySource makes the checks a load from disk makes (each file's size,
its header against its CRC32C and the records, every tensor's CRC32C: a
mismatch is ChecksumMismatchError naming file and tensor), but reads no
byte twice: each file is mapped copy-on-write (MAP_PRIVATE) and its
tensors are views of the mapping, checked in place (the CRC32Cs on
threads; the GIL is released). The pages stay the daemon's tmpfs pages
until the trainer writes one (then that page is its own); a copy the
daemon evicts meanwhile lives on in them until the tensors go. into=
tensors are filled by the engine's copy, which checksums as it copies.
check_file and read_ranges read the files as LocalSource reads a
directory, and a compressed record (the daemon keeps none) too.

A copy may be evicted while it is read (a file gone: CorruptCheckpointError);
loading/chain.py reads the next copy then (the disk), as for a corrupt copy.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from .. import knobs
from .._proto import fastpersist_pb2 as pb
from ..checksum import crc32c
from ..engine import Engine, Segment, get_engine
from ..errors import CheckpointError, ManifestError
from ..format import dtypes
from ..format.bounds import MAX_MANIFEST_BYTES
from ..format.manifest import MANIFEST_NAME, FileRecord, Manifest, TensorRecord
from ..protocol.client import DaemonClient
from ..protocol.shm import COPY_NAME
from .committed import check_size, read_errors, records_by_file
from .headers import check_against_header
from .mismatch import Mismatch, raise_for
from .packed import Span
from .plan import memory_of
from .source import LocalSource, Progress

# How long a load waits for the daemon's answer before it reads the disk.
LOOKUP_TIMEOUT = 2.0
# madvise: map a range's pages, read-only (Linux 5.14; not in Python 3.11's mmap).
MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)
# Threads that checksum (and copy into into= tensors) at once.
THREADS = min(8, os.cpu_count() or 1)


class MemorySource:
    """The daemon's copy in memory (`copy`, a directory of data files) of
    the committed checkpoint at `path`, whose manifest is `manifest`."""

    def __init__(self, path: Path, copy: Path, manifest: Manifest,
                 engine: Engine | None = None, manifest_bytes: bytes = b"") -> None:
        """manifest_bytes: what `manifest` was read from (the committed one's)."""
        self.path, self.copy, self.manifest_bytes = path, copy, manifest_bytes
        self._files = LocalSource(copy, engine, manifest)
        self._engine = engine or get_engine()

    @property
    def where(self) -> str:
        return str(self.path)

    def manifest(self) -> Manifest:
        return self._files.manifest()

    def read_tensors(self, manifest: Manifest, *, verify: bool, progress: Progress | None = None,
                     spans: Mapping[int, Span] | None = None,
                     into: Mapping[int, torch.Tensor] | None = None) -> list[torch.Tensor]:
        if any(r.frames is not None for r in manifest.tensors):
            return self._files.read_tensors(manifest, verify=verify, progress=progress,
                                            spans=spans, into=into)
        return self._mapped(manifest, verify, progress, into or {})

    def read_to_device(self, manifest: Manifest, device: torch.device, *, verify: bool,
                       ring_bytes: int, progress: Progress | None = None,
                       into: Mapping[int, torch.Tensor] | None = None
                       ) -> list[torch.Tensor] | None:
        return None  # mapped on the CPU, checked there; the load moves them

    def _mapped(self, manifest: Manifest, verify: bool, progress: Progress | None,
                into: Mapping[int, torch.Tensor]) -> list[torch.Tensor]:
        result: list[torch.Tensor | None] = [None] * len(manifest.tensors)
        checks: list[tuple[FileRecord, TensorRecord, mmap.mmap, torch.Tensor | None]] = []
        for f, indices in records_by_file(manifest):
            check_size(self.copy, f)
            records = [manifest.tensors[i] for i in indices]
            check_against_header(self.copy, f, records, verify=verify)
            with read_errors(self.copy, f), open(self.copy / f.name, "rb") as fh:
                m = mmap.mmap(fh.fileno(), f.size, access=mmap.ACCESS_COPY)
            for i, r in zip(indices, records, strict=True):
                dtype = dtypes.from_name(r.dtype)
                if i in into:
                    result[i] = into[i]
                    checks.append((f, r, m, into[i]))
                    continue
                t = (torch.frombuffer(m, dtype=dtype, offset=r.offset,
                                      count=r.length // dtype.itemsize)
                     if r.length else torch.empty(0, dtype=dtype))
                result[i] = t.view(r.shape)
                if verify:
                    checks.append((f, r, m, None))
        with ThreadPoolExecutor(THREADS, thread_name_prefix="fastpersist-memory") as pool:
            crcs = list(pool.map(self._check, checks))
        raise_for([Mismatch(f.name, r.name, r.crc32c, crc)
                   for (f, r, _, dest), crc in zip(checks, crcs, strict=True)
                   if verify and crc != r.crc32c],
                  str(self.copy))
        if progress:
            progress(sum(r.length for r in manifest.tensors))
        return result  # type: ignore[return-value]  # every record belongs to one file

    def _check(self, item: tuple[FileRecord, TensorRecord, mmap.mmap, torch.Tensor | None]
               ) -> int:
        """A record's CRC32C, taken from the mapping; copied into its into=
        tensor on the way, if it has one."""
        _, r, m, dest = item
        if not r.length:
            return 0
        start = r.offset // mmap.PAGESIZE * mmap.PAGESIZE
        with contextlib.suppress(OSError, ValueError):
            # Its pages mapped in one call rather than a fault per few pages: a
            # quarter to a third faster here (a kernel without it: faults).
            m.madvise(MADV_POPULATE_READ, start, r.offset + r.length - start)
        with memoryview(m) as whole, whole[r.offset:r.offset + r.length] as view:
            if dest is None:
                return crc32c(view)
            return self._engine.copy(memory_of(dest), view)

    def check_file(self, f: FileRecord) -> None:
        self._files.check_file(f)

    def read_ranges(self, f: FileRecord, segments: Sequence[Segment], *, checksum: bool
                    ) -> list[int] | None:
        return self._files.read_ranges(f, segments, checksum=checksum)


def ask_copy(address: str, path: Path, timeout: float = LOOKUP_TIMEOUT
             ) -> tuple[pb.MemoryCopyResponse | None, str]:
    """MemoryCopy of `path` from the daemon at `address`, within `timeout`:
    (its reply, naming one of its copies, "") or (None, why not). find()
    and memory_only.find() ask this way, and check the manifest each its way."""
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
    return reply, ""


def find(address: str, path: Path, timeout: float = LOOKUP_TIMEOUT
         ) -> tuple[MemorySource | None, str]:
    """(the daemon's memory copy of the checkpoint at `path`, "") if the
    daemon at `address` holds a valid one; else (None, why not)."""
    reply, why = ask_copy(address, path, timeout)
    if reply is None:
        return None, why
    here = _manifest_bytes(path)
    if here != reply.manifest:
        return None, "the manifest at the path is not the one the daemon holds a copy of"
    try:
        manifest = Manifest.from_json(here, str(path))
    except ManifestError as exc:
        return None, str(exc)
    return MemorySource(path, Path(knobs.shm_dir()) / reply.directory, manifest,
                        manifest_bytes=reply.manifest), ""


def _manifest_bytes(path: Path) -> bytes | None:
    try:
        with open(path / MANIFEST_NAME, "rb") as f:
            data = f.read(MAX_MANIFEST_BYTES + 1)
    except OSError:
        return None
    return data if len(data) <= MAX_MANIFEST_BYTES else None


__all__ = ["LOOKUP_TIMEOUT", "MemorySource", "ask_copy", "find"]
