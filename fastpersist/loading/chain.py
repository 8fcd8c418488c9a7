"""A checkpoint read from the first of its copies that holds up: the
daemon's memory, the disk, peers, the object store (copies.py chooses
them, in that order, fastest first).

Each copy is opened only when the ones before it have failed: a store is
not asked while the disk serves. Every copy is verified as it is read (the
Source checks each CRC32C). When one fails (any CheckpointError: a CRC32C
mismatch, a file missing or evicted meanwhile, a daemon or store that is
down or does not answer within its timeout), the load warns once, naming
the copy and what failed, and reads the same records again from the next
copy, which is used for the rest of the load. into= tensors that the
failed read filled in part are filled again. If every copy fails, the last
one's error is raised, its message listing each copy tried and why it
failed.

Copies are never mixed: the first copy whose manifest reads is the
checkpoint of record, and a later copy is used only if it is the same
checkpoint: its manifest the same bytes, or (a store's compressed copy,
tier/upload.py) made from those bytes, as its `fastpersist-source` says.
Another one (a checkpoint saved again under the same name, an older upload)
is skipped, with the reason. A compressed copy holds the same records, in
the same order, stored differently: the records a read asks for are read
as that copy stores them (the raw CRC32Cs are the same).

read_ranges hands the caller the CRC32Cs to compare: a mismatch there is
the caller's to find, and it raises (a DCP reader's ChecksumMismatchError),
where read_tensors falls through. Item ranges are not those of a compressed
copy: read_ranges and check_file pass over one.
"""

from __future__ import annotations

import hashlib
import threading
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TypeVar

import torch

from ..engine import Segment
from ..errors import CheckpointError
from ..format.manifest import FileRecord, Manifest, TensorRecord
from ..tensors.packed import Span
from ..tensors.source import Progress, Source

T = TypeVar("T")


@dataclass(frozen=True)
class Opened:
    """A copy, opened: its Source, and which checkpoint it is (the SHA-256s
    of the manifest bytes it was read from, or made from; empty where the
    source knows no bytes: then its parsed manifest is compared)."""

    source: Source
    identity: frozenset[str]


def identity_of(manifest_bytes: bytes, *made_from: str) -> frozenset[str]:
    """The identity of a copy whose manifest is `manifest_bytes` (made_from:
    the SHA-256s of the manifests it was made from, a compressed copy's)."""
    return frozenset({hashlib.sha256(manifest_bytes).hexdigest(), *made_from})


@dataclass(frozen=True)
class Copy:
    """One copy of a checkpoint: `what` names it in warnings and errors
    ("disk", "fastpersistd's copy in memory", ...), `kind` is what fpctl ls
    shows ("memory", "disk", "peer", "s3"); open() raises CheckpointError
    where the copy cannot be read, and NoCopy where it turns out not to
    exist (a daemon without a tier): not a failure, only noted."""

    what: str
    kind: str
    open: Callable[[], Opened]


class NoCopy(CheckpointError):
    """Raised by a Copy's open where there is no such copy (see Copy)."""


