"""Reading a committed checkpoint: its manifest, its tensors, and verification."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import crc32c
import torch

from .. import gcpause
from ..engine import Engine, IOResult
from ..errors import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
    ManifestError,
    TruncatedFileError,
)
from ..format import safetensors_file
from ..format.bounds import MAX_MANIFEST_BYTES
from ..format.manifest import MANIFEST_NAME, FileRecord, Manifest, TensorRecord
from ..storage.commit import find_leftovers, os_error, parse_leftover
from . import datafile


def _not_found(path: Path) -> CheckpointNotFoundError:
    if parse_leftover(path) is not None:
        return CheckpointNotFoundError(
            f"{path} is the staging directory of a save that did not finish; it is not a "
            "checkpoint (`fpctl gc` removes it)"
        )
    hint = ""
    if path.parent.is_dir():
        aside = [lo for lo in find_leftovers(path.parent)
                 if lo.target_name == path.name and lo.kind == "old"]
        if aside:
            hint = (f"; a replace of it was interrupted and the previous checkpoint is in "
                    f"{aside[0].path.name} (`fpctl gc {path.parent}` puts it back)")
    if not path.exists():
        return CheckpointNotFoundError(f"no checkpoint at {path}: the path does not exist{hint}")
    if not path.is_dir():
        return CheckpointNotFoundError(f"{path} is a file, not a checkpoint directory")
    return CheckpointNotFoundError(
        f"{path} is not a committed checkpoint: it has no {MANIFEST_NAME}{hint}"
    )


def read_manifest(path: str | os.PathLike[str]) -> Manifest:
    """The validated manifest of the checkpoint at `path`."""
    p = Path(path)
    manifest_path = p / MANIFEST_NAME
    if parse_leftover(p) is not None or not manifest_path.is_file():
        raise _not_found(p)
    try:
        size = manifest_path.stat().st_size
        if size > MAX_MANIFEST_BYTES:  # refused before it is read into memory
            raise ManifestError(f"{p}: the manifest is {size} bytes, more than the "
                                f"{MAX_MANIFEST_BYTES} this version reads")
        data = manifest_path.read_bytes()
    except OSError as exc:
        raise os_error(exc, f"cannot read {manifest_path}") from exc
    with gcpause.paused():  # many small objects, no cycles: half the parse time was the GC's
        return Manifest.from_json(data, str(p))


# Reads that report progress (and verify, to bound its memory) go in batches of
# at most this many tensor bytes.
_BATCH = 256 << 20


def _records_by_file(manifest: Manifest) -> Iterator[tuple[FileRecord, list[int]]]:
    by_file: dict[str, list[int]] = {f.name: [] for f in manifest.files}
    for i, t in enumerate(manifest.tensors):
        by_file[t.file].append(i)
    for f in manifest.files:
        yield f, by_file[f.name]


def _check_size(path: Path, f: FileRecord) -> None:
    file_path = path / f.name
    try:
        actual = file_path.stat().st_size
    except FileNotFoundError:
        raise CorruptCheckpointError(f"{path}: data file {f.name} is missing") from None
    if actual < f.size:
        raise TruncatedFileError(
            f"{path}: data file {f.name} is truncated: {actual} bytes, the manifest says {f.size}"
        )
    if actual > f.size:
        raise CorruptCheckpointError(
            f"{path}: data file {f.name} is {actual} bytes, the manifest says {f.size}"
        )


def read_tensors(path: Path, manifest: Manifest, engine: Engine, *, verify: bool,
                 progress: Callable[[int], None] | None = None) -> list[torch.Tensor]:
    """Every stored tensor, on the CPU, in manifest order; raises on corruption.

    Each file's records must agree with the file's own safetensors header
    (names, dtypes, shapes, places), so that a manifest can only name bytes
    that were written for the tensor it says, even with verify=False.
    progress(n) is called as each batch of n tensor bytes has been read.
    """
    result: list[torch.Tensor | None] = [None] * len(manifest.tensors)
    if progress is None and len(manifest.files) > 1:
        _read_overlapped(path, manifest, engine, verify, result)
        return result  # type: ignore[return-value]  # every record belongs to one file
    for f, indices in _records_by_file(manifest):
        _check_size(path, f)
        records = [manifest.tensors[i] for i in indices]
        _check_against_header(path, f, records, verify=verify)
        # Batches only when someone watches; one engine call per file otherwise.
        limit = _BATCH if progress else max(1, sum(r.length for r in records))
        for batch in _batches(list(zip(indices, records, strict=True)), limit):
            batch_records = [r for _, r in batch]
            try:
                tensors, mismatches = datafile.read(engine, str(path), f, batch_records,
                                                    verify=verify, header=False)
            except EOFError as exc:
                raise TruncatedFileError(f"{path}: {exc}") from None
            except OSError as exc:
                raise os_error(exc, f"cannot read {path / f.name}") from exc
            datafile.raise_for(mismatches, str(path))
            for (i, _), t in zip(batch, tensors, strict=True):
                result[i] = t
            if progress:
                progress(sum(r.length for r in batch_records))
    assert all(t is not None for t in result)  # every record belongs to one listed file
    return result  # type: ignore[return-value]


def _read_overlapped(path: Path, manifest: Manifest, engine: Engine, verify: bool,
                     result: list[torch.Tensor | None]) -> None:
    """read_tensors without progress, several files: each file's engine read
    runs on a reader thread while this one checks and allocates the next file
    (its header, its tensors), so that the I/O and that work overlap. Errors are
    raised as the file-by-file loop raises them: an earlier file's first."""
    in_flight: list[tuple[list[int], datafile.PendingRead, Future[IOResult]]] = []
    with ThreadPoolExecutor(1, thread_name_prefix="fastpersist-read") as reader:
        # (Leaving the block waits for a read still running: nothing frees its memory.)
        try:
            for f, indices in _records_by_file(manifest):
                _check_size(path, f)
                records = [manifest.tensors[i] for i in indices]
                _check_against_header(path, f, records, verify=verify)
                pending = datafile.start_read(str(path), f, records, verify=verify,
                                              header=False)
                in_flight.append((indices, pending, reader.submit(
                    engine.read_file, pending.path, pending.segments, checksum=verify)))
        except BaseException:
            _finish_reads(path, in_flight, result)  # an earlier file's error goes first
            raise
        _finish_reads(path, in_flight, result)


