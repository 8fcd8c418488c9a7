"""Reading a checkpoint from the object-store tier: tensors straight into memory.

The same checks as a local load (checkpoint.py), against the store's objects:
every data file must exist with the size the manifest says; its safetensors
header is fetched, checked against its CRC32C and against the manifest's
records; then every tensor is read by parallel ranged GETs straight into its
own memory (tier/remote.py) and its CRC32C compared. A mismatch raises
ChecksumMismatchError naming the file and the tensor; verify() reports every
problem instead, reading through a bounded amount of memory.
"""

from __future__ import annotations

from collections.abc import Callable

import crc32c
import torch

from ..errors import CorruptCheckpointError, ManifestError, TierError, TruncatedFileError
from ..format import dtypes, safetensors_file
from ..format.manifest import FileRecord, Manifest, TensorRecord
from ..tier.client import S3
from ..tier.remote import Fetch, fetch_all, object_sizes, read_manifest
from ..tier.url import TierURL
from . import datafile
from .checkpoint import VerifyReport, header_problems
from .plan import memory_of

# verify() reads at most this many tensor bytes at once.
_BATCH = 256 << 20


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
                  *, verify: bool) -> tuple[datafile.Mismatch | None, list[str]]:
    """The data file's header, fetched: (its CRC32C mismatch, when verifying),
    or what is wrong with it against the manifest's records."""
    covered = bytearray(f.data_start)
    try:
        s3.read_into(url, f.name, 0, memoryview(covered))
    except EOFError as exc:
        return None, [f"{f.name}: {exc}"]
    if verify:
        actual = crc32c.crc32c(covered)
        if actual != f.header_crc32c:
            return datafile.Mismatch(f.name, "<header>", f.header_crc32c, actual), [
                f"{f.name}: safetensors header: CRC32C {actual:#010x}, expected "
                f"{f.header_crc32c:#010x}"]
    try:
        data_start, entries, _ = safetensors_file.parse_header(bytes(covered))
    except safetensors_file.HeaderError as exc:
        return None, [] if not verify else [f"{f.name}: safetensors header: {exc}"]
    return None, header_problems(f, records, data_start, entries)


def _records(manifest: Manifest) -> dict[str, list[int]]:
    by_file: dict[str, list[int]] = {f.name: [] for f in manifest.files}
    for i, t in enumerate(manifest.tensors):
        by_file[t.file].append(i)
        if t.encoding != "raw":
            raise TierError(f"tensor {t.name!r} is stored with encoding {t.encoding!r}, which "
                            "this version cannot read from the tier")
    return by_file


def read_tensors(s3: S3, url: TierURL, manifest: Manifest, *, verify: bool,
                 progress: Callable[[int], None] | None = None) -> list[torch.Tensor]:
    """Every stored tensor of the checkpoint at `url`, on the CPU, in manifest
    order; raises on corruption (see the module docstring)."""
    by_file = _records(manifest)
    sizes = object_sizes(s3, url)
    result: list[torch.Tensor | None] = [None] * len(manifest.tensors)
    fetches = []
    for f in manifest.files:
        problem = _size_problem(url, f, sizes)
        if problem is not None:
            raise problem
        records = [manifest.tensors[i] for i in by_file[f.name]]
        mismatch, problems = _check_header(s3, url, f, records, verify=verify)
        if mismatch is not None:
            datafile.raise_for([mismatch], str(url))
        if problems:
            raise ManifestError(f"{url}: {problems[0]}")
        tensors = [torch.empty(r.shape, dtype=dtypes.from_name(r.dtype)) for r in records]
        for i, t in zip(by_file[f.name], tensors, strict=True):
            result[i] = t
        segments = [(memory_of(t), r.offset) for t, r in zip(tensors, records, strict=True)]
        fetches.append((f, records, Fetch(s3, url, f.name, segments, checksum=verify)))
    try:
        fetch_all(s3, [fetch for _, _, fetch in fetches], progress)
    except EOFError as exc:
        raise TruncatedFileError(f"{url}: {exc}") from None
    if verify:
        for f, records, fetch in fetches:
            datafile.raise_for([datafile.Mismatch(f.name, r.name, r.crc32c, crc)
                                for r, crc in zip(records, fetch.crcs(), strict=True)
                                if crc != r.crc32c], str(url))
    assert all(t is not None for t in result)  # every record belongs to one listed file
    return result  # type: ignore[return-value]


def verify(s3: S3, url: TierURL, progress: Callable[[int], None] | None = None) -> VerifyReport:
    """Re-read every byte of the checkpoint at `url` and check it against the
    manifest and checksums; every problem found, not only the first."""
    manifest, _ = read_manifest(s3, url)
    by_file = _records(manifest)
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
        start = 0
        while start < len(records):
            batch: list[TensorRecord] = []
            size = 0
            while start < len(records) and (not batch or size + records[start].length <= _BATCH):
                batch.append(records[start])
                size += records[start].length
                start += 1
            buffers = [memoryview(bytearray(r.length)) for r in batch]
            fetch = Fetch(s3, url, f.name, [(b, r.offset) for b, r in zip(buffers, batch,
                                                                           strict=True)],
                          checksum=True)
            try:
                fetch_all(s3, [fetch])
            except EOFError as exc:
                report.problems.append(f"{f.name}: {exc}")
                continue
            for r, crc in zip(batch, fetch.crcs(), strict=True):
                if crc != r.crc32c:
                    report.problems.append(f"{f.name}: tensor {r.name!r}: CRC32C {crc:#010x}, "
                                           f"expected {r.crc32c:#010x}")
            report.tensors += len(batch)
            report.bytes_checked += size
            if progress:
                progress(size)
    return report
