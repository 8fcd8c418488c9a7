"""Who writes what: one writer for every unique byte of a data-parallel job.

Each rank describes the tensors it holds as boxes of global tensors (a plain
tensor is the whole box and is replicated on every rank that has it; a
DTensor shard is the box its placement gives). Ranks that hold the same box
are replicas of it. The plan gives every unique box exactly one writer among
its holders, cutting large boxes into row ranges so that a few huge tensors
still spread over many writers, and it balances bytes per node (a node is
one set of drives) and per rank within the node alike (balance.py): boxes
that several layouts share are chosen for one by one, and each layout's own
boxes are cut into one consecutive run per replica.

Every rank holds the same tensors (the keys, dtypes and global shapes) unless
the save says union=True: then ranks may hold different ones (pipeline
stages, experts), the job's tensors are their union, and a key that several
ranks hold names one tensor, whose boxes those ranks hold (as in
data parallelism, a key is a global name).

make_plan is a pure, deterministic function of the ranks' descriptions: the
same descriptions give the same plan on any machine, and it can be tested with
thousands of simulated ranks in one process.
"""

from __future__ import annotations

import itertools
import math
import operator
from collections.abc import Sequence

from .. import gcpause
from ..errors import CheckpointError
from .balance import Chooser, bounds
from .boxes import DTYPE, KEY, OFFSETS, SHAPE, key_of
from .columns import unique_columns
from .plan import (
    DEFAULT_MIN_PIECE_BYTES,
    Box,
    Item,
    Layout,
    Piece,
    Plan,
    PlanCache,
    RankInfo,
    Share,
    bitmap,
    keys_digest,
    layout_digest,
    make_piece,
)
from .runs import split_rows
from .table import BoxTable, Tensor
from .tiling import tiling_problem, unique_bytes


class PlanError(CheckpointError):
    """The ranks' descriptions do not fit together (different keys, dtypes, shapes)."""


@gcpause.paused()  # the plan's many small objects hold no cycles: see gcpause
def make_plan(ranks: Sequence[RankInfo], *, min_piece_bytes: int = DEFAULT_MIN_PIECE_BYTES,
              union: bool = False) -> Plan:
    """The plan for these ranks' descriptions; raises PlanError when they
    disagree. union: the ranks may hold different tensors (module docstring)."""
    if not ranks:
        raise PlanError("no ranks to plan for")
    ranks = sorted(ranks, key=lambda r: r.rank)
    nodes = {r.rank: r.node for r in ranks}
    if len(nodes) != len(ranks):
        raise PlanError("two descriptions carry the same rank")
    # Ranks of one layout hold the same boxes: work per layout, not per rank
    # (pure data parallelism is one layout however many ranks there are).
    layouts: dict[str, BoxTable] = {}
    members: dict[str, list[int]] = {}
    for r in ranks:
        if r.layout not in layouts:
            layouts[r.layout] = (r.items if isinstance(r.items, BoxTable)
                                 else BoxTable.of(r.items))
        members.setdefault(r.layout, []).append(r.rank)
    # Each table's tensors, read once per fingerprint (table.py).
    known: dict[str, tuple[Tensor, ...]] = {}
    for layout, table in layouts.items():
        problem = table.problem(len(table.tensors(known)))
        if problem:
            raise PlanError(f"rank {members[layout][0]}'s description is malformed: {problem}")
    memo: dict[tuple[str, tuple[int, ...]], int] = {}  # bytes per dtype and shape
    if union:
        # Layouts that hold the same keys (a pipeline stage's), grouped once.
        groups: dict[tuple[str, ...], dict[str, BoxTable]] = {}
        keys_of: dict[int, tuple[str, ...]] = {}  # by id of a tensors tuple
        for layout, table in layouts.items():
            tensors = table.tensors(known)
            if id(tensors) not in keys_of:
                keys_of[id(tensors)] = tuple(map(key_of, tensors))
            groups.setdefault(keys_of[id(tensors)], {})[layout] = table
        keys = _union_keys(groups, members, known)
        several, shared_maps, own_bytes, problem = _union_columns(layouts, groups, keys, memo,
                                                                  known)
    else:
        keys = _check_keys(layouts, members, known)
        columns = unique_columns(layouts, layouts[next(iter(layouts))].tensors(known))
        several = columns.several
        problem = columns.problems[0][1] if columns.problems else None
        shared_maps = dict(zip(layouts, columns.shared, strict=True))
        own_bytes = dict(zip(layouts, columns.own, strict=True))
    if problem:
        raise PlanError(problem)
    # The job's bytes: the layouts' own, and the shared boxes', each counted once.
    total = sum(own_bytes.values()) + unique_bytes([list(several)], memo)
    # Cut so that each writer gets many pieces: the greedy choice below
    # balances to within about one piece, here 1/16 of a writer's share.
    target = max(min_piece_bytes, math.ceil(total / (len(ranks) * 16)), 1)
    chooser = Chooser(nodes)
    # 1. Boxes that several layouts hold (a norm replicated over TP ranks, a
    # scalar every rank has): cut, and each piece, largest first, to the
    # least-filled of all their holders.
    holder_sets: dict[tuple[str, ...], tuple[int, ...]] = {}
    pieces: list[tuple[int, int, tuple[int, ...], Box, tuple[str, ...]]] = []
    for box, held_by in several.items():
        if held_by not in holder_sets:
            holder_sets[held_by] = tuple(sorted(r for lay in held_by for r in members[lay]))
        nbytes = memo[box[DTYPE], box[SHAPE]]  # unique_bytes counted every shared box's
        if nbytes <= target:  # the usual shared box (a norm, a scalar): one piece
            pieces.append((-nbytes, keys[box[KEY]], box[OFFSETS], box, held_by))
            continue
        for cut in _cut(box, target, len(holder_sets[held_by])):
            pieces.append((-cut.nbytes, keys[cut.key], cut.offsets, cut, held_by))
    pieces.sort(key=_first_three)  # largest first, ties in a fixed order
    chosen: dict[int, list[Piece]] = {}
    for size, _, _, item, held_by in pieces:
        rank = chooser.pick(held_by, holder_sets[held_by], -size)
        chosen.setdefault(rank, []).append(make_piece((*item, rank)))
    # 2. Each layout's own boxes (most of a job's bytes), which only its
    # members hold: in the layout's order, one run a member, the runs sized to
    # bring the members' loads level (balance.bounds). The plan keeps where
    # the runs end; each member cuts its own (runs.py). No per-piece choice
    # and no piece made here: at thousands of ranks those were most of the
    # plan's time.
    planned: dict[str, Layout] = {}
    for layout, table in layouts.items():
        planned[layout] = Layout(table, tuple(members[layout]),
                                 tuple(bounds(chooser, members[layout], own_bytes[layout])),
                                 shared_maps[layout])
    return Plan(tuple(keys), nodes, planned,
                {r: tuple(sorted(got, key=lambda p: (keys[p.key], p.offsets)))
                 for r, got in chosen.items()},
                target, total)