class Chain:
    """A Source (tensors/source.py) over `copies`, in order; `where` names
    the checkpoint."""

    def __init__(self, where: str, copies: Sequence[Copy]) -> None:
        self._where, self.copies = where, list(copies)
        self._at = -1  # the copy in use
        self._source: Source | None = None
        self._record: Manifest | None = None
        self._identity: frozenset[str] = frozenset()
        self._index: dict[TensorRecord, int] = {}
        self._translated = False  # the copy in use stores the records otherwise
        self.failures: list[tuple[str, str]] = []  # (copy, why), in the order tried
        self.absent: list[tuple[str, str]] = []  # (copy, why there is none)
        self._unsaid = 0  # failures since the last warning
        self._last: CheckpointError | None = None

    @property
    def where(self) -> str:
        return self._where

    def manifest(self) -> Manifest:
        if self._record is None:
            self._advance(None)
        assert self._record is not None
        return self._record

    # -- moving down the chain ------------------------------------------------

    def _advance(self, failed: CheckpointError | None) -> None:
        """From the copy in use (that raised `failed`) to the next one that
        is the checkpoint of record; raise when none is left."""
        if failed is not None:
            self._fail(self.copies[self._at].what, failed)
        self._source = None
        while self._at + 1 < len(self.copies):
            self._at += 1
            copy = self.copies[self._at]
            try:
                opened = copy.open()
                if self._record is None:
                    self._record = opened.source.manifest()
                    self._identity = opened.identity
                    self._index = {r: i for i, r in enumerate(self._record.tensors)}
                    self._translated = False
                elif not self._same(opened):
                    self._fail(copy.what, None, "it holds another checkpoint of that name "
                                                "(its manifest differs)")
                    continue
                else:
                    stored = opened.source.manifest()
                    self._translated = stored != self._record
                    if len(stored.tensors) != len(self._record.tensors):
                        raise CheckpointError("its records are not the checkpoint's")
            except NoCopy as exc:
                self.absent.append((copy.what, str(exc)))
                continue
            except CheckpointError as exc:
                self._fail(copy.what, exc)
                continue
            self._source = opened.source
            if self._unsaid:
                said = "; ".join(f"{what} failed ({why})"
                                 for what, why in self.failures[-self._unsaid:])
                self._unsaid = 0
                warnings.warn(f"{self._where}: {said}; reading it from {copy.what}",
                              RuntimeWarning, stacklevel=5)
            return
        raise self._all_failed()

    def _same(self, opened: Opened) -> bool:
        """Whether `opened` is the checkpoint of record: by the manifest
        bytes, or by the parsed manifest where a source knows no bytes."""
        if opened.identity and self._identity:
            return bool(opened.identity & self._identity)
        return opened.source.manifest() == self._record

    def _fail(self, what: str, exc: CheckpointError | None, why: str = "") -> None:
        if not why:
            why = (exc.strerror if isinstance(exc, OSError) and exc.strerror is not None
                   else str(exc)).removeprefix(f"{self._where}: ")
        self.failures.append((what, why))
        self._unsaid += 1
        if exc is not None:
            self._last = exc

    def _all_failed(self) -> CheckpointError:
        tried = "; ".join(f"{what}: {why}" for what, why in self.failures)
        if self.absent:
            tried += "; not there: " + "; ".join(f"{what} ({why})" for what, why in self.absent)
        exc = self._last or CheckpointError(f"{self._where}: no copy of it could be read")
        if len(self.failures) + len(self.absent) > 1:
            # The last copy's error, of its class (a caller tells a missing
            # checkpoint from a corrupt one by it), saying what else was tried.
            message = f"{self._where}: no copy could be read ({tried})"
            if isinstance(exc, OSError) and exc.strerror is not None:
                exc.strerror = message  # an OSError's str() is "[Errno N] " + strerror
            else:
                exc.args = (message, *exc.args[1:])
        return exc

    def _try(self, read: Callable[[Source], T], ranges: bool = False) -> T:
        self.manifest()
        while True:
            source = self._source
            assert source is not None
            try:
                if ranges and self._translated:
                    raise CheckpointError(f"{self.copies[self._at].what} stores the files "
                                          "compressed: item ranges are not read from it")
                return read(source)
            except CheckpointError as exc:
                self._advance(exc)

    def _as_stored(self, manifest: Manifest) -> Manifest:
        """`manifest` (the record's, or cut to the records wanted) as the
        copy in use stores its records."""
        if not self._translated:
            return manifest
        assert self._source is not None
        stored = self._source.manifest()
        records = []
        for r in manifest.tensors:
            i = self._index.get(r)
            s = stored.tensors[i] if i is not None else r
            if i is None or (s.name, s.dtype, s.shape, s.length, s.crc32c) != (
                    r.name, r.dtype, r.shape, r.length, r.crc32c):
                raise CheckpointError(f"{self.copies[self._at].what}: record {r.name!r} is "
                                      "not the checkpoint's")
            records.append(s)
        names = {s.file for s in records}
        return replace(manifest, tensors=tuple(records),
                       files=tuple(f for f in stored.files if f.name in names))

    # -- the Source interface ---------------------------------------------------

    def read_tensors(self, manifest: Manifest, *, verify: bool, progress: Progress | None = None,
                     spans: Mapping[int, Span] | None = None,
                     into: Mapping[int, torch.Tensor] | None = None) -> list[torch.Tensor]:
        shown = _Shown(progress)

        def read(s: Source) -> list[torch.Tensor]:
            entries = s.read_tensors(self._as_stored(manifest), verify=verify,
                                     progress=shown.attempt(), spans=spans, into=into)
            _place(entries, into)
            return entries

        return self._try(read)

    def read_to_device(self, manifest: Manifest, device: torch.device, *, verify: bool,
                       ring_bytes: int, progress: Progress | None = None,
                       into: Mapping[int, torch.Tensor] | None = None
                       ) -> list[torch.Tensor] | None:
        shown = _Shown(progress)

        def read(s: Source) -> list[torch.Tensor] | None:
            entries = s.read_to_device(self._as_stored(manifest), device, verify=verify,
                                       ring_bytes=ring_bytes, progress=shown.attempt(),
                                       into=into)
            _place(entries, into)
            return entries

        return self._try(read)

    def check_file(self, f: FileRecord) -> None:
        self._try(lambda s: s.check_file(f), ranges=True)

    def read_ranges(self, f: FileRecord, segments: Sequence[Segment], *, checksum: bool
                    ) -> list[int] | None:
        return self._try(lambda s: s.read_ranges(f, segments, checksum=checksum), ranges=True)


class _Shown:
    """A load's progress over attempts: a copy read again after a failed one
    reports its bytes from 0, and the caller sees only what goes beyond the
    bytes it was shown (a progress bar never passes its total)."""

    def __init__(self, progress: Progress | None) -> None:
        self.progress, self.shown, self.read = progress, 0, 0
        self.lock = threading.Lock()  # a source may report from its threads

    def attempt(self) -> Progress | None:
        if self.progress is None:
            return None
        self.read = 0
        return self._add

    def _add(self, n: int) -> None:
        with self.lock:
            self.read += n
            new, self.shown = self.read - self.shown, max(self.shown, self.read)
        if new > 0 and self.progress is not None:
            self.progress(new)


def _place(entries: list[torch.Tensor] | None, into: Mapping[int, torch.Tensor] | None
           ) -> None:
    """Each into= record's entry made its into= tensor. The load chose those
    records as raw in the checkpoint of record; a copy that stores one
    compressed decodes it into a tensor of its own, and the into= tensor
    may hold what a failed copy left in it: the values are copied over."""
    if entries is None or not into:
        return
    for i, dest in into.items():
        if entries[i] is not dest:
            with torch.no_grad():
                dest.copy_(entries[i])
            entries[i] = dest


__all__ = ["Chain", "Copy", "NoCopy", "Opened", "identity_of"]
