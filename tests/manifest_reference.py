"""An independent loader for tests/test_manifest_fuzz.py: what a (mutated)
manifest describes, built only from bytes that were written.

It trusts nothing: it serves a record only if it is identical to one that was
written (taking its bytes straight from the data file), places chunks with a
coverage count, gathers each view's elements one by one, and raises Invalid
for anything else. It shares nothing with fastpersist's reader but the dtype
table and state.decode, for the plain values of the tree.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from hostile_support import MANIFEST

from fastpersist import CheckpointError
from fastpersist.format import dtypes
from fastpersist.tensors import state


class Invalid(Exception):
    """The reference refuses the manifest: load must refuse it too."""


class TooBig(Exception):
    """A valid manifest whose result is too large to compare (a broadcast view
    of 2**40 elements, say): load only has to return or raise a CheckpointError."""


@dataclass
class Base:
    path: Path
    doc: dict[str, Any]
    original: Any
    data: dict[tuple[Any, ...], bytes]  # every written record's identity -> its bytes


def _identity(r: Any, verify: bool) -> tuple[Any, ...]:
    """What must be equal to an original record for load to serve its bytes."""
    if not isinstance(r, dict):
        raise Invalid
    keys = ("name", "file", "offset", "length", "dtype", "shape", "encoding")
    if verify:
        keys += ("crc32c",)
    return tuple(json.dumps(r.get(k)) for k in keys)


def _file_identity(f: Any, verify: bool) -> tuple[Any, ...]:
    if not isinstance(f, dict):
        raise Invalid
    keys = ("name", "size", "data_start")
    if verify:
        keys += ("header_crc32c",)
    return tuple(json.dumps(f.get(k)) for k in keys)


def base_of(path: Path, original: Any) -> Base:
    doc = json.loads((path / MANIFEST).read_bytes())
    data = {}
    for verify in (True, False):
        for r in doc["tensors"]:
            with open(path / r["file"], "rb") as fh:
                fh.seek(r["offset"])
                data[_identity(r, verify)] = fh.read(r["length"])
    return Base(path, doc, original, data)


def reference(doc: Any, base: Base, verify: bool) -> Any:
    """The object `doc` describes, from the bytes that were written; Invalid if
    it is not a manifest whose every used record is one that was written."""
    if not isinstance(doc, dict) or doc.get("format") != "fastpersist-checkpoint":
        raise Invalid
    version, files, records = doc.get("schema_version"), doc.get("files"), doc.get("tensors")
    if type(version) is not int or version not in (1, 2, 3) or not isinstance(files, list) or (
            not isinstance(records, list)) or "tree" not in doc:
        raise Invalid
    originals = {_file_identity(f, verify) for f in base.doc["files"]}

    def record(i: Any) -> torch.Tensor:
        if type(i) is not int or not 0 <= i < len(records):
            raise Invalid
        r = records[i]
        raw = base.data.get(_identity(r, verify))
        if raw is None:
            raise Invalid  # not a record that was written (or not with these bytes)
        used = [f for f in files if isinstance(f, dict) and f.get("name") == r["file"]]
        if not used or any(_file_identity(f, verify) not in originals for f in used):
            raise Invalid
        dtype = dtypes.from_name(r["dtype"])
        flat = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else torch.empty(
            0, dtype=torch.uint8)
        return flat.view(dtype).reshape(r["shape"])

    if "globals" in doc:
        if version == 1:
            raise Invalid
        entries = _globals(doc["globals"], record, records, version)
    else:
        entries = [record(i) for i in range(len(records))]  # every record is read
    if _depth(doc["tree"]) > 100:
        raise Invalid
    try:
        return state.decode(doc["tree"], _factory(entries), where="reference")
    except CheckpointError:
        raise Invalid from None


def _chunk_data(i: int, record: Callable[[Any], torch.Tensor], records: list[Any]
                ) -> torch.Tensor:
    """An empty chunk is not read (load reads only the chunks that hold elements
    of what it returns), so only its dtype and shape matter."""
    r = records[i] if 0 <= i < len(records) else None
    if isinstance(r, dict) and _ints(r.get("shape")) and math.prod(r["shape"]) == 0 and (
            isinstance(r.get("dtype"), str) and r["dtype"] in dtypes.SUPPORTED_NAMES):
        return torch.empty(r["shape"], dtype=dtypes.from_name(r["dtype"]))
    return record(i)


def _implied(name: str, records: list[Any]) -> list[dict[str, Any]]:
    """Schema 3: the chunks of a global that leaves out "chunks", from the
    records named `<name>@<offsets>` (offsets: decimal digits without sign or
    leading zero, joined by ","; nothing for a 0-dim global), in their order."""
    out = []
    for i, r in enumerate(records):
        full = r.get("name") if isinstance(r, dict) else None
        if not isinstance(full, str) or "@" not in full:
            continue
        head, _, text = full.rpartition("@")
        parts = text.split(",") if text else []
        if head != name or not all(
                p and len(p) < 100 and all(ch in "0123456789" for ch in p)
                and (p == "0" or not p.startswith("0")) for p in parts):
            continue
        out.append({"tensor": i, "offsets": [int(p) for p in parts]})
    return out


def _globals(raw: Any, record: Callable[[Any], torch.Tensor], records: list[Any],
             version: int) -> list[torch.Tensor]:
    if not isinstance(raw, list):
        raise Invalid
    out, used = [], set()
    for g in raw:
        if isinstance(g, dict) and "chunks" not in g and version >= 3 and isinstance(
                g.get("name"), str):
            g = {**g, "chunks": _implied(g["name"], records)}
        if not isinstance(g, dict) or not isinstance(g.get("chunks"), list):
            raise Invalid
        shape = g.get("shape")
        if not isinstance(g.get("dtype"), str) or g["dtype"] not in dtypes.SUPPORTED_NAMES or (
                not _ints(shape)):
            raise Invalid
        if math.prod(shape) > 10**6:
            raise Invalid  # more than the written records hold
        dtype = dtypes.from_name(g["dtype"])
        whole, cover = torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=torch.int64)
        for c in g["chunks"]:
            if not isinstance(c, dict) or type(c.get("tensor")) is not int or (
                    c["tensor"] in used):
                raise Invalid
            used.add(c["tensor"])
            data, offsets = _chunk_data(c["tensor"], record, records), c.get("offsets")
            if data.dtype != dtype or not _ints(offsets) or not (
                    len(offsets) == data.dim() == len(shape)) or any(
                    o + n > d for o, n, d in zip(offsets, data.shape, shape, strict=True)):
                raise Invalid
            box = tuple(slice(o, o + n) for o, n in zip(offsets, data.shape, strict=True))
            whole[box] = data
            cover[box] += 1
        if not bool((cover == 1).all()):
            raise Invalid  # an element no chunk or two chunks hold
        out.append(whole)
    return out


def _factory(entries: list[torch.Tensor]) -> Callable[[dict[str, Any]], torch.Tensor]:
    """fastpersist's documented tensor-node semantics: nodes with the same entry,
    view, device and flags are one object; views read their entry's bytes."""
    made: dict[Any, torch.Tensor] = {}
    whole: dict[Any, torch.Tensor] = {}

    def factory(node: dict[str, Any]) -> torch.Tensor:
        e, view = node.get("e"), node.get("view")
        param, grad = node.get("param", False), node.get("grad", False)
        if type(e) is not int or not 0 <= e < len(entries) or type(param) is not bool or (
                type(grad) is not bool):
            raise Invalid
        try:
            device = torch.device(node.get("device", "cpu"))
        except (RuntimeError, TypeError):
            raise Invalid from None
        if device.type != "cpu":
            raise Invalid  # this machine has only the CPU
        saved = node.get("device", "cpu")  # one object per entry and device string
        key = (e, saved, json.dumps(view, sort_keys=True), param, grad)
        if key not in made:
            t = whole.setdefault((e, saved), entries[e].clone()) if view is None else _view(
                entries[e], view)
            try:
                if param:
                    t = torch.nn.Parameter(t, requires_grad=grad)
                elif grad:
                    t = t.requires_grad_(True)
            except RuntimeError:  # integers cannot require gradients
                raise Invalid from None
            made[key] = t
        return made[key]

    return factory


