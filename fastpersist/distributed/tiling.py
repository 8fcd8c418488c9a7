"""The boxes the ranks of a job describe must tile each tensor: every box
inside its tensor, and every element in exactly one distinct box. Checked
by the planner (planner.py) before it plans; torch-free and pure."""

from __future__ import annotations

import itertools
import math
import operator
from collections import Counter
from collections.abc import Sequence
from typing import Any

from ..format import dtypes

# A box: planner.Item (key, dtype, global_shape, offsets, shape), typed loosely
# here so that this module does not import the planner that imports it.
Box = Any

_PLACE = operator.itemgetter(slice(2, None))  # an Item's (global_shape, offsets, shape)
_BOX = operator.itemgetter(slice(3, None))  # its (offsets, shape)
_DTYPE_SHAPE = operator.itemgetter(1, 4)


def tiling_problem(by_key: list[list[Box]]) -> str | None:
    """What is wrong with the distinct boxes of each key, which must lie
    inside it and cover it exactly once; None if nothing. Jobs repeat few
    shapes (a layer's params and their optimizer states, layer after layer),
    so each check is made once per (shapes, boxes) it sees."""
    inside: set[tuple[tuple[int, ...], ...]] = set()
    checked: dict[tuple[object, ...], tuple[int, bool]] = {}
    for items in by_key:
        for place in set(map(_PLACE, items)) - inside:
            global_shape, offsets, shape = place
            if len(offsets) != len(global_shape) or len(shape) != len(global_shape) or any(
                    o < 0 or o + n > g for o, n, g in zip(offsets, shape, global_shape,
                                                          strict=True)):
                return (f"{items[0].key}: box at {list(offsets)} of shape {list(shape)} "
                        f"lies outside the tensor's shape {list(global_shape)}")
            inside.add(place)
        # An optimizer's states are sharded as their parameter is: one check
        # serves every key with the same boxes.
        grid = (items[0].global_shape, *sorted(map(_BOX, items)))
        found = checked.get(grid)
        if found is None:
            volume = sum(math.prod(i.shape) for i in items)
            whole = math.prod(items[0].global_shape)
            found = checked[grid] = (volume, volume == whole and len(items) > 1
                                     and _overlapping(items))
        volume, overlap = found
        whole = math.prod(items[0].global_shape)
        if volume != whole or overlap:
            return (f"{items[0].key}: the ranks' shards hold {volume} elements of a tensor "
                    f"of {whole}, and must cover it once (shards overlap or leave gaps)")
    return None


def unique_bytes(by_key: Sequence[Sequence[Box]],
                 sizes: dict[tuple[str, tuple[int, ...]], int] | None = None) -> int:
    """The bytes of the boxes, worked out once per dtype and shape (in
    `sizes`, which the caller may keep for its next call)."""
    sizes = {} if sizes is None else sizes
    total = 0
    for items in by_key:
        for (dtype, shape), n in Counter(map(_DTYPE_SHAPE, items)).items():
            size = sizes.get((dtype, shape))
            if size is None:
                size = sizes[dtype, shape] = math.prod(shape) * dtypes.itemsize(dtype)
            total += n * size
    return total


_MAX_GRID_CELLS = 1 << 20


def _overlapping(items: list[Box]) -> bool:
    """Whether two boxes overlap: mark the cells of the grid their edges make.
    Shard layouts make small grids (one cell per shard); a grid too large to
    mark is left to the volume check alone. Boxes cut along one dimension
    only (the usual FSDP or TP shard) need no grid: sorted, none may start
    before the one before it ends. Empty boxes overlap nothing, wherever
    their offsets put them."""
    items = [i for i in items if 0 not in i.shape]
    if len(items) < 2:
        return False
    dims = range(len(items[0].global_shape))
    first = items[0]
    varying = [d for d in dims if any(i.offsets[d] != first.offsets[d] or i.shape[d]
                                      != first.shape[d] for i in items)]
    if len(varying) == 1:
        d = varying[0]
        end = -1
        for start, length in sorted((i.offsets[d], i.shape[d]) for i in items):
            if start < end:
                return True
            end = start + length
        return False
    cuts = [sorted({c for i in items for c in (i.offsets[d], i.offsets[d] + i.shape[d])})
            for d in range(len(items[0].global_shape))]
    if math.prod(max(len(c) - 1, 1) for c in cuts) > _MAX_GRID_CELLS:
        return False
    index = [{c: n for n, c in enumerate(cs)} for cs in cuts]
    seen: set[tuple[int, ...]] = set()
    for i in items:
        ranges = [range(index[d][i.offsets[d]], index[d][i.offsets[d] + i.shape[d]])
                  for d in range(len(cuts))]
        for cell in itertools.product(*ranges):
            if cell in seen:
                return True
            seen.add(cell)
    return False


__all__ = ["tiling_problem", "unique_bytes"]
