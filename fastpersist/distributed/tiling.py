"""The boxes the ranks of a job describe must tile each tensor: every box
inside its tensor, and every element in exactly one distinct box. Checked
by the planner (planner.py) before it plans; torch-free and pure."""

from __future__ import annotations

import itertools
import math
from collections import Counter
from collections.abc import Sequence
from typing import Any

from ..format import dtypes
from .boxes import GLOBAL_SHAPE, KEY, kind_of, place_of

# A box: planner.Item or a plain tuple of its fields (what ranks send:
# plan.Box), read by position (boxes.py); typed loosely here so that this
# module does not import the planner that imports it.
Box = Any


def tiling_problem(by_key: list[list[Box]]) -> str | None:
    """What is wrong with the distinct boxes of each key, which must lie
    inside it and cover it exactly once; None if nothing. Jobs repeat few
    shapes (a layer's params and their optimizer states, layer after layer),
    so each check is made once per grid it sees."""
    checked: dict[tuple[object, ...], str | None] = {}
    for items in by_key:
        # An optimizer's states are sharded as their parameter is, layer after
        # layer: a grid (the tensor's shape and its boxes, in the layouts'
        # order, which is the same from key to key) seen once is not checked
        # again.
        global_shape = items[0][GLOBAL_SHAPE]
        grid = (global_shape, *map(place_of, items))
        if grid not in checked:
            checked[grid] = grid_problem(global_shape, list(map(place_of, items)))
        problem = checked[grid]
        if problem is not None:
            return f"{items[0][KEY]}: {problem}"
    return None


def grid_problem(global_shape: tuple[int, ...],
                 boxes: list[tuple[tuple[int, ...], tuple[int, ...]]]) -> str | None:
    """What is wrong with a tensor's distinct boxes (offsets, shape), which
    must lie inside it and cover it exactly once; None if nothing. The
    message names no key: the caller's grid may stand for many."""
    for offsets, shape in set(boxes):
        if len(offsets) != len(global_shape) or len(shape) != len(global_shape) or any(
                o < 0 or o + n > g for o, n, g in zip(offsets, shape, global_shape, strict=True)):
            return (f"box at {list(offsets)} of shape {list(shape)} lies outside the "
                    f"tensor's shape {list(global_shape)}")
    volume = sum(math.prod(shape) for _, shape in boxes)
    whole = math.prod(global_shape)
    if volume != whole or (len(boxes) > 1 and _overlapping(boxes)):
        return (f"the ranks' shards hold {volume} elements of a tensor of {whole}, and must "
                "cover it once (shards overlap or leave gaps)")
    return None


def unique_bytes(by_key: Sequence[Sequence[Box]],
                 sizes: dict[tuple[str, tuple[int, ...]], int] | None = None) -> int:
    """The bytes of the boxes, worked out once per dtype and shape (in
    `sizes`, which the caller may keep for its next call)."""
    sizes = {} if sizes is None else sizes
    total = 0
    for items in by_key:
        for (dtype, shape), n in Counter(map(kind_of, items)).items():
            size = sizes.get((dtype, shape))
            if size is None:
                size = sizes[dtype, shape] = math.prod(shape) * dtypes.itemsize(dtype)
            total += n * size
    return total


_MAX_GRID_CELLS = 1 << 20


def _overlapping(boxes: list[tuple[tuple[int, ...], tuple[int, ...]]]) -> bool:
    """Whether two boxes (offsets, shape) overlap: mark the cells of the grid
    their edges make. Shard layouts make small grids (one cell per shard); a
    grid too large to mark is left to the volume check alone. Boxes cut along
    one dimension only (the usual FSDP or TP shard) need no grid: sorted, none
    may start before the one before it ends. Empty boxes overlap nothing,
    wherever their offsets put them."""
    boxes = [b for b in boxes if 0 not in b[1]]
    if len(boxes) < 2:
        return False
    dims = range(len(boxes[0][0]))
    first_offsets, first_shape = boxes[0]
    varying = [d for d in dims if any(o[d] != first_offsets[d] or s[d] != first_shape[d]
                                      for o, s in boxes)]
    if len(varying) == 1:
        d = varying[0]
        end = -1
        for start, length in sorted((o[d], s[d]) for o, s in boxes):
            if start < end:
                return True
            end = start + length
        return False
    cuts = [sorted({c for o, s in boxes for c in (o[d], o[d] + s[d])}) for d in dims]
    if math.prod(max(len(c) - 1, 1) for c in cuts) > _MAX_GRID_CELLS:
        return False
    index = [{c: n for n, c in enumerate(cs)} for cs in cuts]
    seen: set[tuple[int, ...]] = set()
    for o, s in boxes:
        ranges = [range(index[d][o[d]], index[d][o[d] + s[d]]) for d in dims]
        for cell in itertools.product(*ranges):
            if cell in seen:
                return True
            seen.add(cell)
    return False


__all__ = ["grid_problem", "tiling_problem", "unique_bytes"]