def _view(entry: torch.Tensor, view: Any) -> torch.Tensor:
    """Each element's bytes gathered one by one from the entry's bytes."""
    if not isinstance(view, dict) or not isinstance(view.get("dtype"), str) or (
            view["dtype"] not in dtypes.SUPPORTED_NAMES):
        raise Invalid
    shape, stride, offset = view.get("shape"), view.get("stride"), view.get("offset")
    if not _ints(shape) or not _ints(stride) or len(shape) != len(stride) or not _ints([offset]):
        raise Invalid
    dtype = dtypes.from_name(view["dtype"])
    size = dtype.itemsize
    raw = entry.contiguous().reshape(-1).view(torch.uint8)
    if 0 in shape:
        if offset % size or offset > raw.numel():
            raise Invalid
        return torch.empty(shape, dtype=dtype)
    last = offset + (sum((n - 1) * s for n, s in zip(shape, stride, strict=True)) + 1) * size
    if offset % size or last > raw.numel():
        raise Invalid
    if math.prod(shape) > 10**5:
        raise TooBig
    index = torch.tensor(offset)
    for n, s in zip(shape, stride, strict=True):
        index = index.unsqueeze(-1) + torch.arange(n) * (s * size)
    index = index.unsqueeze(-1) + torch.arange(size)
    return raw[index].contiguous().view(dtype).reshape(shape)


def _ints(v: Any) -> bool:
    return isinstance(v, list) and len(v) <= 64 and all(
        type(d) is int and 0 <= d < 2**60 for d in v)


def _depth(tree: Any) -> int:
    deepest, stack = 0, [(tree, 1)]
    while stack:
        node, depth = stack.pop()
        deepest = max(deepest, depth)
        if isinstance(node, dict) and node.get("t") in ("dict", "odict", "list", "tuple"):
            for field in ("k", "v"):
                if isinstance(node.get(field), list):
                    stack += [(c, depth + 1) for c in node[field]]
            if "meta" in node:
                stack.append((node["meta"], depth + 1))
    return deepest
