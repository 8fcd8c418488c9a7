"""fpctl verify's reading: every byte of a checkpoint against its manifest and
checksums, every problem found rather than the first. Torch-free unless the
checkpoint has compressed files (see committed.py)."""

from __future__ import annotations

import os
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from ..engine import Engine, Unkept
from ..errors import CorruptCheckpointError
from ..format import safetensors_file
from ..format.manifest import FileRecord, Manifest, TensorRecord
from .committed import (
    BATCH_BYTES,
    FILES_IN_FLIGHT,
    batches,
    check_size,
    read_manifest,
    records_by_file,
)
from .headers import header_kind, header_problems, parse_header
from .mismatch import Mismatch, mismatches_of


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


def check_header(path: Path, f: FileRecord, records: list[TensorRecord]) -> list[str]:
    """The data file's own header must agree with the manifest."""
    prefix = b""
    try:
        with open(path / f.name, "rb") as fh:
            prefix = fh.read(f.data_start)
        data_start, entries, _ = parse_header(prefix)
    except (OSError, safetensors_file.HeaderError) as exc:
        return [f"{f.name}: {header_kind(prefix)} header: {exc}"]
    return header_problems(f, records, data_start, entries)


def verify(path: str | os.PathLike[str], engine: Engine,
           progress: Callable[[int], None] | None = None, *, decode: bool = True,
           manifest: Manifest | None = None) -> VerifyReport:
    """Re-read every byte and check it against the manifest and checksums.

    Compressed tensors: each stored frame's CRC32C, and unless decode=False,
    the raw CRC32C of the decoded tensor as a load checks it. Finds every
    problem rather than stopping at the first. Raises CheckpointNotFoundError
    or ManifestError when there is nothing to verify. manifest: the one the
    caller already read at `path`, so that it is read once.
    """
    p = Path(path)
    manifest = manifest or read_manifest(p)
    report = VerifyReport(p)
    # Problems in file order; batches read on reader threads, as a load's files.
    found: list[list[str] | tuple[list[TensorRecord], Future[list[str]]]] = []
    readers = ThreadPoolExecutor(FILES_IN_FLIGHT, thread_name_prefix="fastpersist-verify")
    try:
        for f, indices in records_by_file(manifest):
            report.files += 1
            records = [manifest.tensors[i] for i in indices]
            try:
                check_size(p, f)
            except CorruptCheckpointError as exc:
                found.append([str(exc).removeprefix(f"{p}: ")])
                continue
            found.append(check_header(p, f, records))
            for n, items in enumerate(batches(list(enumerate(records)), BATCH_BYTES)):
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


def checksum_mismatches(engine: Engine, path: Path, f: FileRecord,
                        records: list[TensorRecord], *, header: bool
                        ) -> list[Mismatch]:
    """The raw records (and the header, if asked) of file `f` whose bytes do
    not have their CRC32C. The bytes are only checksummed (unkept segments):
    the engine reads them through its bounce buffers, which are reused and
    physically contiguous (huge pages), and no memory the size of the file is
    allocated or faulted in."""
    segments: list[Unkept] = [(None, 0, f.data_start)] if header else []
    segments += [(None, r.offset, r.length) for r in records]
    result = engine.read_file(str(path / f.name), segments, checksum=True)
    assert result.crcs is not None
    return mismatches_of(f, records, header, result.crcs)


def _verify_batch(path: Path, f: FileRecord, batch: list[TensorRecord], engine: Engine,
                  *, header: bool, decode: bool) -> list[str]:
    raw = [r for r in batch if r.frames is None]
    encoded = [r for r in batch if r.frames is not None]
    mismatches: list[Mismatch] = []
    problems = []
    try:
        if raw or header:
            mismatches += checksum_mismatches(engine, path, f, raw, header=header)
        if encoded:
            # Only here: decoding builds tensors, and a checkpoint without
            # compressed files is verified without importing torch.
            from . import packed

            _, outcome = packed.read(packed.local_reader(engine, str(path), f), f, encoded,
                                     verify=True, decode=decode)
            mismatches += outcome.mismatches
            problems += outcome.undecodable
    except EOFError as exc:
        return [f"{f.name}: {exc}"]
    except OSError as exc:
        return [f"{f.name}: read error: {exc}"]
    return problems_of(mismatches) + problems


def problems_of(mismatches: list[Mismatch]) -> list[str]:
    """verify()'s lines for CRC32C mismatches."""
    return [f"{m.file}: {m.what().removeprefix('the ')}: CRC32C {m.actual:#010x}, expected "
            f"{m.expected:#010x}" for m in mismatches]


__all__ = ["VerifyReport", "check_header", "problems_of", "verify"]
