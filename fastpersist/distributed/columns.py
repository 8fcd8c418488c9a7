"""The layouts' boxes a key at a time, for the planner (planner.py): which
several layouts hold (and which layouts those are), whether a key's boxes
tile its tensor, and each layout's own bytes.

When every layout holds the same tensors in one order, a key's boxes are a
column of the layouts' tables (table.py): a row of place numbers, one per
layout. A job's columns repeat a few grids (the places, in the layouts'
order, of a dtype and global shape): an optimizer's states are cut as
their parameter is, layer after layer, and a norm is replicated over the
same ranks in every layer. Each grid is worked out once, whatever the key;
a column costs the lookup of its row's bytes, so that rank 0 neither
hashes every box nor goes through shared boxes one by one. Torch-free and
pure.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import NamedTuple

import numpy as np

from ..format import dtypes
from .table import Box, BoxTable, Place, Tensor
from .tiling import grid_problem


class Grid(NamedTuple):
    """What one grid's columns share: `shared` names the layouts that hold
    each box several hold (with where it first is), `flags` says which
    layouts' boxes are such, `own` is each layout's bytes of the key that
    only it holds, and `problem` what is wrong with the tiling
    (tiling.grid_problem)."""

    shared: list[tuple[int, tuple[str, ...]]]
    flags: np.ndarray  # of bool, a layout each
    own: tuple[int, ...]
    problem: str | None


class Columns(NamedTuple):
    """unique_columns' result: the boxes several layouts hold, with those
    layouts (`several`, in the keys' order); per layout, in the tables'
    order, the bitmap of its items that are such (`shared`, as
    plan.bitmap) and its own bytes (`own`); and what is wrong with each
    key whose boxes do not tile it, as (key, message), in the keys' order
    (`problems`)."""

    several: dict[Box, tuple[str, ...]]
    shared: list[bytes]
    own: list[int]
    problems: list[tuple[str, str]]


def unique_columns(tables: Mapping[str, BoxTable], tensors: Sequence[Tensor]) -> Columns:
    """The columns of `tables`, which all hold `tensors` in that order (the
    planner checks that first, and each table's problem())."""
    names = list(tables)
    # Place numbers for the job, where a table's are its own.
    numbers: dict[Place, int] = {}
    rows = []
    for table in tables.values():
        mine = np.fromiter((numbers.setdefault(p, len(numbers)) for p in table.places),
                           dtype=np.int32, count=len(table.places))
        rows.append(mine[table.where()])
    places = list(numbers)
    grid_rows = np.stack(rows, axis=1)  # row c: key c's place in every layout
    grids: dict[tuple[object, ...], Grid] = {}
    seen: list[Grid] = []
    several: dict[Box, tuple[str, ...]] = {}
    problems: list[tuple[str, str]] = []
    for (key, dtype, global_shape), row in zip(tensors, grid_rows, strict=True):
        at = (dtype, global_shape, row.tobytes())
        grid = grids.get(at)
        if grid is None:
            grid = grids[at] = _grid(names, dtype, global_shape,
                                     list(map(places.__getitem__, row.tolist())))
        seen.append(grid)
        if grid.shared:
            held = row.tolist()
            several.update(((key, dtype, global_shape, *places[held[j]]), holders)
                           for j, holders in grid.shared)
        if grid.problem is not None:
            problems.append((key, f"{key}: {grid.problem}"))
    own = [0] * len(names)
    by_id = {id(g): g for g in grids.values()}
    for ident, times in Counter(map(id, seen)).items():
        own = [a + times * b for a, b in zip(own, by_id[ident].own, strict=True)]
    flags = (np.stack([g.flags for g in seen]) if seen
             else np.zeros((0, len(names)), dtype=bool))
    packed = np.packbits(flags, axis=0, bitorder="little")  # as plan.bitmap
    return Columns(several, [packed[:, j].tobytes() for j in range(len(names))], own,
                   problems)


def _grid(names: list[str], dtype: str, global_shape: tuple[int, ...],
          places: list[Place]) -> Grid:
    distinct = list(dict.fromkeys(places))
    itemsize = dtypes.itemsize(dtype)
    size = {s: math.prod(s) * itemsize for _, s in distinct}
    problem = grid_problem(global_shape, distinct)
    if len(distinct) == len(places):  # a sharded key: nothing shared
        return Grid([], np.zeros(len(names), dtype=bool),
                    tuple(size[s] for _, s in places), problem)
    index = {p: n for n, p in enumerate(distinct)}
    pattern = list(map(index.__getitem__, places))
    held: list[list[int]] = [[] for _ in distinct]
    for j, n in enumerate(pattern):
        held[n].append(j)
    flags = [len(held[n]) > 1 for n in pattern]
    return Grid([(h[0], tuple(names[j] for j in h)) for h in held if len(h) > 1],
                np.array(flags, dtype=bool),
                tuple(0 if f else size[s] for f, (_, s) in zip(flags, places, strict=True)),
                problem)


__all__ = ["Columns", "Grid", "unique_columns"]
