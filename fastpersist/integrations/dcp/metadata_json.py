"""DCP's Metadata as JSON (never a pickle), and back, checked against the manifest.

The file (DCP_METADATA_NAME, committed with the checkpoint, before its
manifest):

    {"format": "fastpersist-dcp", "version": 1, "crc32c": CRC of "body" below,
     "body": {
       "dcp_version": "1.0.0",
       "crc_block": 4194304,
       "tensors": [{"fqn", "dtype", "layout", "requires_grad", "memory_format",
                    "pin_memory", "size": [...],
                    "chunks": [{"offsets": [...], "sizes": [...]}]}],
       "bytes":   ["fqn", ...],
       "items":   [{"fqn", "offset": [...] | null, "index": int | null,
                    "record": name, "block_crcs": [...]}],
       "planner_data": a fastpersist state tree (fastpersist.tensors.state) | null,
       "storage_meta": {"checkpoint_id", "save_id", "load_id", "modules"} | null}}

"crc32c" covers the body serialised canonically (sorted keys, no spaces), so
a damaged file is reported as such. "items" is Metadata.storage_data: for
each MetadataIndex, the tensor record in manifest.json that holds it (file,
offset, length, dtype, shape and the CRC32C of the whole item come from the
manifest, which is the one source of those) and, for an item larger than
crc_block, the CRC32C of each block (blocks.py).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

import crc32c
import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from ...adapters import Manifest, dtype_name, parse_json, plain_tree, plain_value
from ...errors import CorruptCheckpointError, ManifestError, UnsupportedValueError
from .blocks import CRC_BLOCK

DCP_METADATA_NAME = "dcp_metadata.json"
FORMAT = "fastpersist-dcp"
VERSION = 1

_LAYOUTS = {"strided": torch.strided, "sparse_coo": torch.sparse_coo}
_MEMORY_FORMATS = {"contiguous_format": torch.contiguous_format,
                   "channels_last": torch.channels_last,
                   "channels_last_3d": torch.channels_last_3d,
                   "preserve_format": torch.preserve_format}


@dataclass(frozen=True)
class ItemInfo:
    """Metadata.storage_data's value for one item."""

    record: str  # its tensor record in manifest.json
    block_crcs: tuple[int, ...] = ()  # one per CRC block when larger than one block


def _torch_name(value: object) -> str:
    return str(value).removeprefix("torch.")


def _canonical(body: Any) -> bytes:
    return json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()


def dumps(metadata: Metadata) -> bytes:
    """The JSON file of `metadata`, whose storage_data maps MetadataIndex -> ItemInfo."""
    tensors, byte_items = [], []
    for fqn, md in metadata.state_dict_metadata.items():
        if isinstance(md, BytesStorageMetadata):
            byte_items.append(fqn)
            continue
        p = md.properties
        tensors.append({
            "fqn": fqn, "dtype": _torch_name(p.dtype), "layout": _torch_name(p.layout),
            "requires_grad": bool(p.requires_grad),
            "memory_format": _torch_name(p.memory_format), "pin_memory": bool(p.pin_memory),
            "size": list(md.size),
            "chunks": [{"offsets": list(c.offsets), "sizes": list(c.sizes)} for c in md.chunks],
        })
    items = []
    for index, info in (metadata.storage_data or {}).items():
        items.append({"fqn": index.fqn,
                      "offset": None if index.offset is None else list(index.offset),
                      "index": index.index, "record": info.record,
                      "block_crcs": list(info.block_crcs)})
    planner_data = None
    if metadata.planner_data is not None:
        planner_data, holds_tensors = plain_tree(metadata.planner_data)
        if holds_tensors:
            raise UnsupportedValueError("the planner's data holds tensors; FastPersistWriter "
                                            "stores it as JSON")
    sm = metadata.storage_meta
    storage_meta = None if sm is None else {
        "checkpoint_id": None if sm.checkpoint_id is None else str(sm.checkpoint_id),
        "save_id": sm.save_id, "load_id": sm.load_id, "modules": list(sm.modules)}
    body = {"dcp_version": metadata.version, "crc_block": CRC_BLOCK, "tensors": tensors,
            "bytes": byte_items, "items": items, "planner_data": planner_data,
            "storage_meta": storage_meta}
    doc = {"format": FORMAT, "version": VERSION, "crc32c": crc32c.crc32c(_canonical(body)),
           "body": body}
    return json.dumps(doc, separators=(",", ":"), allow_nan=False).encode() + b"\n"


