"""Loading a distributed checkpoint, in any job size or layout.

A distributed checkpoint stores each global tensor as chunks (boxes) that
several ranks wrote. Loading rebuilds what the caller asks for:

- by default, every tensor whole (a single process, or any number of
  data-parallel ranks, each with the full state);
- with `like=`, a state of the new job's layout: where it holds a DTensor,
  that rank gets a DTensor with the same mesh and placements, built from the
  chunks that overlap its shard only (other chunks are not read).

Raw chunks are read whole, so that each one's CRC32C is checked. A
compressed chunk (compression="zstd") is decoded only in the frames that
hold the elements wanted, each checked by its stored CRC32C.

The chunks are read from a Source (tensors/source.py): a directory through
the engine, the object store by ranged GETs of only the chunks, or frames,
wanted.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch

from ..errors import ManifestError
from ..format import dtypes
from ..format.manifest import GlobalTensor, Manifest
from ..tensors import state
from ..tensors.factory import Factory, SomeEntries, TensorFactory
from ..tensors.into import entries_in
from ..tensors.source import Source

Box = tuple[tuple[int, ...], tuple[int, ...]]  # offsets, shape


@dataclass(frozen=True)
class _Target:
    """A DTensor of the caller's layout to rebuild."""

    box: Box
    mesh: Any
    placements: tuple[Any, ...]


