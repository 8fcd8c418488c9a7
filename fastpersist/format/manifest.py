"""The manifest: a checkpoint's table of contents, schema'd JSON, never a pickle.

It is written last: a checkpoint directory without a valid manifest is not a
checkpoint. Schema (version 1):

    {
      "format": "fastpersist-checkpoint",
      "schema_version": 1,
      "fastpersist_version": "0.1.0",
      "created_unix": 1764400000.0,
      "files":   [{"name", "size", "data_start", "header_crc32c"}],
      "tensors": [{"name", "file", "offset", "length", "dtype", "shape",
                   "crc32c", "encoding"}],
      "tree":    the saved object, see fastpersist.state
    }

`offset` is the tensor's absolute offset in its file; `encoding` is "raw"
(room for compressed encodings later without a format break).

Schema version 2 (a checkpoint saved by a torch.distributed job) adds:

      "files":   [{..., "node"}]   the node that wrote the file, when each
                                   node keeps its files on its own disk
      "globals": [{"name", "dtype", "shape", "chunks": [{"tensor", "offsets"}]}]

The job's tensors are the globals; the tree's tensor nodes refer to them. A
global is stored as chunks: each is a box of it (its shape is the tensor
record's shape) starting at `offsets`, stored as tensor record `tensor`; the
chunks tile the global exactly once. Single-process saves keep writing
version 1.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from ..errors import ManifestError
from . import dtypes

FORMAT_NAME = "fastpersist-checkpoint"
SCHEMA_VERSION = 2
DISTRIBUTED_SCHEMA_VERSION = 2
MANIFEST_NAME = "manifest.json"
ENCODINGS = frozenset({"raw"})
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
class Chunk:
    tensor: int  # index into Manifest.tensors
    offsets: tuple[int, ...]  # where the chunk starts in the global tensor


@dataclass(frozen=True)
class GlobalTensor:
    name: str
    dtype: str
    shape: tuple[int, ...]
    chunks: tuple[Chunk, ...]


@dataclass(frozen=True)
class TensorRecord:
    name: str  # the key in the data file's safetensors header
    file: str
    offset: int  # absolute file offset
    length: int
    dtype: str  # safetensors dtype name
    shape: tuple[int, ...]
    crc32c: int
    encoding: str = "raw"


@dataclass(frozen=True)
class Manifest:
    files: tuple[FileRecord, ...]
    tensors: tuple[TensorRecord, ...]
    tree: Any
    fastpersist_version: str
    created_unix: float
    schema_version: int = 1
    globals: tuple[GlobalTensor, ...] | None = None  # distributed checkpoints only

    @property
    def tensor_bytes(self) -> int:
        return sum(t.length for t in self.tensors)

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)

    def to_json(self) -> bytes:
        doc = {
            "format": FORMAT_NAME,
            "schema_version": self.schema_version,
            "fastpersist_version": self.fastpersist_version,
            "created_unix": self.created_unix,
            **records_to_json(self.files, self.tensors),
            "tree": self.tree,
        }
        if self.globals is not None:
            doc["globals"] = [
                {"name": g.name, "dtype": g.dtype, "shape": list(g.shape),
                 "chunks": [{"tensor": c.tensor, "offsets": list(c.offsets)} for c in g.chunks]}
                for g in self.globals]
        return json.dumps(doc, indent=1, allow_nan=False).encode() + b"\n"

    @staticmethod
    def from_json(data: bytes, where: str) -> Manifest:
        """Parse and validate; ManifestError names `where` and the first problem."""
        try:
            doc = json.loads(data.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ManifestError(f"{where}: manifest is not valid JSON ({exc})") from None
        return _validate(doc, where)


def records_to_json(files: Iterable[FileRecord], tensors: Iterable[TensorRecord]
                    ) -> dict[str, Any]:
    """The "files" and "tensors" of a manifest (also a daemon's part report)."""
    return {
        "files": [{k: v for k, v in vars(f).items() if k != "node" or v is not None}
                  for f in files],
        "tensors": [{**vars(t), "shape": list(t.shape)} for t in tensors],
    }


def records_from_json(doc: Any, where: str, schema_version: int = SCHEMA_VERSION
                      ) -> tuple[tuple[FileRecord, ...], tuple[TensorRecord, ...]]:
    """records_to_json's output, parsed and checked as a manifest's are."""
    if not isinstance(doc, dict):
        raise _fail(where, "top level is not an object")
    files, tensors = _records(doc.get("files"), doc.get("tensors"), schema_version, where)
    return tuple(files.values()), tuple(tensors)


def _fail(where: str, msg: str) -> ManifestError:
    return ManifestError(f"{where}: malformed manifest: {msg}")


def _int(obj: Mapping[str, Any], key: str, where: str, ctx: str, lo: int = 0) -> int:
    v = obj.get(key)
    if not isinstance(v, int) or isinstance(v, bool) or v < lo:
        raise _fail(where, f"{ctx}: {key!r} must be an integer >= {lo}, not {v!r}")
    return v


def _str(obj: Mapping[str, Any], key: str, where: str, ctx: str) -> str:
    v = obj.get(key)
    if not isinstance(v, str):
        raise _fail(where, f"{ctx}: {key!r} must be a string, not {v!r}")
    return v


def _validate(doc: Any, where: str) -> Manifest:
    if not isinstance(doc, dict):
        raise _fail(where, "top level is not an object")
    if doc.get("format") != FORMAT_NAME:
        raise _fail(where, f"'format' is {doc.get('format')!r}, expected {FORMAT_NAME!r}")
    version = _int(doc, "schema_version", where, "top level", lo=1)
    if version > SCHEMA_VERSION:
        raise ManifestError(
            f"{where}: schema version {version} is newer than this fastpersist understands "
            f"({SCHEMA_VERSION}); upgrade fastpersist to read it"
        )
    files, tensors = _records(doc.get("files"), doc.get("tensors"), version, where)
    created = doc.get("created_unix")
    if not isinstance(created, (int, float)) or isinstance(created, bool):
        raise _fail(where, "'created_unix' must be a number")
    if "tree" not in doc:
        raise _fail(where, "'tree' is missing")
    globals_ = _globals(doc, tensors, where) if "globals" in doc else None
    if globals_ is not None and version < 2:
        raise _fail(where, "'globals' needs schema version 2")
    return Manifest(
        files=tuple(files.values()),
        tensors=tuple(tensors),
        tree=doc["tree"],
        fastpersist_version=_str(doc, "fastpersist_version", where, "top level"),
        created_unix=float(created),
        schema_version=version,
        globals=globals_,
    )


def _records(files_raw: Any, tensors_raw: Any, version: int, where: str
             ) -> tuple[dict[str, FileRecord], list[TensorRecord]]:
    if not isinstance(files_raw, list) or not isinstance(tensors_raw, list):
        raise _fail(where, "'files' and 'tensors' must be lists")
    files: dict[str, FileRecord] = {}
    for i, f in enumerate(files_raw):
        ctx = f"files[{i}]"
        if not isinstance(f, dict):
            raise _fail(where, f"{ctx} is not an object")
        name = _str(f, "name", where, ctx)
        if not _FILE_NAME.match(name) or name == MANIFEST_NAME or name in files:
            raise _fail(where, f"{ctx}: bad or duplicate file name {name!r}")
        node = f.get("node")
        if node is not None and (version < 2 or not isinstance(node, str) or not node):
            raise _fail(where, f"{ctx}: 'node' must be a non-empty string (schema 2)")
        rec = FileRecord(
            name=name,
            size=_int(f, "size", where, ctx),
            data_start=_int(f, "data_start", where, ctx, lo=8),
            header_crc32c=_int(f, "header_crc32c", where, ctx),
            node=node,
        )
        if rec.data_start > rec.size:
            raise _fail(where, f"{ctx}: data_start {rec.data_start} is past size {rec.size}")
        files[name] = rec
    tensors = []
    for i, t in enumerate(tensors_raw):
        ctx = f"tensors[{i}]"
        if not isinstance(t, dict):
            raise _fail(where, f"{ctx} is not an object")
        shape = t.get("shape")
        if not isinstance(shape, list) or not all(
            isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape
        ):
            raise _fail(where, f"{ctx}: 'shape' must be a list of integers >= 0")
        rec_t = TensorRecord(
            name=_str(t, "name", where, ctx),
            file=_str(t, "file", where, ctx),
            offset=_int(t, "offset", where, ctx),
            length=_int(t, "length", where, ctx),
            dtype=_str(t, "dtype", where, ctx),
            shape=tuple(shape),
            crc32c=_int(t, "crc32c", where, ctx),
            encoding=_str(t, "encoding", where, ctx),
        )
        ctx = f"tensor {rec_t.name!r}"
        if rec_t.dtype not in dtypes.SUPPORTED_NAMES:
            raise _fail(where, f"{ctx}: unknown dtype {rec_t.dtype!r}")
        if rec_t.encoding not in ENCODINGS:
            raise _fail(where, f"{ctx}: unknown encoding {rec_t.encoding!r}")
        if rec_t.length != math.prod(rec_t.shape) * dtypes.itemsize(rec_t.dtype):
            raise _fail(where, f"{ctx}: length {rec_t.length} does not match shape and dtype")
        frec = files.get(rec_t.file)
        if frec is None:
            raise _fail(where, f"{ctx}: file {rec_t.file!r} is not listed in 'files'")
        if rec_t.offset < frec.data_start or rec_t.offset + rec_t.length > frec.size:
            raise _fail(where, f"{ctx}: bytes {rec_t.offset}..{rec_t.offset + rec_t.length} "
                        f"lie outside the data section of {rec_t.file!r}")
        tensors.append(rec_t)
    return files, tensors


def _int_list(v: Any) -> bool:
    return isinstance(v, list) and all(
        isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in v)


def _globals(doc: dict[str, Any], tensors: list[TensorRecord], where: str
             ) -> tuple[GlobalTensor, ...]:
    raw = doc["globals"]
    if not isinstance(raw, list):
        raise _fail(where, "'globals' must be a list")
    out = []
    for i, g in enumerate(raw):
        ctx = f"globals[{i}]"
        if not isinstance(g, dict) or not _int_list(g.get("shape")) or not isinstance(
                g.get("chunks"), list):
            raise _fail(where, f"{ctx}: needs 'shape' (integers >= 0) and 'chunks' (a list)")
        name, dtype = _str(g, "name", where, ctx), _str(g, "dtype", where, ctx)
        shape = tuple(g["shape"])
        chunks, volume = [], 0
        for c in g["chunks"]:
            if not isinstance(c, dict) or not _int_list(c.get("offsets")):
                raise _fail(where, f"{ctx} ({name!r}): a chunk needs 'offsets' (integers >= 0)")
            index = _int(c, "tensor", where, f"{ctx} ({name!r}) chunk")
            if index >= len(tensors):
                raise _fail(where, f"{ctx} ({name!r}): chunk refers to tensor {index}")
            t, offsets = tensors[index], tuple(c["offsets"])
            if t.dtype != dtype or len(offsets) != len(shape) or len(t.shape) != len(shape) or any(
                    o + n > d for o, n, d in zip(offsets, t.shape, shape, strict=True)):
                raise _fail(where, f"{ctx} ({name!r}): chunk {t.name!r} does not fit the tensor")
            volume += math.prod(t.shape)
            chunks.append(Chunk(index, offsets))
        if volume != math.prod(shape):
            raise _fail(where, f"{ctx} ({name!r}): chunks hold {volume} elements of "
                        f"{math.prod(shape)}")
        out.append(GlobalTensor(name, dtype, shape, tuple(chunks)))
    return tuple(out)