def _first_three(p: tuple[int, int, tuple[int, ...], Box, tuple[str, ...]]
                 ) -> tuple[int, int, tuple[int, ...]]:
    return p[0], p[1], p[2]


def _check_keys(layouts: dict[str, BoxTable], members: dict[str, list[int]],
                known: dict[str, tuple[Tensor, ...]]) -> dict[str, int]:
    """Every rank must hold the same tensors (keys, dtypes, global shapes),
    in one order. Tables with one fingerprint hold the same tensors (as
    ranks with one layout digest hold the same boxes) and were read once
    (table.py); the others are compared by value, to find and name the
    difference."""
    (first_layout, first), *others = layouts.items()
    rank0 = members[first_layout][0]
    want = first.tensors(known)
    keys = {k: n for n, k in enumerate(map(key_of, want))}
    if len(keys) != len(want):
        raise PlanError(f"rank {rank0} describes a key twice")
    for layout, table in others:
        got = table.tensors(known)
        if got is not want and got != want:
            raise PlanError(f"rank {members[layout][0]} and rank {rank0} disagree on the "
                            f"state's tensors: {_first_difference(got, want)}"
                            + ("" if {k for k, _, _ in got} == set(keys) else _UNION_HINT))
    return keys


_UNION_HINT = (" (ranks that hold different tensors, such as pipeline stages, save with "
               "union=True; a key must then name the same tensor on every rank that holds it)")


def _union_keys(groups: dict[tuple[str, ...], dict[str, BoxTable]],
                members: dict[str, list[int]], known: dict[str, tuple[Tensor, ...]]
                ) -> dict[str, int]:
    """The job's tensors when ranks may hold different ones: every key any
    layout holds, in the order the layouts (by first rank) first list them.
    A key that several layouts hold must have one dtype and global shape.
    Layouts that hold the same keys (`groups`, a stage's each) are compared
    as tuples, in C, where their fingerprints differ."""
    seen: dict[str, tuple[str, tuple[int, ...], int]] = {}
    for group_keys, group in groups.items():
        (lead, lead_table), *others = group.items()
        rank = members[lead][0]
        if len(set(group_keys)) != len(group_keys):
            raise PlanError(f"rank {rank} describes a key twice")
        want = lead_table.tensors(known)
        for layout, table in others:
            got = table.tensors(known)
            if got is not want and got != want:
                (key, dtype, shape), (_, first_dtype, first_shape) = next(
                    (a, b) for a, b in zip(got, want, strict=True) if a != b)
                raise PlanError(_disagree(key, dtype, shape, members[layout][0],
                                          first_dtype, first_shape, rank))
        for key, dtype, shape in want:
            first = seen.setdefault(key, (dtype, shape, rank))
            if first[:2] != (dtype, shape):
                raise PlanError(_disagree(key, dtype, shape, rank, *first))
    return {k: n for n, k in enumerate(seen)}