class _Bad(Exception):
    pass


def _need(cond: bool, what: str) -> None:
    if not cond:
        raise _Bad(what)


def _ints(value: Any, fqn: str, what: str) -> list[int]:
    if not (type(value) is list and len(value) <= 64 and all(
            type(v) is int and v >= 0 for v in value)):
        raise _Bad(f"{fqn}: {what} must be a list of integers >= 0")
    return value


def loads(data: bytes, manifest: Manifest, where: str) -> Metadata:
    """Metadata from the file's bytes, checked against `manifest` (each item
    names a record of its dtype and shape, each tensor chunk has an item).
    Raises CorruptCheckpointError or ManifestError naming `where`."""
    doc = parse_json(data, f"{where}: {DCP_METADATA_NAME}")
    if not isinstance(doc, dict) or doc.get("format") != FORMAT or "body" not in doc:
        raise ManifestError(f"{where}: {DCP_METADATA_NAME} is not fastpersist's DCP metadata")
    if doc.get("version") != VERSION:
        raise ManifestError(f"{where}: {DCP_METADATA_NAME} has version "
                            f"{str(doc.get('version'))[:20]}; this fastpersist reads {VERSION}")
    body = doc["body"]
    try:
        actual = crc32c.crc32c(_canonical(body))
    except (TypeError, ValueError):
        actual = -1
    if actual != doc.get("crc32c"):
        raise CorruptCheckpointError(f"{where}: {DCP_METADATA_NAME} is corrupt (its "
                                     "CRC32C does not match)")
    try:
        return _metadata(body, manifest, where)
    except _Bad as exc:
        raise ManifestError(f"{where}: malformed {DCP_METADATA_NAME}: {exc}") from None
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise ManifestError(f"{where}: malformed {DCP_METADATA_NAME}: {exc!r}") from None


