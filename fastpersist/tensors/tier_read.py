"""Reading a checkpoint from the object-store tier: tensors straight into memory.

The same checks as a local load (checkpoint.py), against the store's objects:
every data file must exist with the size the manifest says; its header
(safetensors, or packed for a compressed checkpoint) is fetched, checked
against its CRC32C and against the manifest's records; then every raw tensor
is read by parallel ranged GETs straight into its own memory (tier/remote.py)
and its CRC32C compared. A compressed record goes through packed.read, the
same decode path as a local load, with ranged GETs of its stored frames as
the reader: each frame's stored CRC32C checked, the frames decoded in
parallel into the tensor, its raw CRC32C checked. A mismatch raises
ChecksumMismatchError naming the file and the tensor (and frame);
verify() reports every problem instead, reading through a bounded amount of
memory.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import crc32c
import torch

from ..engine import Segment
from ..errors import CorruptCheckpointError, ManifestError, TruncatedFileError
from ..format import dtypes, safetensors_file
from ..format.manifest import FileRecord, Manifest, TensorRecord
from ..tier.client import S3
from ..tier.remote import Fetch, fetch_all, object_sizes, read_manifest
from ..tier.url import TierURL
from . import packed
from .committed import BATCH_BYTES, batches
from .headers import header_problems, parse_header
from .mismatch import Mismatch, raise_for
from .plan import memory_of
from .source import Progress
from .verifying import VerifyReport, problems_of


def _size_problem(url: TierURL, f: FileRecord, sizes: dict[str, int]
                  ) -> CorruptCheckpointError | None:
    actual = sizes.get(f.name)
    if actual is None:
        return CorruptCheckpointError(f"{url}: data file {f.name} is missing")
    if actual < f.size:
        return TruncatedFileError(f"{url}: data file {f.name} is truncated: {actual} bytes, "
                                  f"the manifest says {f.size}")
    if actual > f.size:
        return CorruptCheckpointError(f"{url}: data file {f.name} is {actual} bytes, the "
                                      f"manifest says {f.size}")
    return None


def _check_header(s3: S3, url: TierURL, f: FileRecord, records: list[TensorRecord],
                  *, verify: bool) -> tuple[Mismatch | None, list[str]]:
    """The data file's header (safetensors or packed), fetched: (its CRC32C
    mismatch, when verifying), or what is wrong with it against the records."""
    covered = bytearray(f.data_start)
    try:
        s3.read_into(url, f.name, 0, memoryview(covered))
    except EOFError as exc:
        return None, [f"{f.name}: {exc}"]
    if verify:
        actual = crc32c.crc32c(covered)
        if actual != f.header_crc32c:
            mismatch = Mismatch(f.name, "<header>", f.header_crc32c, actual)
            return mismatch, problems_of([mismatch])
    try:
        data_start, entries, _ = parse_header(bytes(covered))
    except safetensors_file.HeaderError as exc:
        return None, [] if not verify else [f"{f.name}: header: {exc}"]
    return None, header_problems(f, records, data_start, entries)


def _by_file(manifest: Manifest) -> dict[str, list[int]]:
    by_file: dict[str, list[int]] = {f.name: [] for f in manifest.files}
    for i, t in enumerate(manifest.tensors):
        by_file[t.file].append(i)
    return by_file


def _reader(s3: S3, url: TierURL, name: str) -> packed.StoredReader:
    """packed.read's reader for object `name`: parallel ranged GETs."""
    def read_stored(segments: list[Segment]) -> None:
        fetch_all(s3, [Fetch(s3, url, name, [(memoryview(b), off) for b, off in segments],
                             checksum=False)])

    return read_stored


def read_tensors(s3: S3, url: TierURL, manifest: Manifest, *, verify: bool,
                 progress: Callable[[int], None] | None = None,
                 spans: Mapping[int, packed.Span] | None = None,
                 into: Mapping[int, torch.Tensor] | None = None) -> list[torch.Tensor]:
    """Every stored tensor of the checkpoint at `url`, on the CPU, in manifest
    order; raises on corruption (see the module docstring). spans: as in
    checkpoint.read_tensors (a compressed record is decoded only where its
    frames overlap the span; raw records are read whole). into: record -> a
    contiguous CPU tensor of its dtype and size, which a raw record's ranged
    GETs fill in place (Source.read_tensors)."""
    by_file = _by_file(manifest)
    sizes = object_sizes(s3, url)
    result: list[torch.Tensor | None] = [None] * len(manifest.tensors)
    fetches = []
    compressed: list[tuple[FileRecord, list[int]]] = []
    for f in manifest.files:
        problem = _size_problem(url, f, sizes)
        if problem is not None:
            raise problem
        records = [manifest.tensors[i] for i in by_file[f.name]]
        mismatch, problems = _check_header(s3, url, f, records, verify=verify)
        if mismatch is not None:
            raise_for([mismatch], str(url))
        if problems:
            raise ManifestError(f"{url}: {problems[0]}")
        raw = [i for i in by_file[f.name] if manifest.tensors[i].frames is None]
        if len(raw) < len(by_file[f.name]):
            compressed.append((f, [i for i in by_file[f.name] if i not in set(raw)]))
        records = [manifest.tensors[i] for i in raw]
        dests = into or {}
        tensors = [dests[i] if i in dests else torch.empty(r.shape,
                                                           dtype=dtypes.from_name(r.dtype))
                   for i, r in zip(raw, records, strict=True)]
        for i, t in zip(raw, tensors, strict=True):
            result[i] = t
        segments = [(memory_of(t), r.offset) for t, r in zip(tensors, records, strict=True)]
        fetches.append((f, records, Fetch(s3, url, f.name, segments, checksum=verify)))
    try:
        fetch_all(s3, [fetch for _, _, fetch in fetches], progress)
        if verify:
            for f, records, fetch in fetches:
                raise_for([Mismatch(f.name, r.name, r.crc32c, crc)
                           for r, crc in zip(records, fetch.crcs(), strict=True)
                           if crc != r.crc32c], str(url))
        # Compressed records, a file at a time (its stored bytes in memory at
        # once): ranged GETs of the frames, then decoded on the codec's threads.
        for f, indices in compressed:
            records = [manifest.tensors[i] for i in indices]
            tensors, outcome = packed.read(_reader(s3, url, f.name), f, records, verify=verify,
                                           spans=[(spans or {}).get(i) for i in indices])
            raise_for(outcome.mismatches, str(url))
            if outcome.undecodable:
                raise CorruptCheckpointError(f"{url}: {outcome.undecodable[0]}")
            for i, t in zip(indices, tensors, strict=True):
                result[i] = t
            if progress:
                progress(sum(r.length for r in records))
    except EOFError as exc:
        raise TruncatedFileError(f"{url}: {exc}") from None
    assert all(t is not None for t in result)  # every record belongs to one listed file
    return result  # type: ignore[return-value]


