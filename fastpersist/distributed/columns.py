"""The layouts' boxes a key at a time, for the planner (planner.py): which
are distinct, which several layouts hold, whether they tile their tensor,
and each layout's own bytes.

When every layout holds the same tensors in one order, a key's boxes are a
column of the layouts' items. A job's columns repeat a few grids (the
boxes' offsets and shapes, in the layouts' order): an optimizer's states
are cut as their parameter is, layer after layer, and a norm is replicated
over the same ranks in every layer. Each grid is worked out once, whatever
the key; a column costs the lookup of its grid, so that at 16,384 ranks
(370,000 boxes) rank 0 no longer hashes every box three times (once to
deduplicate it, once for the tiling check and once to count its bytes) nor
goes through shared boxes one by one. Torch-free and pure.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

from ..format import dtypes
from .boxes import DTYPE, GLOBAL_SHAPE, KEY, offsets_of, shape_of
from .tiling import grid_problem

# A box: plan.Box or an Item, read by position (boxes.py); typed loosely
# here, as in tiling.py.
Box = Any


class Grid(NamedTuple):
    """What one grid's columns share: a column's distinct boxes are its
    boxes at `firsts` (None: all of them, the usual sharded key), `shared`
    names the layouts that hold each box several hold (with where it first
    is), `flags` says which layouts' boxes are such, `own` is each
    layout's bytes of the key that only it holds, and `problem` what is
    wrong with the tiling (tiling.grid_problem)."""

    firsts: list[int] | None
    shared: list[tuple[int, tuple[str, ...]]]
    flags: tuple[bool, ...]
    own: tuple[int, ...]
    problem: str | None


class Columns(NamedTuple):
    """unique_columns' result: per key, in the layouts' order of keys, its
    distinct boxes (`by_key`) and the first tiling problem found, with its
    key (`problem`, `problem_key`); the boxes
    several layouts hold with those layouts (`several`); per layout, in
    `layouts`' order, which of its items are such (`flags`) and its own
    bytes (`own`)."""

    by_key: list[list[Box]]
    several: dict[Box, tuple[str, ...]]
    flags: list[tuple[bool, ...]]
    own: list[int]
    problem: str | None
    problem_key: str | None


def unique_columns(layouts: Mapping[str, Sequence[Box]]) -> Columns:
    """The columns of `layouts`, whose items must list the same keys,
    dtypes and global shapes in one order (the planner checks that first)."""
    names = list(layouts)
    grids: dict[tuple[object, ...], Grid] = {}
    seen: list[Grid] = []
    by_key: list[list[Box]] = []
    several: dict[Box, tuple[str, ...]] = {}
    problem = problem_key = None
    for column in zip(*layouts.values(), strict=True):
        first = column[0]
        # A grid's key: lists of references, hashed in C.
        at = (first[DTYPE], first[GLOBAL_SHAPE], tuple(map(offsets_of, column)),
              tuple(map(shape_of, column)))
        grid = grids.get(at)
        if grid is None:
            grid = grids[at] = _grid(names, *at)
        seen.append(grid)
        if grid.firsts is None:
            by_key.append(list(column))
        else:
            by_key.append([column[j] for j in grid.firsts])
            several.update((column[j], held) for j, held in grid.shared)
        if problem is None and grid.problem is not None:
            problem_key, problem = first[KEY], f"{first[KEY]}: {grid.problem}"
    own = [0] * len(names)
    by_id = {id(g): g for g in grids.values()}
    for ident, times in Counter(map(id, seen)).items():
        own = [a + times * b for a, b in zip(own, by_id[ident].own, strict=True)]
    flags: list[tuple[bool, ...]] = (list(zip(*(g.flags for g in seen), strict=True)) if seen
                                     else [()] * len(names))
    return Columns(by_key, several, flags, own, problem, problem_key)


def _grid(names: list[str], dtype: str, global_shape: tuple[int, ...],
          offsets: tuple[tuple[int, ...], ...], shapes: tuple[tuple[int, ...], ...]) -> Grid:
    places = list(zip(offsets, shapes, strict=True))
    distinct = list(dict.fromkeys(places))
    itemsize = dtypes.itemsize(dtype)
    size = {s: math.prod(s) * itemsize for s in set(shapes)}
    problem = grid_problem(global_shape, distinct)
    if len(distinct) == len(places):  # a sharded key: nothing shared
        return Grid(None, [], (False,) * len(names), tuple(map(size.__getitem__, shapes)),
                    problem)
    index = {p: n for n, p in enumerate(distinct)}
    pattern = list(map(index.__getitem__, places))
    held: list[list[int]] = [[] for _ in distinct]
    for j, n in enumerate(pattern):
        held[n].append(j)
    flags = tuple(len(held[n]) > 1 for n in pattern)
    return Grid([h[0] for h in held], [(h[0], tuple(names[j] for j in h))
                                       for h in held if len(h) > 1],
                flags, tuple(0 if f else size[s] for f, s in zip(flags, shapes, strict=True)),
                problem)


__all__ = ["Columns", "Grid", "unique_columns"]
