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
from .boxes import DTYPE, GLOBAL_SHAPE, KEY, key_of, tensor_of
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
    layouts: dict[str, tuple[Box, ...]] = {}
    members: dict[str, list[int]] = {}
    tensors: dict[str, str] = {}
    for r in ranks:
        layouts.setdefault(r.layout, r.items)
        members.setdefault(r.layout, []).append(r.rank)
        tensors.setdefault(r.layout, r.tensors)
    memo: dict[tuple[str, tuple[int, ...]], int] = {}  # bytes per dtype and shape
    if union:
        # Layouts that hold the same keys (a pipeline stage's), grouped once.
        groups: dict[tuple[str, ...], dict[str, tuple[Box, ...]]] = {}
        for layout, items in layouts.items():
            groups.setdefault(tuple(map(key_of, items)), {})[layout] = items
        keys = _union_keys(groups, members)
        several, shared_flags, own_bytes, problem = _union_columns(layouts, groups, keys, memo)
    else:
        keys = _check_keys(layouts, members, tensors)
        columns = unique_columns(layouts)
        several, problem = columns.several, columns.problem
        shared_flags = dict(zip(layouts, columns.flags, strict=True))
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
    pieces: list[tuple[int, int, tuple[int, ...], Item, tuple[str, ...]]] = []
    for item, held_by in several.items():
        if held_by not in holder_sets:
            holder_sets[held_by] = tuple(sorted(r for lay in held_by for r in members[lay]))
        for cut in _cut(item, target, len(holder_sets[held_by])):
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
    for layout, items in layouts.items():
        planned[layout] = Layout(items, tuple(members[layout]),
                                 tuple(bounds(chooser, members[layout], own_bytes[layout])),
                                 bitmap(shared_flags[layout]))
    return Plan(tuple(keys), nodes, planned,
                {r: tuple(sorted(got, key=lambda p: (keys[p.key], p.offsets)))
                 for r, got in chosen.items()},
                target, total)


def _first_three(p: tuple[int, int, tuple[int, ...], Item, tuple[str, ...]]
                 ) -> tuple[int, int, tuple[int, ...]]:
    return p[0], p[1], p[2]


_FIELDS = tuple(map(operator.itemgetter, (KEY, DTYPE, GLOBAL_SHAPE)))  # a box's tensor's


def _check_keys(layouts: dict[str, tuple[Box, ...]], members: dict[str, list[int]],
                tensors: dict[str, str]) -> dict[str, int]:
    """Every rank must hold the same tensors (keys, dtypes, global shapes),
    in one order. Layouts whose ranks fingerprinted their tensors alike
    (plan.tensors_digest) hold the same ones, as ranks with one layout
    digest hold the same boxes; the others are compared by value, to find
    and name the difference."""
    (first_layout, first), *others = layouts.items()
    rank0 = members[first_layout][0]
    keys = {k: n for n, k in enumerate(map(key_of, first))}
    if len(keys) != len(first):
        raise PlanError(f"rank {rank0} describes a key twice")
    digest = tensors[first_layout]
    fields: list[list[object]] | None = None
    for layout, items in others:
        if digest and tensors[layout] == digest:
            continue
        fields = fields or _tensor_fields(first)
        if not _same_tensors(items, fields):
            got, want = list(map(tensor_of, items)), list(map(tensor_of, first))
            raise PlanError(f"rank {members[layout][0]} and rank {rank0} disagree on the "
                            f"state's tensors: {_first_difference(got, want)}"
                            + ("" if {k for k, _, _ in got} == set(keys) else _UNION_HINT))
    return keys


def _tensor_fields(items: tuple[Box, ...]) -> list[list[object]]:
    """The items' keys, dtypes and global shapes, a list each (_same_tensors)."""
    return [list(map(field, items)) for field in _FIELDS]


def _same_tensors(items: tuple[Box, ...], fields: list[list[object]]) -> bool:
    """Whether items hold the tensors of `fields` (_tensor_fields), in that
    order. Compared a field at a time: lists of references, where a list of
    (key, dtype, shape) tuples a layout made 370,000 tuples at 16,384 ranks."""
    return len(items) == len(fields[0]) and all(
        list(map(field, items)) == want for field, want in zip(_FIELDS, fields, strict=True))


_UNION_HINT = (" (ranks that hold different tensors, such as pipeline stages, save with "
               "union=True; a key must then name the same tensor on every rank that holds it)")