class TierSource:
    """The checkpoint at `url` in an object store (tensors/source.py's Source):
    ranged GETs, in parallel, straight into the tensors' memory."""

    def __init__(self, s3: S3, url: TierURL, manifest: Manifest | None = None) -> None:
        """manifest: the checkpoint's, where it was read already."""
        self.s3, self.url = s3, url
        self._manifest = manifest
        self._sizes: dict[str, int] | None = None

    @property
    def where(self) -> str:
        return str(self.url)

    def manifest(self) -> Manifest:
        if self._manifest is None:
            self._manifest = read_manifest(self.s3, self.url)[0]
        return self._manifest

    def read_tensors(self, manifest: Manifest, *, verify: bool, progress: Progress | None = None,
                     spans: Mapping[int, packed.Span] | None = None,
                     into: Mapping[int, torch.Tensor] | None = None) -> list[torch.Tensor]:
        return read_tensors(self.s3, self.url, manifest, verify=verify, progress=progress,
                            spans=spans, into=into)

    def read_to_device(self, manifest: Manifest, device: torch.device, *, verify: bool,
                       ring_bytes: int, progress: Progress | None = None,
                       into: Mapping[int, torch.Tensor] | None = None
                       ) -> list[torch.Tensor] | None:
        return None  # fetched to the CPU; the load moves them

    def check_file(self, f: FileRecord) -> None:
        if self._sizes is None:
            self._sizes = object_sizes(self.s3, self.url)
        problem = _size_problem(self.url, f, self._sizes)
        if problem is not None:
            raise problem

    def read_ranges(self, f: FileRecord, segments: Sequence[Segment], *, checksum: bool
                    ) -> list[int] | None:
        fetch = Fetch(self.s3, self.url, f.name,
                      [(memoryview(b), off) for b, off in segments], checksum=checksum)
        try:
            fetch_all(self.s3, [fetch])
        except EOFError as exc:
            raise TruncatedFileError(f"{self.url}: {exc}") from None
        return fetch.crcs() if checksum else None


def verify(s3: S3, url: TierURL, progress: Callable[[int], None] | None = None, *,
           decode: bool = True, manifest: Manifest | None = None) -> VerifyReport:
    """Re-read every byte of the checkpoint at `url` and check it against the
    manifest and checksums; every problem found, not only the first.
    Compressed tensors: each stored frame's CRC32C, and unless decode=False
    the raw CRC32C of the decoded tensor, as a load checks it. manifest: the
    one the caller already fetched from `url`."""
    manifest = manifest or read_manifest(s3, url)[0]
    by_file = _by_file(manifest)
    sizes = object_sizes(s3, url)
    report = VerifyReport(str(url))
    for f in manifest.files:
        report.files += 1
        problem = _size_problem(url, f, sizes)
        if problem is not None:
            report.problems.append(str(problem).removeprefix(f"{url}: "))
            continue
        records = [manifest.tensors[i] for i in by_file[f.name]]
        report.problems += _check_header(s3, url, f, records, verify=True)[1]
        for items in batches(list(enumerate(records)), BATCH_BYTES) if records else ():
            batch = [r for _, r in items]
            size = sum(r.length for r in batch)
            try:
                report.problems += _verify_batch(s3, url, f, batch, decode)
            except EOFError as exc:
                report.problems.append(f"{f.name}: {exc}")
                continue
            report.tensors += len(batch)
            report.bytes_checked += size
            if progress:
                progress(size)
    return report


def _verify_batch(s3: S3, url: TierURL, f: FileRecord, batch: list[TensorRecord],
                  decode: bool) -> list[str]:
    raw = [r for r in batch if r.frames is None]
    encoded = [r for r in batch if r.frames is not None]
    buffers = [memoryview(bytearray(r.length)) for r in raw]
    fetch = Fetch(s3, url, f.name, [(b, r.offset) for b, r in zip(buffers, raw, strict=True)],
                  checksum=True)
    fetch_all(s3, [fetch])
    mismatches = [Mismatch(f.name, r.name, r.crc32c, crc)
                  for r, crc in zip(raw, fetch.crcs(), strict=True) if crc != r.crc32c]
    undecodable: list[str] = []
    if encoded:
        _, outcome = packed.read(_reader(s3, url, f.name), f, encoded, verify=True,
                                 decode=decode)
        mismatches += outcome.mismatches
        undecodable = outcome.undecodable
    return problems_of(mismatches) + undecodable