def _finish_reads(path: Path, in_flight: list[tuple[list[int], datafile.PendingRead,
                                                    Future[IOResult]]],
                  result: list[torch.Tensor | None]) -> None:
    while in_flight:
        indices, pending, future = in_flight.pop(0)
        try:
            tensors, mismatches = datafile.finish_read(pending, future.result())
        except EOFError as exc:
            raise TruncatedFileError(f"{path}: {exc}") from None
        except OSError as exc:
            raise os_error(exc, f"cannot read {path / pending.file.name}") from exc
        datafile.raise_for(mismatches, str(path))
        for i, t in zip(indices, tensors, strict=True):
            result[i] = t


def _check_against_header(path: Path, f: FileRecord, records: list[TensorRecord], *,
                          verify: bool) -> None:
    """Raise unless the records match the data file's header (checked against
    its CRC32C first when verifying, so corruption is named as such)."""
    try:
        with open(path / f.name, "rb") as fh:
            covered = fh.read(f.data_start)  # what header_crc32c covers
            # The header as its own length says, whatever the manifest's data_start.
            fh.seek(0)
            head = fh.read(8)
            n = int.from_bytes(head, "little") if len(head) == 8 else 0
            prefix = head + fh.read(min(n, safetensors_file.MAX_HEADER_BYTES))
    except OSError as exc:
        raise os_error(exc, f"cannot read {path / f.name}") from exc
    if verify:
        actual = crc32c.crc32c(covered)
        if actual != f.header_crc32c:
            datafile.raise_for([datafile.Mismatch(f.name, "<header>", f.header_crc32c, actual)],
                               str(path))
    if datafile.is_header_of(covered, f, records):
        return  # the header fastpersist writes for these records, byte for byte
    try:
        data_start, entries, _ = safetensors_file.parse_header(prefix)
    except safetensors_file.HeaderError as exc:
        if not verify:
            # Unverified loads trust the data files: a damaged header (its
            # tensors may be intact) leaves the manifest's own checks.
            return
        raise CorruptCheckpointError(f"{path}: {f.name}: safetensors header: {exc}") from None
    problems = header_problems(f, records, data_start, entries)
    if problems:
        raise ManifestError(f"{path}: {problems[0]}" + (
            f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""))