def _metadata(body: Any, manifest: Manifest, where: str) -> Metadata:
    # Messages are made only when raised: a checkpoint has many thousands of items.
    _need(isinstance(body, dict), "body is not an object")
    _need(body.get("crc_block") == CRC_BLOCK, "unknown crc_block")
    records = {r.name: r for r in manifest.tensors}
    sd_md: dict[str, TensorStorageMetadata | BytesStorageMetadata] = {}
    chunk_dtype: dict[tuple[str, tuple[int, ...]], tuple[str, tuple[int, ...]]] = {}
    for t in body["tensors"]:
        fqn = t["fqn"]
        if not isinstance(fqn, str) or fqn in sd_md:
            raise _Bad(f"bad or duplicate fqn {fqn!r}")
        props, name = _properties(t, fqn)
        size = _ints(t["size"], fqn, "size")
        chunks = []
        for c in t["chunks"]:
            offsets, sizes = _ints(c["offsets"], fqn, "offsets"), _ints(c["sizes"], fqn, "sizes")
            if not (len(offsets) == len(sizes) == len(size) and all(
                    o + n <= d for o, n, d in zip(offsets, sizes, size, strict=True))):
                raise _Bad(f"{fqn}: chunk {offsets} {sizes} is outside {size}")
            chunks.append(ChunkStorageMetadata(offsets=torch.Size(offsets),
                                               sizes=torch.Size(sizes)))
            chunk_dtype[(fqn, tuple(offsets))] = (name, tuple(sizes))
        sd_md[fqn] = TensorStorageMetadata(properties=props, size=torch.Size(size),
                                           chunks=chunks)
    for fqn in body["bytes"]:
        if not isinstance(fqn, str) or fqn in sd_md:
            raise _Bad(f"bad or duplicate fqn {fqn!r}")
        sd_md[fqn] = BytesStorageMetadata()
    storage_data: dict[MetadataIndex, ItemInfo] = {}
    for it in body["items"]:
        fqn, offset, hint = it["fqn"], it["offset"], it["index"]
        if not isinstance(fqn, str) or fqn not in sd_md:
            raise _Bad(f"item of unknown fqn {fqn!r}")
        if hint is not None and type(hint) is not int:
            raise _Bad(f"{fqn}: bad index hint")
        record = records.get(it["record"])
        if record is None:
            raise _Bad(f"{fqn}: record {str(it['record'])[:80]!r} is not in the manifest")
        if offset is None:
            if not isinstance(sd_md[fqn], BytesStorageMetadata):
                raise _Bad(f"{fqn}: a tensor item without offsets")
            if record.dtype != "U8" or len(record.shape) != 1:
                raise _Bad(f"{fqn}: bytes item's record is not a byte tensor")
        else:
            key = (fqn, tuple(_ints(offset, fqn, "offset")))
            if chunk_dtype.pop(key, None) != (record.dtype, record.shape):
                raise _Bad(f"{fqn}: item at {offset} is not one of its chunks, or does not "
                           "match its record's dtype and shape")
        crcs = it["block_crcs"]
        blocks = math.ceil(record.length / CRC_BLOCK) if record.length > CRC_BLOCK else 0
        if not (type(crcs) is list and len(crcs) == blocks and all(
                type(c) is int and 0 <= c < 1 << 32 for c in crcs)):
            raise _Bad(f"{fqn}: block CRCs do not match the item's {blocks} blocks")
        index = MetadataIndex(fqn, offset, hint)
        if index in storage_data:
            raise _Bad(f"{fqn}: item at {offset} twice")
        storage_data[index] = ItemInfo(record.name, tuple(crcs))
    _need(not chunk_dtype, f"chunks without items, e.g. {next(iter(chunk_dtype), None)}")
    _need(all(MetadataIndex(f) in storage_data for f, md in sd_md.items()
              if isinstance(md, BytesStorageMetadata)), "a bytes value without its item")
    return Metadata(state_dict_metadata=sd_md, planner_data=_planner_data(body, where),
                    storage_data=storage_data, storage_meta=_storage_meta(body),
                    version=body["dcp_version"])


def _properties(t: dict[str, Any], fqn: str) -> tuple[TensorProperties, str]:
    dtype = getattr(torch, t["dtype"], None) if isinstance(t["dtype"], str) else None
    name = dtype_name(dtype) if isinstance(dtype, torch.dtype) else None
    if name is None:
        raise _Bad(f"{fqn}: dtype {str(t['dtype'])[:40]} cannot be stored")
    if t["layout"] not in _LAYOUTS or t["memory_format"] not in _MEMORY_FORMATS:
        raise _Bad(f"{fqn}: unknown layout or memory format")
    props = TensorProperties(dtype=dtype, layout=_LAYOUTS[t["layout"]],  # type: ignore[arg-type]
                             requires_grad=bool(t["requires_grad"]),
                             memory_format=_MEMORY_FORMATS[t["memory_format"]],
                             pin_memory=bool(t["pin_memory"]))
    return props, name


def _planner_data(body: dict[str, Any], where: str) -> Any:
    tree = body["planner_data"]
    if tree is None:
        return None
    return plain_value(tree, f"{where}: {DCP_METADATA_NAME} planner_data")


def _storage_meta(body: dict[str, Any]) -> StorageMeta | None:
    sm = body["storage_meta"]
    if sm is None:
        return None
    _need(isinstance(sm, dict), "storage_meta is not an object")
    for key in ("checkpoint_id", "save_id", "load_id"):
        _need(sm.get(key) is None or isinstance(sm[key], str), f"storage_meta.{key}")
    _need(isinstance(sm.get("modules"), list) and all(isinstance(m, str) for m in sm["modules"]),
          "storage_meta.modules")
    return StorageMeta(checkpoint_id=sm["checkpoint_id"], save_id=sm["save_id"],
                       load_id=sm["load_id"], modules=list(sm["modules"]))
