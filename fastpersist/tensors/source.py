"""Where a load reads a committed checkpoint from: the Source interface, and
LocalSource, a checkpoint directory read through the engine.

A load (loading/load.py) does the same work whatever holds the bytes: the
pickle policy, pairing `into=`, rebuilding a distributed checkpoint's
tensors, decoding the tree. A Source does the rest: it reads the manifest
(once), and reads the records the load asks for into CPU tensors, checking
each data file's size and header and every CRC32C, so that a checkpoint is
verified the same way from any of them. LocalSource is a directory;
tier_read.TierSource an object store's prefix; memory_read.MemorySource
fastpersistd's copy in memory; a peer's is the next one. A DCP reader reads
item ranges through read_ranges.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Protocol

import torch

from ..engine import Engine, Segment, get_engine
from ..errors import CheckpointNotFoundError
from ..format.manifest import FileRecord, Manifest
from . import checkpoint, device_load, read_into
from .committed import check_size, read_errors, read_manifest
from .packed import Span

Progress = Callable[[int], None]


class Source(Protocol):
    """A committed checkpoint, wherever its bytes are."""

    @property
    def where(self) -> str:
        """The checkpoint's path or URL, as errors name it."""
        ...

    def manifest(self) -> Manifest:
        """Its validated manifest, read on the first call only."""
        ...

    def read_tensors(self, manifest: Manifest, *, verify: bool, progress: Progress | None = None,
                     spans: Mapping[int, Span] | None = None,
                     into: Mapping[int, torch.Tensor] | None = None) -> list[torch.Tensor]:
        """The records of `manifest` (the checkpoint's, or cut to the records
        wanted) as CPU tensors, in its order. spans: record -> the raw bytes
        wanted of it (a compressed record is decoded only there). into:
        record -> a contiguous CPU tensor of its dtype and size that a raw
        record is read straight into, and returned as. Raises
        CheckpointError subclasses: a missing or short file, a header that
        disagrees with the manifest, a CRC32C mismatch (when verifying)."""
        ...

    def read_to_device(self, manifest: Manifest, device: torch.device, *, verify: bool,
                       ring_bytes: int, progress: Progress | None = None,
                       into: Mapping[int, torch.Tensor] | None = None
                       ) -> list[torch.Tensor] | None:
        """read_tensors' tensors on `device`, streamed through ring_bytes of
        host memory (into: tensors on `device`); None where this source
        cannot, and the load reads to the CPU and moves them."""
        ...

    def check_file(self, f: FileRecord) -> None:
        """Raise unless data file `f` is there at the size the manifest says."""
        ...

    def read_ranges(self, f: FileRecord, segments: Sequence[Segment], *, checksum: bool
                    ) -> list[int] | None:
        """Fill each (buffer, offset) segment from data file `f`; with
        checksum, the CRC32C of each segment's bytes, in order (the caller
        compares them with what it expects: whole records, CRC blocks)."""
        ...


class LocalSource:
    """The checkpoint directory at `path` (absolute), read with the engine."""

    def __init__(self, path: Path, engine: Engine | None = None,
                 manifest: Manifest | None = None) -> None:
        """manifest: the checkpoint's, where it was read already (as the
        memory tier's copies are given theirs: memory_read.py)."""
        self.path = path
        self._engine = engine
        self._manifest = manifest

    @property
    def where(self) -> str:
        return str(self.path)

    @property
    def engine(self) -> Engine:
        if self._engine is None:
            self._engine = get_engine()
        return self._engine

    def manifest(self) -> Manifest:
        if self._manifest is None:
            self._manifest = read_manifest(self.path)
        return self._manifest

    def read_tensors(self, manifest: Manifest, *, verify: bool, progress: Progress | None = None,
                     spans: Mapping[int, Span] | None = None,
                     into: Mapping[int, torch.Tensor] | None = None) -> list[torch.Tensor]:
        self._check_node_local(manifest)
        if into:
            read_into.read_into(self.path, manifest, self.engine, into, verify=verify,
                                progress=progress)
        entries = checkpoint.read_tensors(self.path, manifest, self.engine, verify=verify,
                                          progress=progress, spans=spans, skip=into or ())
        for i, t in (into or {}).items():
            entries[i] = t
        return entries

    def read_to_device(self, manifest: Manifest, device: torch.device, *, verify: bool,
                       ring_bytes: int, progress: Progress | None = None,
                       into: Mapping[int, torch.Tensor] | None = None
                       ) -> list[torch.Tensor] | None:
        entries = device_load.read_to_device(self.path, manifest, self.engine, device,
                                             verify=verify, ring_bytes=ring_bytes, dests=into)
        if progress:
            progress(sum(r.length for r in manifest.tensors))
        return entries

    def check_file(self, f: FileRecord) -> None:
        check_size(self.path, f)

    def read_ranges(self, f: FileRecord, segments: Sequence[Segment], *, checksum: bool
                    ) -> list[int] | None:
        with read_errors(self.path, f):
            return self.engine.read_file(str(self.path / f.name), segments,
                                         checksum=checksum).crcs

    def _check_node_local(self, manifest: Manifest) -> None:
        """A node-local checkpoint's files that other nodes hold are not
        here by design: name the nodes rather than call a file missing."""
        if all(f.node is None for f in manifest.files):
            return
        missing = sorted({f.name for f in manifest.files if not (self.path / f.name).exists()})
        if not missing:
            return
        nodes = sorted({f.node for f in manifest.files if f.name in missing and f.node})
        where = (f" (written on node{'s' if len(nodes) > 1 else ''} {', '.join(nodes)})"
                 if nodes else "")
        s = len(missing) > 1
        raise CheckpointNotFoundError(
            f"{self.path}: {len(missing)} data file{'s' if s else ''} of this node-local "
            f"checkpoint {'are' if s else 'is'} not here{where}, e.g. {missing[0]}; load it "
            "on a layout that needs only this node's files, or collect every node's "
            "directory into one with `fpctl gather`")


__all__ = ["LocalSource", "Progress", "Source"]
