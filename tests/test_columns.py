"""columns.unique_columns (the planner's deduplication, a grid at a time,
of the tables ranks send) against a box-at-a-time reference, on random
meshes whose keys repeat grids (layer after layer, in several dtypes),
replicate over some ranks, leave shards empty, and are sometimes damaged
(gaps, overlaps, boxes outside)."""

from __future__ import annotations

import random

import pytest
from mesh_support import Tensor, mesh_items

from fastpersist.distributed.columns import Columns, unique_columns
from fastpersist.distributed.plan import Box, Item, bitmap, described
from fastpersist.distributed.table import BoxTable
from fastpersist.distributed.tiling import tiling_problem
from fastpersist.format import dtypes


def reference(layouts: dict[str, tuple[Box, ...]]) -> tuple[object, ...]:
    """What unique_columns must give, a box at a time."""
    names = list(layouts)
    by_key, holders = [], {}
    for column in zip(*layouts.values(), strict=True):
        by_key.append(list(dict.fromkeys(column)))
        for name, box in zip(names, column, strict=True):
            holders.setdefault(box, []).append(name)
    several = {box: tuple(h) for box, h in holders.items() if len(h) > 1}
    shared = [bitmap([box in several for box in items]) for items in layouts.values()]
    own = [sum(Item._make(b).nbytes for b in items if b not in several)
           for items in layouts.values()]
    problems = [(boxes[0][0], p) for boxes in by_key
                if (p := tiling_problem([boxes])) is not None]
    return several, shared, own, problems


def columns_of(layouts: dict[str, tuple[Box, ...]]) -> Columns:
    """unique_columns of the layouts as ranks send them (tables)."""
    tables = {name: BoxTable.received(described(items), n)
              for n, (name, items) in enumerate(layouts.items())}
    return unique_columns(tables, next(iter(tables.values())).tensors())


def random_layouts(seed: int) -> dict[str, tuple[Box, ...]]:
    rng = random.Random(seed)
    tp, fsdp = rng.choice([1, 2, 4]), rng.choice([1, 2, 3])
    # Few shapes, many keys: grids repeat, in different dtypes and replications.
    pool = [(), (0, 3), (1, rng.randint(1, 9)),
            *((rng.randint(1, 40), rng.randint(1, 12)) for _ in range(3))]
    keys: list[Tensor] = [(f"k{n}", rng.choice(["F32", "BF16", "I64"]), rng.choice(pool),
                           rng.random() < 0.3) for n in range(rng.randint(1, 30))]
    damage = random.Random(seed) if rng.random() < 0.3 else None
    return {f"layout{t}.{f}": tuple(map(tuple, mesh_items(keys, tp, fsdp, t, f, damage)))
            for t in range(tp) for f in range(fsdp)}


@pytest.mark.parametrize("seed", range(40))
def test_columns_are_what_a_box_at_a_time_finds(seed: int) -> None:
    layouts = random_layouts(seed)
    got = columns_of(layouts)
    several, shared, own, problems = reference(layouts)
    assert got.several == several and list(got.several) == list(several)  # and its order
    assert got.shared == shared
    assert got.own == own
    assert got.problems == problems


def test_a_grid_seen_in_another_dtype_counts_its_own_bytes() -> None:
    # The same boxes in F32 and BF16 (a parameter and its optimizer state):
    # one grid of places, two sizes.
    shard = [((0, 0), (4, 8)), ((4, 0), (4, 8))]
    layouts = {f"l{n}": (("w", "BF16", (8, 8), *shard[n]), ("m", "F32", (8, 8), *shard[n]))
               for n in range(2)}
    got = columns_of(layouts)
    assert got.own == [32 * (dtypes.itemsize("BF16") + dtypes.itemsize("F32"))] * 2
    assert not got.problems and not got.several


def test_no_items_and_replicated_columns() -> None:
    assert columns_of({"a": (), "b": ()}) == ({}, [b"", b""], [0, 0], [])
    whole = ("s", "F32", (), (), ())
    got = columns_of({"a": (whole,), "b": (whole,), "c": (whole,)})
    assert got.several == {whole: ("a", "b", "c")}
    assert got.shared == [b"\x01"] * 3 and got.own == [0, 0, 0]