def _union_keys(groups: dict[tuple[str, ...], dict[str, tuple[Box, ...]]],
                members: dict[str, list[int]]) -> dict[str, int]:
    """The job's tensors when ranks may hold different ones: every key any
    layout holds, in the order the layouts (by first rank) first list them.
    A key that several layouts hold must have one dtype and global shape.
    Layouts that hold the same keys (`groups`, a stage's each) are compared
    as lists, in C (_same_tensors)."""
    seen: dict[str, tuple[str, tuple[int, ...], int]] = {}
    for group_keys, group in groups.items():
        (lead, lead_items), *others = group.items()
        rank = members[lead][0]
        if len(set(group_keys)) != len(group_keys):
            raise PlanError(f"rank {rank} describes a key twice")
        want = list(map(tensor_of, lead_items))
        fields = _tensor_fields(lead_items)
        for layout, items in others:
            if not _same_tensors(items, fields):
                got = list(map(tensor_of, items))
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


def _first_difference(got: list[tuple[str, str, tuple[int, ...]]],
                      want: list[tuple[str, str, tuple[int, ...]]]) -> str:
    for n, (a, b) in enumerate(zip(got, want, strict=False)):
        if a != b:
            return f"tensor {n} is {a[0]!r} {a[1]} {list(a[2])} vs {b[0]!r} {b[1]} {list(b[2])}"
    return f"{len(got)} tensors vs {len(want)}"


def _union_columns(layouts: dict[str, tuple[Box, ...]],
                   groups: dict[tuple[str, ...], dict[str, tuple[Box, ...]]],
                   keys: dict[str, int], memo: dict[tuple[str, tuple[int, ...]], int]
                   ) -> tuple[dict[Box, tuple[str, ...]], dict[str, tuple[bool, ...]],
                              dict[str, int], str | None]:
    """What unique_columns gives (the shared boxes, each layout's shared
    flags and own bytes, the first tiling problem) when layouts may hold
    different keys. Layouts that hold the same keys (`groups`, a pipeline
    stage's each) are columns of their own; when no key is held by several
    groups (no tied embedding across stages), that is all. Otherwise the
    keys that several groups hold are gone through a box at a time, over
    every layout, and the flags and bytes counted again from the boxes."""
    counts: dict[str, int] = {}
    for group_keys in groups:
        for k in group_keys:
            counts[k] = counts.get(k, 0) + 1
    across = {k for k, n in counts.items() if n > 1}
    if not across:
        several: dict[Box, tuple[str, ...]] = {}
        flags: dict[str, tuple[bool, ...]] = {}
        own: dict[str, int] = {}
        problems: list[tuple[int, str]] = []
        for group in groups.values():
            columns = unique_columns(group)
            several.update(columns.several)
            flags.update(zip(group, columns.flags, strict=True))
            own.update(zip(group, columns.own, strict=True))
            if columns.problem is not None and columns.problem_key is not None:
                problems.append((keys[columns.problem_key], columns.problem))
        return several, flags, own, min(problems)[1] if problems else None
    by_key, several = _unique_boxes_of_union(layouts, groups, keys, across)
    flags = {layout: tuple(map(several.__contains__, items)) for layout, items in layouts.items()}
    own = {layout: unique_bytes([list(itertools.compress(items, map(operator.not_, mine)))], memo)
           for (layout, items), mine in zip(layouts.items(), flags.values(), strict=True)}
    return several, flags, own, tiling_problem(by_key)


def _unique_boxes_of_union(layouts: dict[str, tuple[Box, ...]],
                           groups: dict[tuple[str, ...], dict[str, tuple[Box, ...]]],
                           keys: dict[str, int], across: set[str]
                           ) -> tuple[list[list[Box]], dict[Box, tuple[str, ...]]]:
    """The distinct boxes of each key (in the keys' order), and those that
    several layouts hold with the layouts that hold them, when layouts may
    hold different keys. Layouts that hold the same keys (`groups`, a
    pipeline stage's each) are deduplicated together as columns
    (columns.unique_columns); only the keys that several
    such groups hold (a tied embedding) are gone through a box at a time,
    over every layout."""
    by_key: list[list[Box]] = [[] for _ in keys]
    several: dict[Box, tuple[str, ...]] = {}
    for group_keys, members in groups.items():
        group = unique_columns(members)
        boxes, shared = group.by_key, group.several
        for key, distinct in zip(group_keys, boxes, strict=True):
            if key not in across:
                by_key[keys[key]] = distinct
        several.update((box, held) for box, held in shared.items() if box[KEY] not in across)
    if across:
        holders: list[dict[Box, list[str]]] = [{} for _ in keys]
        for layout, items in layouts.items():
            for item in items:
                if item[KEY] in across:
                    holders[keys[item[KEY]]].setdefault(item, []).append(layout)
        for k in across:
            by_key[keys[k]] = list(holders[keys[k]])
            several.update((box, tuple(held)) for box, held in holders[keys[k]].items()
                           if len(held) > 1)
    return by_key, several


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
