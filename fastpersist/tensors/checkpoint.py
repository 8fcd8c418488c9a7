"""Reading a committed checkpoint: its manifest, its tensors, and verification."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

import crc32c
import torch

from ..engine import Engine, IOResult
from ..errors import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
    ManifestError,
    TruncatedFileError,
)
from ..format import packed_file, safetensors_file
from ..format.bounds import MAX_MANIFEST_BYTES
from ..format.manifest import MANIFEST_NAME, FileRecord, Manifest, TensorRecord
from ..storage.commit import find_leftovers, os_error, parse_leftover
from . import datafile, packed


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
    return Manifest.from_json(data, str(p))


# Reads that report progress of compressed files, and verify's reads (to bound
# their memory), go in batches of at most this many tensor bytes.
_BATCH = 256 << 20
# Files (or verify's batches) whose engine reads run at once. Two keep the disk
# busy across a file's uneven last reads and the next one's start, and let the
# caller check and allocate a file while others are read.
_FILES_IN_FLIGHT = 2


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
                 progress: Callable[[int], None] | None = None,
                 spans: Mapping[int, packed.Span] | None = None) -> list[torch.Tensor]:
    """Every stored tensor, on the CPU, in manifest order; raises on corruption.

    Each file's records must agree with the file's own header (names, dtypes,
    shapes, places, encodings), so that a manifest can only name bytes that
    were written for the tensor it says, even with verify=False.
    progress(n) is called as each file or batch of n tensor bytes has been read.
    spans: record index -> the raw bytes start..end the caller needs of it; a
    compressed record is then decoded only where its frames overlap the span
    (the rest is zeros, and each frame's stored CRC32C is what is checked).
    Raw records are read whole, so that their CRC32C is checked.
    """
    result: list[torch.Tensor | None] = [None] * len(manifest.tensors)
    if len(manifest.files) > 1 and all(r.frames is None for r in manifest.tensors):
        _read_overlapped(path, manifest, engine, verify, result, progress)
        return result  # type: ignore[return-value]  # every record belongs to one file
    for f, indices in _records_by_file(manifest):
        _check_size(path, f)
        records = [manifest.tensors[i] for i in indices]
        _check_against_header(path, f, records, verify=verify)
        # Batches only when someone watches; one engine call per file otherwise.
        limit = _BATCH if progress else max(1, sum(r.length for r in records))
        for batch in _batches(list(zip(indices, records, strict=True)), limit):
            batch_records = [r for _, r in batch]
            for i, t in _read_batch(path, f, batch, engine, verify, spans or {}):
                result[i] = t
            if progress:
                progress(sum(r.length for r in batch_records))
    assert all(t is not None for t in result)  # every record belongs to one listed file
    return result  # type: ignore[return-value]


def _read_overlapped(path: Path, manifest: Manifest, engine: Engine, verify: bool,
                     result: list[torch.Tensor | None],
                     progress: Callable[[int], None] | None) -> None:
    """read_tensors of raw records, several files: the engine reads up to
    _FILES_IN_FLIGHT files on reader threads (the GIL released) while this
    thread checks and allocates the next. Errors come in file order, and
    progress a file at a time, on this thread."""
    in_flight: list[tuple[list[int], datafile.PendingRead, Future[IOResult]]] = []
    with ThreadPoolExecutor(_FILES_IN_FLIGHT, thread_name_prefix="fastpersist-read") as readers:
        # (Leaving the block waits for reads still running: nothing frees their memory.)
        try:
            for f, indices in _records_by_file(manifest):
                _check_size(path, f)
                records = [manifest.tensors[i] for i in indices]
                _check_against_header(path, f, records, verify=verify)
                if len(in_flight) >= _FILES_IN_FLIGHT:
                    _finish_read(path, *in_flight.pop(0), result, progress)
                pending = datafile.start_read(str(path), f, records, verify=verify,
                                              header=False)
                in_flight.append((indices, pending,
                                  readers.submit(datafile.run_read, engine, pending)))
        except BaseException:
            while in_flight:  # an earlier file's error goes first
                _finish_read(path, *in_flight.pop(0), result, progress)
            raise
        while in_flight:
            _finish_read(path, *in_flight.pop(0), result, progress)


def _finish_read(path: Path, indices: list[int], pending: datafile.PendingRead,
                 future: Future[IOResult], result: list[torch.Tensor | None],
                 progress: Callable[[int], None] | None) -> None:
    try:
        tensors, mismatches = datafile.finish_read(pending, future.result())
    except EOFError as exc:
        raise TruncatedFileError(f"{path}: {exc}") from None
    except OSError as exc:
        raise os_error(exc, f"cannot read {path / pending.file.name}") from exc
    datafile.raise_for(mismatches, str(path))
    for i, t in zip(indices, tensors, strict=True):
        result[i] = t
    if progress:
        progress(sum(r.length for r in pending.records))


def _read_batch(path: Path, f: FileRecord, batch: list[tuple[int, TensorRecord]],
                engine: Engine, verify: bool, spans: Mapping[int, packed.Span]
                ) -> list[tuple[int, torch.Tensor]]:
    raw = [(i, r) for i, r in batch if r.frames is None]
    encoded = [(i, r) for i, r in batch if r.frames is not None]
    out: list[tuple[int, torch.Tensor]] = []
    try:
        if raw:
            tensors, mismatches = datafile.read(engine, str(path), f, [r for _, r in raw],
                                                verify=verify, header=False)
            datafile.raise_for(mismatches, str(path))
            out += zip((i for i, _ in raw), tensors, strict=True)
        if encoded:
            tensors, outcome = packed.read(packed.local_reader(engine, str(path), f),
                                           f, [r for _, r in encoded],
                                           verify=verify,
                                           spans=[spans.get(i) for i, _ in encoded])
            datafile.raise_for(outcome.mismatches, str(path))
            if outcome.undecodable:
                raise CorruptCheckpointError(f"{path}: {outcome.undecodable[0]}")
            out += zip((i for i, _ in encoded), tensors, strict=True)
    except EOFError as exc:
        raise TruncatedFileError(f"{path}: {exc}") from None
    except OSError as exc:
        raise os_error(exc, f"cannot read {path / f.name}") from exc
    return out


def read_header_prefix(fh: BinaryIO) -> bytes:
    """A data file's header, as its own length says (whatever the manifest
    says): a safetensors header or a packed one (format/packed_file.py)."""
    fh.seek(0)
    head = fh.read(8)
    magic = b""
    if packed_file.is_packed(head):
        magic, head = head, fh.read(8)
    n = int.from_bytes(head, "little") if len(head) == 8 else 0
    return magic + head + fh.read(min(n, safetensors_file.MAX_HEADER_BYTES))


def parse_header(prefix: bytes) -> tuple[int, dict[str, safetensors_file.ParsedEntry],
                                         dict[str, str]]:
    """Either kind of data file's header (HeaderError if malformed)."""
    if packed_file.is_packed(prefix):
        return packed_file.parse_header(prefix)
    return safetensors_file.parse_header(prefix)