def _disagree(key: str, dtype: str, shape: tuple[int, ...], rank: int, first_dtype: str,
              first_shape: tuple[int, ...], first_rank: int) -> str:
    return (f"{key!r} is {dtype} {list(shape)} on rank {rank} but {first_dtype} "
            f"{list(first_shape)} on rank {first_rank}: with union=True a key names one "
            "tensor on every rank that holds it (key each stage's values by parameter name, "
            "e.g. torch.distributed.checkpoint.state_dict's get_state_dict, or nest each "
            "stage's state under a key of its own)")


def _first_difference(got: Sequence[Tensor], want: Sequence[Tensor]) -> str:
    for n, (a, b) in enumerate(zip(got, want, strict=False)):
        if a != b:
            return f"tensor {n} is {a[0]!r} {a[1]} {list(a[2])} vs {b[0]!r} {b[1]} {list(b[2])}"
    return f"{len(got)} tensors vs {len(want)}"


def _union_columns(layouts: dict[str, BoxTable],
                   groups: dict[tuple[str, ...], dict[str, BoxTable]],
                   keys: dict[str, int], memo: dict[tuple[str, tuple[int, ...]], int],
                   known: dict[str, tuple[Tensor, ...]]
                   ) -> tuple[dict[Box, tuple[str, ...]], dict[str, bytes], dict[str, int],
                              str | None]:
    """What unique_columns gives (the shared boxes, each layout's bitmap of
    them and own bytes, the first tiling problem in the job's order of keys)
    when layouts may hold different keys. Layouts that hold the same keys
    (`groups`, a pipeline stage's each) are columns of their own; the keys
    that several groups hold (a tied embedding across stages), if any, are
    gone through a box at a time, over every layout, and the bitmaps and
    bytes counted again from the boxes."""
    counts: dict[str, int] = {}
    for group_keys in groups:
        for k in group_keys:
            counts[k] = counts.get(k, 0) + 1
    across = {k for k, n in counts.items() if n > 1}
    several: dict[Box, tuple[str, ...]] = {}
    maps: dict[str, bytes] = {}
    own: dict[str, int] = {}
    problems: list[tuple[int, str]] = []
    for group in groups.values():
        columns = unique_columns(group, next(iter(group.values())).tensors(known))
        several.update((box, held) for box, held in columns.several.items()
                       if box[KEY] not in across)
        maps.update(zip(group, columns.shared, strict=True))
        own.update(zip(group, columns.own, strict=True))
        problems.extend((keys[k], text) for k, text in columns.problems if k not in across)
    if across:
        holders: list[dict[Box, list[str]]] = [{} for _ in keys]
        for layout, table in layouts.items():
            for box in table:
                if box[KEY] in across:
                    holders[keys[box[KEY]]].setdefault(box, []).append(layout)
        for k in across:
            several.update((box, tuple(held)) for box, held in holders[keys[k]].items()
                           if len(held) > 1)
            problem = tiling_problem([list(holders[keys[k]])])
            if problem is not None:
                problems.append((keys[k], problem))
        for layout, table in layouts.items():
            flags = list(map(several.__contains__, table))
            maps[layout] = bitmap(flags)
            own[layout] = unique_bytes(
                [list(itertools.compress(table, map(operator.not_, flags)))], memo)
    return several, maps, own, min(problems)[1] if problems else None


def _cut(box: Box, target: int, holders: int) -> list[Item]:
    """Row ranges of box, each about `target` bytes (one piece if only one rank holds it)."""
    item = Item._make(box)
    if not item.shape or item.shape[0] <= 1 or holders <= 1 or item.nbytes <= target:
        return [item]
    n = math.ceil(item.nbytes / target)
    if n > holders:
        # A multiple of the holders, so that a huge tensor alone splits evenly.
        n = math.ceil(n / holders) * holders
    return list(map(Item._make, split_rows(item, 0, item.shape[0], min(item.shape[0], n))))


__all__ = ["DEFAULT_MIN_PIECE_BYTES", "Item", "Piece", "Plan", "PlanCache", "PlanError",
           "RankInfo", "Share", "keys_digest", "layout_digest", "make_plan"]
