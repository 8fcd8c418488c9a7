"""A manifest's records of data files and of the tensors in them, parsed and
checked as a whole.

Each record is checked on its own (types, bounds, known dtype and encoding,
length = elements x element size, bytes inside its file's data section, and
a compressed record's frame index: frames.py), and then against the others:
file names and tensor names are unique, and no two tensors of a file share
a byte (of its stored bytes), so that a record can only ever denote bytes
that were written for it. Torch-free.
"""

from __future__ import annotations

import dataclasses
import itertools
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from . import dtypes
from .bounds import (
    CRC_MAX,
    MAX_DIMS,
    MAX_ELEMENTS,
    MAX_FILE_BYTES,
    is_int,
    malformed,
    numel,
    shape_problem,
    short,
)
from .frames import (
    ENCODINGS,
    RAW,
    Frame,
    check_stored_length,
    frames_to_json,
    parse_frames,
)
from .safetensors_file import MAX_HEADER_BYTES

MANIFEST_NAME = "manifest.json"
__all__ = ["ENCODINGS", "Frame"]  # re-exported for the manifest's readers
# Data file names are plain names inside the checkpoint directory: a manifest
# can never send a reader outside it.
_FILE_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._-]{0,200}$")


@dataclass(frozen=True)
class FileRecord:
    name: str
    size: int
    data_start: int
    header_crc32c: int
    node: str | None = None  # node-local checkpoints: the node that holds it


@dataclass(frozen=True)
class TensorRecord:
    name: str  # the key in the data file's safetensors header
    file: str
    offset: int  # absolute file offset
    length: int
    dtype: str  # safetensors dtype name
    shape: tuple[int, ...]
    crc32c: int  # of the raw bytes, whatever the encoding
    encoding: str = RAW
    # Compressed records only (encoding != "raw", see frames.py): the stored
    # bytes at `offset` and the frames they hold.
    stored_length: int | None = None
    frames: tuple[Frame, ...] | None = None

    @property
    def stored_span(self) -> int:
        """The bytes the record takes in its file (from `offset`)."""
        return self.length if self.stored_length is None else self.stored_length

    def to_json(self) -> dict[str, Any]:
        doc: dict[str, Any] = {
            "name": self.name, "file": self.file, "offset": self.offset,
            "length": self.length, "dtype": self.dtype, "shape": list(self.shape),
            "crc32c": self.crc32c, "encoding": self.encoding}
        if self.frames is not None:
            doc["stored_length"] = self.stored_length
            doc["frames"] = frames_to_json(self.frames)
        return doc


class _Ctx:
    """A record's place in error messages, made text only when one is raised
    (a manifest has a million records; short() is not free)."""

    __slots__ = ("i", "name")

    def __init__(self, i: int, name: str) -> None:
        self.i, self.name = i, name

    def __str__(self) -> str:
        return f"tensors[{self.i}] ({short(self.name)})"


def _int(obj: Mapping[str, Any], key: str, where: str, ctx: object, lo: int = 0,
         hi: int = MAX_FILE_BYTES) -> int:
    v = obj.get(key)
    if not is_int(v, lo, hi):
        raise malformed(where, f"{ctx}: {key!r} must be an integer from {lo} to {hi}, "
                        f"not {short(v)}")
    return int(v)


def _str(obj: Mapping[str, Any], key: str, where: str, ctx: object) -> str:
    v = obj.get(key)
    if not isinstance(v, str):
        raise malformed(where, f"{ctx}: {key!r} must be a string, not {short(v)}")
    return v


def parse_files(raw: Any, version: int, where: str) -> dict[str, FileRecord]:
    if not isinstance(raw, list):
        raise malformed(where, "'files' must be a list")
    files: dict[str, FileRecord] = {}
    for i, f in enumerate(raw):
        ctx = f"files[{i}]"
        if not isinstance(f, dict):
            raise malformed(where, f"{ctx} is not an object")
        name = _str(f, "name", where, ctx)
        if not _FILE_NAME.match(name) or name == MANIFEST_NAME or name in files:
            raise malformed(where, f"{ctx}: bad or duplicate file name {short(name)}")
        node = f.get("node")
        if node is not None and (version < 2 or not isinstance(node, str) or not node):
            raise malformed(where, f"{ctx}: 'node' must be a non-empty string (schema 2)")
        rec = FileRecord(
            name=name,
            size=_int(f, "size", where, ctx),
            # The header is read whole: bounded as safetensors bounds it.
            data_start=_int(f, "data_start", where, ctx, lo=8, hi=8 + MAX_HEADER_BYTES),
            header_crc32c=_int(f, "header_crc32c", where, ctx, hi=CRC_MAX),
            node=node,
        )
        if rec.data_start > rec.size:
            raise malformed(where, f"{ctx}: data_start {rec.data_start} is past size {rec.size}")
        files[name] = rec
    return files


def parse_tensors(raw: Any, files: Mapping[str, FileRecord], where: str
                  ) -> list[TensorRecord]:
    if not isinstance(raw, list):
        raise malformed(where, "'tensors' must be a list")
    tensors: list[TensorRecord] = []
    index_of: dict[str, int] = {}
    for i, t in enumerate(raw):
        if not isinstance(t, dict):
            raise malformed(where, f"tensors[{i}] is not an object")
        name = _str(t, "name", where, f"tensors[{i}]")
        if name in index_of:
            # A reader keyed by name would take one record's bytes for the other's.
            raise malformed(where, f"tensors[{i}]: duplicate name {short(name)} (also "
                            f"tensors[{index_of[name]}])")
        index_of[name] = i
        tensors.append(_plain_tensor(t, name, files) or _tensor(t, i, name, files, where))
    _check_disjoint(tensors, where)
    return tensors