def _check_against_header(path: Path, f: FileRecord, records: list[TensorRecord], *,
                          verify: bool) -> None:
    """Raise unless the records match the data file's header (checked against
    its CRC32C first when verifying, so corruption is named as such)."""
    try:
        with open(path / f.name, "rb") as fh:
            covered = fh.read(f.data_start)  # what header_crc32c covers
            prefix = read_header_prefix(fh)
    except OSError as exc:
        raise os_error(exc, f"cannot read {path / f.name}") from exc
    if verify:
        actual = crc32c.crc32c(covered)
        if actual != f.header_crc32c:
            datafile.raise_for([datafile.Mismatch(f.name, "<header>", f.header_crc32c, actual)],
                               str(path))
    if not packed_file.is_packed(covered[:8]) and datafile.is_header_of(covered, f, records):
        return  # the header write() makes for these records, byte for byte: nothing to parse
    try:
        data_start, entries, _ = parse_header(prefix)
    except safetensors_file.HeaderError as exc:
        if not verify:
            # Unverified loads trust the data files: a damaged header (its
            # tensors may be intact) leaves the manifest's own checks.
            return
        raise CorruptCheckpointError(f"{path}: {f.name}: {_kind(prefix)} header: {exc}"
                                     ) from None
    problems = header_problems(f, records, data_start, entries)
    if problems:
        raise ManifestError(f"{path}: {problems[0]}" + (
            f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""))


@dataclass
class VerifyReport:
    path: Path | str  # a local path, or an s3:// URL
    files: int = 0
    tensors: int = 0
    bytes_checked: int = 0
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