def targets_of(like: Any) -> dict[str, _Target]:
    """The DTensors in `like` by state path, each with this rank's box."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    _, leaves = state.encode(like, allow_pickle=True, sharded=True)
    out = {}
    for leaf in leaves:
        if leaf.node.get("sharded"):
            t = leaf.tensor
            shape, offsets = compute_local_shape_and_global_offset(
                t.shape, t.device_mesh, t.placements)  # type: ignore[attr-defined]
            out[leaf.path] = _Target((tuple(offsets), tuple(shape)), t.device_mesh,  # type: ignore[attr-defined]
                                     tuple(t.placements))  # type: ignore[attr-defined]
    return out


def _overlap(a: Box, b: Box) -> Box | None:
    """The intersection of two boxes, or None."""
    lo = tuple(max(x, y) for x, y in zip(a[0], b[0], strict=True))
    hi = tuple(min(x + n, y + m) for x, n, y, m in zip(a[0], a[1], b[0], b[1], strict=True))
    if any(h <= low for low, h in zip(lo, hi, strict=True)):
        return None  # disjoint, or one of them holds no elements
    return lo, tuple(h - low for low, h in zip(lo, hi, strict=True))


def _slices(inner: Box, outer_offsets: tuple[int, ...]) -> tuple[slice, ...]:
    return tuple(slice(o - base, o - base + n)
                 for o, n, base in zip(inner[0], inner[1], outer_offsets, strict=True))


def read_boxes(source: Source, manifest: Manifest, wanted: dict[int, Box], *, verify: bool,
               progress: Callable[[int], None] | None = None) -> dict[int, torch.Tensor]:
    """For each global index -> box, a CPU tensor of that box, read from
    `source` from the chunks that overlap it."""
    assert manifest.globals is not None
    needed: dict[int, tuple[int, int]] = {}  # record -> the raw bytes of it wanted
    for index, box in wanted.items():
        g = manifest.globals[index]
        for c in g.chunks:
            rec = manifest.tensors[c.tensor]
            part = _overlap(box, (c.offsets, rec.shape))
            if part is not None:
                lo, hi = _byte_span(part, c.offsets, rec.shape, rec.length // max(
                    1, _numel(rec.shape)))
                old = needed.get(c.tensor, (lo, hi))
                needed[c.tensor] = (min(old[0], lo), max(old[1], hi))
    records = sorted(needed)
    files = {manifest.tensors[i].file for i in records}
    sub = replace(manifest, files=tuple(f for f in manifest.files if f.name in files),
                  tensors=tuple(manifest.tensors[i] for i in records))
    spans = {k: needed[i] for k, i in enumerate(records)
             if needed[i] != (0, manifest.tensors[i].length)}
    chunk_data = dict(zip(records, source.read_tensors(sub, verify=verify, progress=progress,
                                                       spans=spans), strict=True))
    out = {}
    for index, box in wanted.items():
        g = manifest.globals[index]
        t = torch.empty(box[1], dtype=dtypes.from_name(g.dtype))
        for c in g.chunks:
            data = chunk_data.get(c.tensor)
            if data is None:
                continue
            part = _overlap(box, (c.offsets, tuple(data.shape)))
            if part is not None:
                t[_slices(part, box[0])] = data[_slices(part, c.offsets)]
        out[index] = t
    return out


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _byte_span(part: Box, chunk_offsets: tuple[int, ...], shape: tuple[int, ...],
               itemsize: int) -> tuple[int, int]:
    """The bytes of a chunk (row-major, `shape`) from its first element in
    box `part` to its last: every element of the box lies in between."""
    first = last = 0
    for o, n, base, d in zip(part[0], part[1], chunk_offsets, shape, strict=True):
        first = first * d + (o - base)
        last = last * d + (o - base + n - 1)
    return first * itemsize, (last + 1) * itemsize


def load(source: Source, manifest: Manifest, map_location: Any, like: Any, *,
         allow_pickle: bool, verify: bool, progress: Callable[[int], None] | None,
         place: Callable[[Factory], Factory] | None = None) -> Any:
    """The state of the distributed checkpoint in `source` (see the module's
    docstring); place(factory), if given, wraps the factory of every tensor
    node (load's into=)."""
    path = source.where

    assert manifest.globals is not None
    globals_ = manifest.globals
    index_of = {g.name: i for i, g in enumerate(globals_)}
    targets = targets_of(like) if like is not None else {}
    for name in targets:
        if name not in index_of:
            raise ManifestError(f"{path}: `like` holds a DTensor at {name!r}, which the "
                                "checkpoint does not have")
    # Only the globals the tree refers to (load's into=/like= may have cut it).
    wanted: dict[int, Box] = {i: ((0,) * len(globals_[i].shape), globals_[i].shape)
                              for i in entries_in(manifest.tree)}
    for name, target in targets.items():
        i = index_of[name]
        _check_same(globals_[i], target, path)
        if i in wanted:
            wanted[i] = target.box
    tensors = read_boxes(source, manifest, wanted, verify=verify, progress=progress)
    entries = SomeEntries(len(globals_), tensors, str(path))
    plain = TensorFactory(entries, map_location, str(path))
    made: dict[int, torch.Tensor] = {}

    def factory(node: dict[str, Any]) -> torch.Tensor:
        index = node.get("e")
        if not isinstance(index, int) or not 0 <= index < len(entries):
            raise ManifestError(f"{path}: tensor node refers to entry {index!r}")
        target = targets.get(globals_[index].name)
        if target is None:
            return plain(node)
        if index not in made:
            from torch.distributed.tensor import DTensor

            g = globals_[index]
            local = entries[index].to(target.mesh.device_type)
            made[index] = DTensor.from_local(local, target.mesh, target.placements,
                                             run_check=False, shape=torch.Size(g.shape),
                                             stride=_contiguous_stride(g.shape))
        return made[index]

    return state.decode(manifest.tree, place(factory) if place else factory,
                        allow_pickle=allow_pickle, where=str(path))


def _check_same(g: GlobalTensor, target: _Target, path: str) -> None:
    offsets, shape = target.box
    if len(offsets) != len(g.shape) or any(
            o + n > d for o, n, d in zip(offsets, shape, g.shape, strict=True)):
        raise ManifestError(f"{path}: {g.name!r} is {list(g.shape)} in the checkpoint; `like` "
                            f"wants a shard at {list(offsets)} of shape {list(shape)}")


def _contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    stride, acc = [], 1
    for n in reversed(shape):
        stride.append(acc)
        acc *= max(n, 1)
    return tuple(reversed(stride))