@dataclass
class VerifyReport:
    path: Path
    files: int = 0
    tensors: int = 0
    bytes_checked: int = 0
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


def header_problems(f: FileRecord, records: list[TensorRecord], data_start: int,
                    entries: dict[str, safetensors_file.ParsedEntry]) -> list[str]:
    """Where the manifest's records of file `f` disagree with its safetensors header."""
    problems = []
    if data_start != f.data_start:
        problems.append(f"{f.name}: header ends at {data_start}, manifest says {f.data_start}")
    for r in records:
        e = entries.get(r.name)
        if e is None:
            problems.append(f"tensor {r.name!r} in {f.name} is missing from the file's "
                            "safetensors header")
        elif (e.dtype, e.shape, f.data_start + e.begin, e.end - e.begin) != (
            r.dtype, r.shape, r.offset, r.length
        ):
            problems.append(
                f"tensor {r.name!r} in {f.name} does not match the file's safetensors header: "
                f"the manifest says {r.dtype} {list(r.shape)} at bytes {r.offset}.."
                f"{r.offset + r.length}, the header {e.dtype} {list(e.shape)} at "
                f"{f.data_start + e.begin}..{f.data_start + e.end}")
    return problems


def _check_header(path: Path, f: FileRecord, records: list[TensorRecord]) -> list[str]:
    """The data file's own safetensors header must agree with the manifest."""
    try:
        with open(path / f.name, "rb") as fh:
            prefix = fh.read(f.data_start)
        data_start, entries, _ = safetensors_file.parse_header(prefix)
    except (OSError, safetensors_file.HeaderError) as exc:
        return [f"{f.name}: safetensors header: {exc}"]
    return header_problems(f, records, data_start, entries)


def verify(path: str | os.PathLike[str], engine: Engine,
           progress: Callable[[int], None] | None = None) -> VerifyReport:
    """Re-read every byte and check it against the manifest and checksums.

    Finds every problem rather than stopping at the first. Raises
    CheckpointNotFoundError or ManifestError when there is nothing to verify.
    """
    p = Path(path)
    manifest = read_manifest(p)
    report = VerifyReport(p)
    for f, indices in _records_by_file(manifest):
        report.files += 1
        records = [manifest.tensors[i] for i in indices]
        try:
            _check_size(p, f)
        except CorruptCheckpointError as exc:
            report.problems.append(str(exc).removeprefix(f"{p}: "))
            continue
        report.problems += _check_header(p, f, records)
        for n, items in enumerate(_batches(list(enumerate(records)), _BATCH)):
            batch = [r for _, r in items]
            report.problems += _verify_batch(p, f, batch, engine, header=n == 0)
            report.tensors += len(batch)
            done = sum(r.length for r in batch)
            report.bytes_checked += done
            if progress:
                progress(done)
    return report


def _batches(items: list[tuple[int, TensorRecord]], limit: int
             ) -> Iterator[list[tuple[int, TensorRecord]]]:
    """Consecutive groups of at most `limit` bytes (or one larger tensor); at least one."""
    batch: list[tuple[int, TensorRecord]] = []
    size = 0
    for item in items:
        if batch and size + item[1].length > limit:
            yield batch
            batch, size = [], 0
        batch.append(item)
        size += item[1].length
    yield batch


def _verify_batch(path: Path, f: FileRecord, batch: list[TensorRecord], engine: Engine,
                  *, header: bool) -> list[str]:
    try:
        _, mismatches = datafile.read(engine, str(path), f, batch, verify=True, header=header)
    except EOFError as exc:
        return [f"{f.name}: {exc}"]
    except OSError as exc:
        return [f"{f.name}: read error: {exc}"]
    problems = []
    for m in mismatches:
        what = "safetensors header" if m.tensor == "<header>" else f"tensor {m.tensor!r}"
        problems.append(f"{m.file}: {what}: CRC32C {m.actual:#010x}, expected {m.expected:#010x}")
    return problems


__all__ = ["ManifestError", "VerifyReport", "read_manifest", "read_tensors", "verify"]