def header_problems(f: FileRecord, records: list[TensorRecord], data_start: int,
                    entries: dict[str, safetensors_file.ParsedEntry]) -> list[str]:
    """Where the manifest's records of file `f` disagree with its header."""
    problems = []
    if data_start != f.data_start:
        problems.append(f"{f.name}: header ends at {data_start}, manifest says {f.data_start}")
    for r in records:
        e = entries.get(r.name)
        if e is None:
            problems.append(f"tensor {r.name!r} in {f.name} is missing from the file's "
                            "header")
        elif (e.dtype, e.shape, f.data_start + e.begin, e.end - e.begin, e.encoding) != (
            r.dtype, r.shape, r.offset, r.stored_span, r.encoding
        ):
            problems.append(
                f"tensor {r.name!r} in {f.name} does not match the file's header: "
                f"the manifest says {r.dtype} {list(r.shape)} {r.encoding} at bytes "
                f"{r.offset}..{r.offset + r.stored_span}, the header {e.dtype} "
                f"{list(e.shape)} {e.encoding} at "
                f"{f.data_start + e.begin}..{f.data_start + e.end}")
    return problems


def _kind(prefix: bytes) -> str:
    return "packed" if packed_file.is_packed(prefix) else "safetensors"


def _check_header(path: Path, f: FileRecord, records: list[TensorRecord]) -> list[str]:
    """The data file's own header must agree with the manifest."""
    prefix = b""
    try:
        with open(path / f.name, "rb") as fh:
            prefix = fh.read(f.data_start)
        data_start, entries, _ = parse_header(prefix)
    except (OSError, safetensors_file.HeaderError) as exc:
        return [f"{f.name}: {_kind(prefix)} header: {exc}"]
    return header_problems(f, records, data_start, entries)


def verify(path: str | os.PathLike[str], engine: Engine,
           progress: Callable[[int], None] | None = None, *, decode: bool = True
           ) -> VerifyReport:
    """Re-read every byte and check it against the manifest and checksums.

    Compressed tensors: each stored frame's CRC32C, and unless decode=False,
    the raw CRC32C of the decoded tensor as a load checks it. Finds every
    problem rather than stopping at the first. Raises CheckpointNotFoundError
    or ManifestError when there is nothing to verify.
    """
    p = Path(path)
    manifest = read_manifest(p)
    report = VerifyReport(p)
    # Problems in file order; batches read on reader threads, as a load's files.
    found: list[list[str] | tuple[list[TensorRecord], Future[list[str]]]] = []
    readers = ThreadPoolExecutor(_FILES_IN_FLIGHT, thread_name_prefix="fastpersist-verify")
    try:
        for f, indices in _records_by_file(manifest):
            report.files += 1
            records = [manifest.tensors[i] for i in indices]
            try:
                _check_size(p, f)
            except CorruptCheckpointError as exc:
                found.append([str(exc).removeprefix(f"{p}: ")])
                continue
            found.append(_check_header(p, f, records))
            for n, items in enumerate(_batches(list(enumerate(records)), _BATCH)):
                batch = [r for _, r in items]
                found.append((batch, readers.submit(_verify_batch, p, f, batch, engine,
                                                    header=n == 0, decode=decode)))
        for item in found:
            if isinstance(item, list):
                report.problems += item
                continue
            batch, future = item
            report.problems += future.result()
            report.tensors += len(batch)
            done = sum(r.length for r in batch)
            report.bytes_checked += done
            if progress:
                progress(done)
    finally:  # an error or an interrupt (^C in fpctl) reads no further batch
        readers.shutdown(cancel_futures=True)
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
                  *, header: bool, decode: bool) -> list[str]:
    raw = [r for r in batch if r.frames is None]
    encoded = [r for r in batch if r.frames is not None]
    mismatches: list[datafile.Mismatch] = []
    problems = []
    try:
        if raw or header:
            mismatches += datafile.read(engine, str(path), f, raw, verify=True,
                                        header=header)[1]
        if encoded:
            _, outcome = packed.read(packed.local_reader(engine, str(path), f), f, encoded,
                                     verify=True, decode=decode)
            mismatches += outcome.mismatches
            problems += outcome.undecodable
    except EOFError as exc:
        return [f"{f.name}: {exc}"]
    except OSError as exc:
        return [f"{f.name}: read error: {exc}"]
    return problems_of(mismatches) + problems


def problems_of(mismatches: list[datafile.Mismatch]) -> list[str]:
    """verify()'s lines for CRC32C mismatches."""
    return [f"{m.file}: {m.what().removeprefix('the ')}: CRC32C {m.actual:#010x}, expected "
            f"{m.expected:#010x}" for m in mismatches]


__all__ = ["ManifestError", "VerifyReport", "read_manifest", "read_tensors", "verify"]
