"""Building valid checkpoints to damage (imported as `hostile_support`).

A single-process checkpoint comes from fastpersist.save. A distributed (schema-2)
one is made without torch.distributed: its chunks are saved as the tensors of a
single-process checkpoint, and the manifest is then rewritten as rank 0 of a
job writes it (schema 2, `globals` made of those chunks, the tree referring to
globals), which is what fastpersist.load reads.
"""

from __future__ import annotations

import itertools
import json
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

import fastpersist
from fastpersist.format import dtypes
from fastpersist.tensors import state

MANIFEST = "manifest.json"
Box = tuple[tuple[int, ...], tuple[int, ...]]  # offsets, shape


def read_doc(ckpt: Path) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads((ckpt / MANIFEST).read_bytes())
    return doc


def write_doc(ckpt: Path, doc: Any) -> None:
    (ckpt / MANIFEST).write_text(json.dumps(doc))


def edit(ckpt: Path, fn: Callable[[dict[str, Any]], None]) -> None:
    doc = read_doc(ckpt)
    fn(doc)
    write_doc(ckpt, doc)


def record_index(doc: dict[str, Any], name: str) -> int:
    (index,) = [i for i, t in enumerate(doc["tensors"]) if t["name"] == name]
    return index


def distinct(*shape: int, dtype: torch.dtype = torch.float32, start: int = 1) -> torch.Tensor:
    """A tensor whose elements all differ from each other and from other calls'
    (with different `start`), so that misplaced bytes show."""
    n = 1
    for d in shape:
        n *= d
    return (torch.arange(n, dtype=torch.float64) + start).to(dtype).reshape(shape)


def single_state() -> dict[str, Any]:
    """Every kind of value a checkpoint holds: tied weights, views of one storage,
    a Parameter, 0-d and 0-element tensors, several dtypes, plain values."""
    w = distinct(3, 4, start=1)
    base = distinct(10, start=100)
    model: OrderedDict[str, Any] = OrderedDict(
        w=w, tied=w, b=distinct(4, dtype=torch.int64, start=200),
        half=distinct(5, dtype=torch.bfloat16, start=300))
    model._metadata = OrderedDict({"": {"version": 1}})  # type: ignore[attr-defined]
    return {
        "model": model,
        "views": [base, base[2:6], base[1::3]],
        "param": torch.nn.Parameter(distinct(2, start=400)),
        "scalar": torch.tensor(3.5),
        "empty": torch.zeros(0, 3),
        "flags": torch.tensor([True, False, True]),
        "step": 7, "lr": 0.25, "name": "run", "none": None, "pair": (1, "x"),
        "raw": b"\x00\x01", "dtype": torch.bfloat16, "device": torch.device("cpu"),
        "size": torch.Size([2, 3]), "inf": float("inf"),
    }


def distributed_checkpoint(path: Path, tensors: Mapping[str, tuple[torch.Tensor, Sequence[Box]]],
                           aliases: Mapping[str, str] | None = None,
                           values: Mapping[str, Any] | None = None,
                           compression: str | None = None) -> dict[str, Any]:
    """Write a schema-2 checkpoint at `path`: each global tensor stored as the
    given boxes of it, `aliases` (key -> global key) tied to a global, and plain
    `values` (its chunks compressed with `compression`). Returns the object
    that loading it must give back."""
    pieces = {}
    for key, (full, boxes) in tensors.items():
        for offsets, shape in boxes:
            index = tuple(slice(o, o + n) for o, n in zip(offsets, shape, strict=True))
            pieces[f"{key}@{','.join(map(str, offsets))}"] = full[index].clone()
    fastpersist.save(pieces, path, compression=compression)
    doc = read_doc(path)
    doc["schema_version"] = 2
    doc["globals"] = [
        {"name": key, "dtype": dtypes.to_name(full.dtype), "shape": list(full.shape),
         "chunks": [{"tensor": record_index(doc, f"{key}@{','.join(map(str, o))}"),
                     "offsets": list(o)} for o, _ in boxes]}
        for key, (full, boxes) in tensors.items()]
    expected: dict[str, Any] = {key: full for key, (full, _) in tensors.items()}
    for alias, key in (aliases or {}).items():
        expected[alias] = expected[key]
    expected.update(values or {})
    tree, leaves = state.encode(expected)
    order = list(tensors)
    for leaf in leaves:
        leaf.node["e"] = order.index((aliases or {}).get(leaf.path, leaf.path))
    doc["tree"] = tree
    write_doc(path, doc)
    return expected


def grid(shape: tuple[int, ...], cuts: Sequence[Sequence[int]]) -> list[Box]:
    """The boxes of `shape` cut at the given positions along each dimension."""
    boxes: list[Box] = [((), ())]
    for d, n in enumerate(shape):
        edges = [0, *cuts[d], n] if d < len(cuts) else [0, n]
        boxes = [((*o, lo), (*s, hi - lo)) for o, s in boxes
                 for lo, hi in itertools.pairwise(edges)]
    return boxes


def distributed_state(path: Path) -> dict[str, Any]:
    """A schema-2 checkpoint with a 2x2 grid, uneven row pieces, a 0-d and a
    0-element global, a tied alias and plain values."""
    return distributed_checkpoint(path, {
        "w": (distinct(6, 4, start=1), grid((6, 4), [[3], [2]])),
        "rows": (distinct(8, dtype=torch.int64, start=100), grid((8,), [[3, 5]])),
        "s": (torch.tensor(2.5, dtype=torch.float64), [((), ())]),
        "e": (torch.zeros(0, 3), [((0, 0), (0, 3))]),
        "h": (distinct(2, 3, dtype=torch.float16, start=500), grid((2, 3), [[1]])),
    }, aliases={"w_tied": "w"}, values={"step": 3, "cfg": {"lr": 0.5, "tags": ["a", "b"]}})


def same(a: Any, b: Any) -> bool:
    """Equal values and types, tensors bit for bit (dtype, shape, device, grad,
    Parameter-ness), floats by their bits, dicts in order with their _metadata."""
    if type(a) is not type(b):
        return False
    if isinstance(a, torch.Tensor):
        return (a.dtype == b.dtype and a.shape == b.shape and a.device == b.device
                and a.requires_grad == b.requires_grad and torch.equal(_bits(a), _bits(b)))
    if isinstance(a, float):
        return a == b or (a != a and b != b)
    if isinstance(a, dict):
        return (list(a) == list(b) and all(same(a[k], b[k]) for k in a)
                and same(getattr(a, "_metadata", None), getattr(b, "_metadata", None)))
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def _bits(t: torch.Tensor) -> torch.Tensor:
    # A fresh copy: .contiguous() keeps the odd stride of a size-1 dimension.
    dense = torch.empty(t.shape, dtype=t.dtype).copy_(t.detach())
    return dense.reshape(-1).view(torch.uint8)


def aliasing(obj: Any) -> list[tuple[int, int]]:
    """For each tensor met in order: which earlier tensor object and which
    earlier storage it is (by first appearance), to compare sharing."""
    objects: dict[int, int] = {}
    storages: dict[int, int] = {}
    out = []
    for t in _tensors(obj):
        ptr = t.untyped_storage().data_ptr() if t.untyped_storage().nbytes() else -len(out) - 1
        out.append((objects.setdefault(id(t), len(objects)),
                    storages.setdefault(ptr, len(storages))))
    return out


def _tensors(obj: Any) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in _tensors(v)]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in _tensors(v)]
    return []
