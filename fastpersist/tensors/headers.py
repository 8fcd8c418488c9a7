"""A data file's own header against the manifest: reading it (either kind of
data file), parsing it, and naming where the two disagree."""

from __future__ import annotations

import operator
from pathlib import Path
from typing import BinaryIO

import crc32c

from ..errors import CorruptCheckpointError, ManifestError
from ..format import packed_file, safetensors_file
from ..format.manifest import FileRecord, TensorRecord
from ..storage.commit import os_error
from .mismatch import Mismatch, raise_for


def _header_end(first: bytes) -> int:
    """Where a data file's header ends, as its own length says (whatever the
    manifest says), from the file's first 16 bytes: a safetensors header, or
    a packed one after its magic (format/packed_file.py)."""
    at = 16 if packed_file.is_packed(first[:8]) else 8
    head = first[at - 8:at]
    n = int.from_bytes(head, "little") if len(head) == 8 else 0
    return at + min(n, safetensors_file.MAX_HEADER_BYTES)


def read_header_prefix(fh: BinaryIO) -> bytes:
    """A data file's header, as its own length says."""
    fh.seek(0)
    end = _header_end(fh.read(16))
    fh.seek(0)
    return fh.read(end)


def _prefix_within(covered: bytes) -> bytes | None:
    """read_header_prefix of bytes already read, or None where the header's
    own length reaches past them."""
    end = _header_end(covered[:16])
    return covered[:end] if end <= len(covered) else None


def parse_header(prefix: bytes) -> tuple[int, dict[str, safetensors_file.ParsedEntry],
                                         dict[str, str]]:
    """Either kind of data file's header (HeaderError if malformed)."""
    if packed_file.is_packed(prefix):
        return packed_file.parse_header(prefix)
    return safetensors_file.parse_header(prefix)


def is_header_of(covered: bytes, file: FileRecord, records: list[TensorRecord]) -> bool:
    """Whether `covered` (the file's first data_start bytes) is exactly the header
    that datafile.write() makes for `records` and nothing else: then the file's header
    says what the records say, byte for byte, without parsing it. (False says
    nothing: another writer's metadata, another order, a tensor the records do
    not name; the caller then parses the header and compares.)"""
    order = sorted(records, key=operator.attrgetter("offset"))
    cursor = file.data_start
    for r in order:  # back to back from data_start
        if r.offset != cursor:
            return False
        cursor += r.length
    entries = [(r.name, r.dtype, r.shape, r.length) for r in order]
    if any(r.name == "__metadata__" for r in order):  # layout()'s dict decides that header
        blob = safetensors_file.layout([safetensors_file.HeaderEntry(*e) for e in entries],
                                       safetensors_file.DATA_FILE_METADATA).header
    else:  # (a manifest's names are unique)
        blob = safetensors_file.padded(
            safetensors_file.header_json(entries, safetensors_file.DATA_FILE_METADATA))
    return len(blob) == file.data_start and blob == covered


def check_against_header(path: Path, f: FileRecord, records: list[TensorRecord], *,
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
            raise_for([Mismatch(f.name, "<header>", f.header_crc32c, actual)], str(path))
    check_header_bytes(path, f, records, covered, verify=verify, prefix=prefix)


def check_header_bytes(path: Path, f: FileRecord, records: list[TensorRecord],
                       covered: bytes, *, verify: bool,
                       prefix: bytes | None = None) -> None:
    """check_against_header of a header already read: `covered` is the file's
    first data_start bytes, whose CRC32C the caller has checked when verifying.
    (prefix: the header as its own length says; read from the file only where
    that reaches past data_start, which no header that matches does.)"""
    if not packed_file.is_packed(covered[:8]) and is_header_of(covered, f, records):
        return  # the header write() makes for these records, byte for byte: nothing to parse
    if prefix is None:
        prefix = _prefix_within(covered)
    if prefix is None:
        try:
            with open(path / f.name, "rb") as fh:
                prefix = read_header_prefix(fh)
        except OSError as exc:
            raise os_error(exc, f"cannot read {path / f.name}") from exc
    try:
        data_start, entries, _ = parse_header(prefix)
    except safetensors_file.HeaderError as exc:
        if not verify:
            # Unverified loads trust the data files: a damaged header (its
            # tensors may be intact) leaves the manifest's own checks.
            return
        raise CorruptCheckpointError(f"{path}: {f.name}: {header_kind(prefix)} header: {exc}"
                                     ) from None
    problems = header_problems(f, records, data_start, entries)
    if problems:
        raise ManifestError(f"{path}: {problems[0]}" + (
            f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""))


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


def header_kind(prefix: bytes) -> str:
    """'packed' or 'safetensors': the kind of data file a header prefix is."""
    return "packed" if packed_file.is_packed(prefix) else "safetensors"
