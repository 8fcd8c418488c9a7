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
      "tree":    the saved object, see fastpersist.tensors.state
    }

`offset` is the tensor's absolute offset in its file; `encoding` is "raw"
(the bytes as they are, in a safetensors data file) or "zstd-bytegroup-v1"
(compressed in frames, in a data file of its own kind: records add
"stored_length" and "frames", see frames.py and packed_file.py). `length`
and `crc32c` are always those of the raw bytes.

Schema version 2 (a checkpoint saved by a torch.distributed job) adds:

      "files":   [{..., "node"}]   the node that wrote the file, when each
                                   node keeps its files on its own disk
      "globals": [{"name", "dtype", "shape", "chunks": [{"tensor", "offsets"}]}]

The job's tensors are the globals; the tree's tensor nodes refer to them. A
global is stored as chunks: each is a box of it (its shape is the tensor
record's shape) starting at `offsets`, stored as tensor record `tensor`; the
chunks tile the global exactly once. Single-process saves keep writing
version 1.

Schema version 3 lets a global leave out "chunks":

      "globals": [{"name", "dtype", "shape"}]

Its chunks are then implied by the tensor records' names: every record named
`<global name>@<offsets>`, in the records' order, is one, at the offsets
written after the name's last "@" as decimal integers joined by "," (empty
for a 0-dim global; no sign, space or leading zero: any other spelling is not
a chunk's name), its shape the record's. These are the names a distributed
save gives its pieces, so a large job's coordinator (rank 0) need not list
the chunks at all: at 16,384 ranks that is some 300,000 of them, about 0.5 s
of Python a save. Implied chunks are checked as listed ones are; a record is
never implied into a global that lists its chunks. A global may still list
them in version 3 (then they are exactly as in version 2). Readers before
version 3 refuse such a manifest ("schema version 3 is newer than this
fastpersist understands ...; upgrade fastpersist to read it").

A manifest is untrusted input and is validated as a whole when read
(records.py: files and tensor records; chunks.py: globals and their tiling;
tree.py: the saved object's tree; bounds.py: the limits on every number), so
that whatever reads a Manifest may trust it: no record shares bytes with
another, no chunk overlaps another or reuses a record, every tree reference is
in range, and no size can make arithmetic, allocation or recursion explode.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from .. import gcpause
from ..errors import ManifestError
from . import dtypes
from .bounds import MAX_MANIFEST_BYTES, is_int, malformed, numel, short
from .chunks import IMPLIED_CHUNKS_SCHEMA_VERSION, Chunk, GlobalTensor, parse_globals
from .record_scan import Scan
from .records import (
    ENCODINGS,
    MANIFEST_NAME,
    FileRecord,
    TensorRecord,
    parse_files,
    parse_tensors,
)
from .tree import check_tree

FORMAT_NAME = "fastpersist-checkpoint"
SCHEMA_VERSION = 3  # the newest this version reads
# What distributed saves write (chunks listed; implied chunks need schema 3).
DISTRIBUTED_SCHEMA_VERSION = 2
# created_unix: seconds since 1970, before the year 5000 (what datetime can show).
_LATEST_TIME = 95_617_584_000


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
        """The manifest file: one JSON object, one line per key and per file,
        tensor record and global (compact inside), so that a diff of two
        manifests shows the records that changed. Compact JSON goes through
        the json module's C encoder; indented JSON would not (it was most of
        the time of a save of 100,000 small tensors)."""
        return render(self.schema_version, self.fastpersist_version, self.created_unix,
                      [joined(map(file_json, self.files))],
                      [joined(map(tensor_json, self.tensors))],
                      None if self.globals is None else [joined(global_json(
                          g.name, g.dtype, g.shape,
                          None if g.implied else
                          [chunk_json(c.tensor, ",".join(map(str, c.offsets)))
                           for c in g.chunks]) for g in self.globals)],
                      self.tree)

    @staticmethod
    @gcpause.paused()  # a record per tensor and chunk: many objects, no cycles (gcpause)
    def from_json(data: bytes, where: str) -> Manifest:
        """Parse and validate; ManifestError names `where` and the first problem."""
        scan = Scan.of(data) if len(data) <= MAX_MANIFEST_BYTES else None
        if scan is not None:
            # The usual spelling's shortcut (record_scan.py). Whatever it does not
            # accept, the general parse below decides, and words the error.
            try:
                manifest = _build(parse_json(scan.rest, where), where, scan)
            except ManifestError:
                manifest = None
            if manifest is not None:
                return manifest
        return _validate(parse_json(data, where), where)


_encode = json.JSONEncoder(separators=(",", ":"), allow_nan=False).encode
_string = json.encoder.encode_basestring_ascii


# Items of a list in the manifest are joined with this: one item a line. A
# run of items already joined with it is itself one item of render's lists.
ITEM_SEPARATOR = ",\n  "
_ITEM_SEPARATOR_BYTES = ITEM_SEPARATOR.encode()


def render(schema_version: int, version: str, created_unix: float,
           files: Sequence[bytes | memoryview], tensors: Sequence[bytes | memoryview],
           globals_: list[bytes] | None, tree: Any) -> bytes:
    """The manifest file from its rendered parts (file_json, tensor_json,
    global_json, encoded; a run of them joined with ITEM_SEPARATOR is one
    part, bytes or a view of them): Manifest.to_json, and a distributed job's
    coordinator, which joins what its ranks rendered (distributed/written.py),
    write it the same way.
    The parts are copied once, into the file's bytes: at 16,384 ranks they
    are 60 MB, and joining them a list at a time, then the lines, then
    encoding the text, was three copies and most of the coordinator's join."""
    head = {
        "format": FORMAT_NAME,
        "schema_version": schema_version,
        "fastpersist_version": version,
        "created_unix": created_unix,
    }
    parts: list[bytes | memoryview] = [b"{\n"]
    parts += [f" {_encode(k)}: {_encode(v)},\n".encode() for k, v in head.items()]
    _json_list(parts, "files", files)
    _json_list(parts, "tensors", tensors)
    if globals_ is not None:
        _json_list(parts, "globals", globals_)
    parts.append(f' "tree": {_encode(tree)}\n}}\n'.encode())
    return b"".join(parts)


def _json_list(parts: list[bytes | memoryview], key: str,
               items: Sequence[bytes | memoryview]) -> None:
    """` "key": [` and its items, one a line, added to `parts`."""
    items = [i for i in items if i]  # an empty run of items (a rank that wrote none)
    if not items:
        parts.append(f" {_encode(key)}: [],\n".encode())
        return
    parts.append(f" {_encode(key)}: [\n  ".encode())
    for item in items:
        parts += (item, _ITEM_SEPARATOR_BYTES)
    parts[-1] = b"\n ],\n"


def joined(items: Iterable[str]) -> bytes:
    """Rendered items as one part of render's lists (ITEM_SEPARATOR between them)."""
    return ITEM_SEPARATOR.join(items).encode()


def file_json(f: FileRecord) -> str:
    """A file record as the manifest writes it (no "node" unless it has one)."""
    return _encode({k: v for k, v in vars(f).items() if k != "node" or v is not None})


def tensor_json(t: TensorRecord) -> str:
    """records_to_json's object for one tensor record, as _encode writes it
    (same keys, same order), without building the dict for a raw record."""
    if t.frames is not None:
        return _encode(t.to_json())
    shape = ",".join(map(str, map(int, t.shape)))
    return (f'{{"name":{_string(t.name)},"file":{_string(t.file)},"offset":{t.offset:d},'
            f'"length":{t.length:d},"dtype":{_string(t.dtype)},"shape":[{shape}],'
            f'"crc32c":{t.crc32c:d},"encoding":{_string(t.encoding)}}}')


def chunk_json(tensor: int, offsets: str) -> str:
    """A global's chunk; offsets: its offsets joined with ","."""
    return f'{{"tensor":{tensor:d},"offsets":[{offsets}]}}'


def global_json(name: str, dtype: str, shape: tuple[int, ...], chunks: list[str] | None
                ) -> str:
    """A global tensor, with its chunks rendered by chunk_json; chunks None:
    without "chunks", which the tensor records' names imply (schema 3)."""
    head = (f'{{"name":{_string(name)},"dtype":{_string(dtype)},'
            f'"shape":[{",".join(map(str, map(int, shape)))}]')
    return head + ("}" if chunks is None else f',"chunks":[{",".join(chunks)}]}}')


def parse_json(data: bytes, where: str) -> Any:
    """The JSON document, strictly: no NaN or infinities, no key twice in an
    object (parsers disagree on which one counts), bounded size and nesting."""
    if len(data) > MAX_MANIFEST_BYTES:
        raise ManifestError(f"{where}: the manifest is {len(data)} bytes, more than the "
                            f"{MAX_MANIFEST_BYTES} this version reads")
    try:
        return json.loads(data.decode("utf-8"), parse_constant=_no_constant,
                          object_pairs_hook=_unique_keys)
    except RecursionError:
        raise ManifestError(f"{where}: the manifest is nested too deeply to parse") from None
    except ValueError as exc:  # bad UTF-8 or JSON, NaN, a duplicate key, a 5,000-digit number
        raise ManifestError(f"{where}: manifest is not valid JSON ({exc})") from None


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not allowed")


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    obj = dict(pairs)
    if len(obj) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise ValueError(f"duplicate key {short(key)}")
            seen.add(key)
    return obj


def records_to_json(files: Iterable[FileRecord], tensors: Iterable[TensorRecord]
                    ) -> dict[str, Any]:
    """The "files" and "tensors" of a manifest (also a daemon's part report)."""
    return {
        "files": [{k: v for k, v in vars(f).items() if k != "node" or v is not None}
                  for f in files],
        "tensors": [t.to_json() for t in tensors],
    }


def records_from_json(doc: Any, where: str, schema_version: int = SCHEMA_VERSION
                      ) -> tuple[tuple[FileRecord, ...], tuple[TensorRecord, ...]]:
    """records_to_json's output, parsed and checked as a manifest's are."""
    if not isinstance(doc, dict):
        raise malformed(where, "top level is not an object")
    files = parse_files(doc.get("files"), schema_version, where)
    return tuple(files.values()), tuple(parse_tensors(doc.get("tensors"), files, where))


def _validate(doc: Any, where: str) -> Manifest:
    manifest = _build(doc, where, None)
    assert manifest is not None  # (only a scan's records may be declined)
    return manifest


def _build(doc: Any, where: str, scan: Scan | None) -> Manifest | None:
    """The manifest `doc` describes; with `scan`, a doc whose "tensors" array was
    cut out of the text: None where the scan declines its records."""
    if not isinstance(doc, dict):
        raise malformed(where, "top level is not an object")
    if doc.get("format") != FORMAT_NAME:
        raise malformed(where, f"'format' is {short(doc.get('format'))}, expected "
                        f"{FORMAT_NAME!r}")
    version = doc.get("schema_version")
    if not is_int(version, 1, None):
        raise malformed(where, f"'schema_version' must be an integer >= 1, not {short(version)}")
    if version > SCHEMA_VERSION:
        raise ManifestError(
            f"{where}: schema version {version} is newer than this fastpersist understands "
            f"({SCHEMA_VERSION}); upgrade fastpersist to read it"
        )
    files = parse_files(doc.get("files"), version, where)
    if scan is None:
        tensors = parse_tensors(doc.get("tensors"), files, where)
    else:
        scanned = scan.records(files) if doc.get("tensors") == scan.marker else None
        if scanned is None:
            return None
        tensors = scanned
    created = doc.get("created_unix")
    if not isinstance(created, int | float) or isinstance(created, bool) or not (
            0 <= created <= _LATEST_TIME):
        raise malformed(where, f"'created_unix' must be a time in seconds since 1970, not "
                        f"{short(created)}")
    version_text = doc.get("fastpersist_version")
    if not isinstance(version_text, str):
        raise malformed(where, "'fastpersist_version' must be a string")
    if "tree" not in doc:
        raise malformed(where, "'tree' is missing")
    globals_ = None
    if "globals" in doc:
        if version < 2:
            raise malformed(where, "'globals' needs schema version 2")
        globals_ = parse_globals(doc["globals"], tensors, where, version)
        entry_bytes = [numel(g.shape) * dtypes.itemsize(g.dtype) for g in globals_]
    else:
        entry_bytes = [t.length for t in tensors]
    check_tree(doc["tree"], entry_bytes, where)
    return Manifest(
        files=tuple(files.values()),
        tensors=tuple(tensors),
        tree=doc["tree"],
        fastpersist_version=version_text,
        created_unix=float(created),
        schema_version=version,
        globals=globals_,
    )


__all__ = [
    "DISTRIBUTED_SCHEMA_VERSION", "ENCODINGS", "FORMAT_NAME", "IMPLIED_CHUNKS_SCHEMA_VERSION",
    "MANIFEST_NAME", "SCHEMA_VERSION",
    "Chunk", "FileRecord", "GlobalTensor", "Manifest", "TensorRecord", "parse_json",
    "records_from_json", "records_to_json",
]
