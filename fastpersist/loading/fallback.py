"""A checkpoint read from its fastest copy while that copy holds up, and
from the next one after: today the daemon's memory (tensors/memory_read.py),
then the disk.

Both copies are the same committed checkpoint (memory_read.find checked
the manifests byte for byte), and each is verified as it is read. When the
first fails its checks (a CRC32C mismatch, a file evicted meanwhile, any
CheckpointError), the load warns, naming the copy and what failed, and
reads the same records again from the next copy, which is then used for
the rest of the load. A load that raises from the next copy raises that
copy's error: the disk is the checkpoint of record. into= tensors that the
failed read filled in part are filled again.

read_ranges hands the caller the CRC32Cs to compare: a mismatch there is
the caller's to find, and it raises (a DCP reader's
ChecksumMismatchError), where read_tensors falls through.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import TypeVar

import torch

from ..engine import Segment
from ..errors import CheckpointError
from ..format.manifest import FileRecord, Manifest
from ..tensors.packed import Span
from ..tensors.source import Progress, Source

T = TypeVar("T")


class Fallback:
    """A Source (tensors/source.py): `first`, then `then` once first fails."""

    def __init__(self, first: Source, then: Source, what: str) -> None:
        self.first, self.then, self.what = first, then, what
        self.fell: CheckpointError | None = None  # why first is not used any more

    @property
    def where(self) -> str:
        return self.then.where

    def manifest(self) -> Manifest:
        return (self.then if self.fell else self.first).manifest()

    def _try(self, read: Callable[[Source], T]) -> T:
        if self.fell is None:
            try:
                return read(self.first)
            except CheckpointError as exc:
                self.fell = exc
                warnings.warn(f"{self.then.where}: {self.what} failed its checks ({exc}); "
                              "reading it from disk", RuntimeWarning, stacklevel=4)
        return read(self.then)

    def read_tensors(self, manifest: Manifest, *, verify: bool, progress: Progress | None = None,
                     spans: Mapping[int, Span] | None = None,
                     into: Mapping[int, torch.Tensor] | None = None) -> list[torch.Tensor]:
        return self._try(lambda s: s.read_tensors(manifest, verify=verify, progress=progress,
                                                  spans=spans, into=into))

    def read_to_device(self, manifest: Manifest, device: torch.device, *, verify: bool,
                       ring_bytes: int, progress: Progress | None = None,
                       into: Mapping[int, torch.Tensor] | None = None
                       ) -> list[torch.Tensor] | None:
        return self._try(lambda s: s.read_to_device(manifest, device, verify=verify,
                                                    ring_bytes=ring_bytes, progress=progress,
                                                    into=into))

    def check_file(self, f: FileRecord) -> None:
        self._try(lambda s: s.check_file(f))

    def read_ranges(self, f: FileRecord, segments: Sequence[Segment], *, checksum: bool
                    ) -> list[int] | None:
        return self._try(lambda s: s.read_ranges(f, segments, checksum=checksum))


__all__ = ["Fallback"]