def _plain_tensor(t: dict[str, Any], name: str, files: Mapping[str, FileRecord]
                  ) -> TensorRecord | None:
    """The record, if `t` passes every check of _tensor; None otherwise, and
    _tensor then finds the problem and words it. The checks of _tensor in one
    expression: a manifest has a record per tensor, and this is most of the
    time of parsing one of many small tensors."""
    file, offset, length = t.get("file"), t.get("offset"), t.get("length")
    dtype, shape, crc, encoding = t.get("dtype"), t.get("shape"), t.get("crc32c"), t.get("encoding")
    if not (type(file) is str and type(offset) is int and type(length) is int
            and type(crc) is int and type(shape) is list and len(shape) <= MAX_DIMS
            and 0 <= offset <= MAX_FILE_BYTES and 0 <= length <= MAX_FILE_BYTES
            and 0 <= crc <= CRC_MAX and type(dtype) is str and dtype in dtypes.SUPPORTED_NAMES
            and encoding == RAW and "frames" not in t and "stored_length" not in t):
        return None  # (a compressed record: _tensor checks its frames)
    numel = span = 1
    for d in shape:
        if type(d) is not int or not 0 <= d <= MAX_ELEMENTS:
            return None
        numel *= d
        span *= d or 1
        if span > MAX_ELEMENTS:
            return None
    frec = files.get(file)
    if (frec is None or length != numel * dtypes.itemsize(dtype) or offset < frec.data_start
            or offset + length > frec.size):
        return None
    # As TensorRecord(...) makes it (the fields in its __dict__), without the
    # frozen dataclass's __init__, which sets each field through object.__setattr__
    # (1.3 us a record; this, 0.6).
    record: TensorRecord = _new(TensorRecord)
    record.__dict__.update(name=name, file=file, offset=offset, length=length, dtype=dtype,
                           shape=tuple(shape), crc32c=crc, encoding=encoding,
                           stored_length=None, frames=None)
    return record


_new = object.__new__


def _tensor(t: dict[str, Any], i: int, name: str, files: Mapping[str, FileRecord],
            where: str) -> TensorRecord:
    ctx = _Ctx(i, name)
    shape = t.get("shape")
    problem = shape_problem(shape)
    if problem is not None:
        raise malformed(where, f"{ctx}: shape {short(shape)} {problem}")
    rec = TensorRecord(
        name=name,
        file=_str(t, "file", where, ctx),
        offset=_int(t, "offset", where, ctx),
        length=_int(t, "length", where, ctx),
        dtype=_str(t, "dtype", where, ctx),
        shape=tuple(shape),  # type: ignore[arg-type]  # checked by shape_problem
        crc32c=_int(t, "crc32c", where, ctx, hi=CRC_MAX),
        encoding=_str(t, "encoding", where, ctx),
    )
    if rec.dtype not in dtypes.SUPPORTED_NAMES:
        raise malformed(where, f"{ctx}: unknown dtype {short(rec.dtype)}")
    if rec.encoding not in ENCODINGS:
        raise malformed(where, f"{ctx}: unknown encoding {short(rec.encoding)}")
    if rec.length != numel(rec.shape) * dtypes.itemsize(rec.dtype):
        raise malformed(where, f"{ctx}: length {rec.length} does not match shape and dtype")
    if rec.encoding == RAW:
        if "stored_length" in t or "frames" in t:
            raise malformed(where, f"{ctx}: a raw record has no 'stored_length' or 'frames'")
    else:
        stored = check_stored_length(t.get("stored_length"), where, ctx)
        rec = dataclasses.replace(rec, stored_length=stored, frames=parse_frames(
            t.get("frames"), rec.length, stored, dtypes.itemsize(rec.dtype), where, ctx))
    frec = files.get(rec.file)
    if frec is None:
        raise malformed(where, f"{ctx}: file {short(rec.file)} is not listed in 'files'")
    end = rec.offset + rec.stored_span
    if rec.offset < frec.data_start or end > frec.size:
        raise malformed(where, f"{ctx}: bytes {rec.offset}..{end} lie "
                        f"outside the data section of {rec.file!r}")
    return rec


def _check_disjoint(tensors: list[TensorRecord], where: str) -> None:
    """No two tensors of one file share a byte (as safetensors requires)."""
    # Per file, sorted by (start, end, index): integer tuples only, which a
    # manifest of many tensors sorts twice as fast as with the file's name in each.
    by_file: dict[str, list[tuple[int, int, int]]] = {}
    for i, t in enumerate(tensors):
        span = t.stored_span
        if span:
            by_file.setdefault(t.file, []).append((t.offset, t.offset + span, i))
    for file in sorted(by_file):
        spans = sorted(by_file[file])
        for (_, end_a, a), (start_b, end_b, b) in itertools.pairwise(spans):
            if start_b < end_a:
                raise malformed(where, f"tensors[{b}] ({short(tensors[b].name)}): bytes "
                                f"{start_b}..{end_b} overlap tensors[{a}] "
                                f"({short(tensors[a].name)}) in {file!r}")
