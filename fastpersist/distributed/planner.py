"""Who writes what: one writer for every unique byte of a data-parallel job.

Each rank describes the tensors it holds as boxes of global tensors (a plain
tensor is the whole box and is replicated on every rank that has it; a
DTensor shard is the box its placement gives). Ranks that hold the same box
are replicas of it. The plan gives every unique box exactly one writer among
its holders, after cutting large boxes into row ranges so that a few huge
tensors still spread over many writers, and it balances bytes per node (a
node is one set of drives) and per rank within the node alike (_Chooser).

make_plan is a pure, deterministic function of the ranks' descriptions: the
same descriptions give the same plan on any machine, and it can be tested with
thousands of simulated ranks in one process.
"""

from __future__ import annotations

import hashlib
import heapq
import itertools
import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from ..errors import CheckpointError
from ..format import dtypes

# Boxes larger than this are cut into row ranges (unless the caller says
# otherwise): big enough that a piece is written at full speed, small enough
# that a handful of huge tensors still balances over many writers.
DEFAULT_MIN_PIECE_BYTES = 4 << 20


class PlanError(CheckpointError):
    """The ranks' descriptions do not fit together (different keys, dtypes, shapes)."""


class Item(NamedTuple):
    """A box of a global tensor that a rank holds: rows offsets[0]..offsets[0]+shape[0], etc.
    A named tuple, not a dataclass: the planner hashes, sorts and pickles
    hundreds of thousands of them at scale, and a tuple does that in C."""

    key: str
    dtype: str
    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * dtypes.itemsize(self.dtype)

    @staticmethod
    def whole(key: str, dtype: str, shape: tuple[int, ...]) -> Item:
        return Item(key, dtype, shape, (0,) * len(shape), shape)


def layout_digest(items: Sequence[Item]) -> str:
    """Fingerprint of a rank's items. Each rank computes its own (in parallel),
    so that the planner groups ranks of one layout without comparing items,
    and a plan cache can tell an unchanged layout from a few bytes per rank."""
    h = hashlib.blake2b(digest_size=16)
    for i in items:
        h.update(repr((i.key, i.dtype, i.global_shape, i.offsets, i.shape)).encode())
    return h.hexdigest()


@dataclass(frozen=True)
class RankInfo:
    """What one rank tells the coordinator: where it runs and what it holds.
    `layout` is layout_digest(items); ranks with equal layouts hold the same boxes."""

    rank: int
    node: str
    items: tuple[Item, ...]
    layout: str


class Piece(NamedTuple):
    """A box one writer writes: `item`'s rows start..start+rows (whole item: 0..shape[0])."""

    key: str
    dtype: str
    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]  # in the global tensor
    shape: tuple[int, ...]
    writer: int

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * dtypes.itemsize(self.dtype)

    @property
    def name(self) -> str:
        """Its name in a data file: unique within the checkpoint."""
        return f"{self.key}@{','.join(map(str, self.offsets))}"


@dataclass(frozen=True)
class Plan:
    pieces: tuple[Piece, ...]
    keys: tuple[str, ...]  # the job's tensors, in the ranks' order (not in a share)
    nodes: dict[int, str] = field(hash=False)

    def for_rank(self, rank: int) -> list[Piece]:
        return [p for p in self.pieces if p.writer == rank]

    def bytes_per_rank(self) -> dict[int, int]:
        out = dict.fromkeys(self.nodes, 0)
        for p in self.pieces:
            out[p.writer] += p.nbytes
        return out

    def bytes_per_node(self) -> dict[str, int]:
        out = dict.fromkeys(sorted(set(self.nodes.values())), 0)
        for p in self.pieces:
            out[self.nodes[p.writer]] += p.nbytes
        return out

    def shares(self) -> list[Plan]:
        """Each rank's part of the plan (its pieces and its node), in one pass:
        what a rank other than the coordinator needs to write, so that the
        coordinator sends each rank O(its pieces), not the whole plan. Not
        the keys: only the coordinator builds the manifest, and the keys of a
        large model (thousands) were most of a share, sent to every rank."""
        mine: dict[int, list[Piece]] = {r: [] for r in self.nodes}
        for p in self.pieces:
            mine[p.writer].append(p)
        return [Plan(tuple(mine[r]), (), {r: self.nodes[r]}) for r in sorted(self.nodes)]

    @property
    def unique_bytes(self) -> int:
        return sum(p.nbytes for p in self.pieces)

    def __reduce__(self) -> tuple[object, tuple[object, ...]]:
        # Pieces travel as plain tuples: pickle writes those in C, and a named
        # tuple costs a Python call each (the scatter of thousands of shares).
        return _plan_of, (tuple(map(tuple, self.pieces)), self.keys, self.nodes)


def _plan_of(pieces: tuple[tuple[object, ...], ...], keys: tuple[str, ...],
             nodes: dict[int, str]) -> Plan:
    return Plan(tuple(map(Piece._make, pieces)), keys, nodes)


def make_plan(ranks: Sequence[RankInfo], *, min_piece_bytes: int = DEFAULT_MIN_PIECE_BYTES
              ) -> Plan:
    """The plan for these ranks' descriptions; raises PlanError when they disagree."""
    if not ranks:
        raise PlanError("no ranks to plan for")
    ranks = sorted(ranks, key=lambda r: r.rank)
    nodes = {r.rank: r.node for r in ranks}
    if len(nodes) != len(ranks):
        raise PlanError("two descriptions carry the same rank")
    # Ranks of one layout hold the same boxes: work per layout, not per rank
    # (pure data parallelism is one layout however many ranks there are).
    layouts: dict[str, tuple[Item, ...]] = {}
    members: dict[str, list[int]] = {}
    for r in ranks:
        layouts.setdefault(r.layout, r.items)
        members.setdefault(r.layout, []).append(r.rank)
    keys = _check_keys(layouts, members)
    boxes = _unique_boxes(layouts)
    _check_tiling(boxes)
    sizes = {item: item.nbytes for item in boxes}
    total = sum(sizes.values())
    # Cut so that each writer gets many pieces: the greedy assignment below
    # balances to within about one piece, here 1/16 of a writer's share.
    target = max(min_piece_bytes, math.ceil(total / (len(ranks) * 16)), 1)
    holder_sets: dict[tuple[str, ...], tuple[int, ...]] = {}
    pieces: list[tuple[int, int, tuple[int, ...], Item, tuple[str, ...]]] = []
    for item, held_by in boxes.items():
        if held_by not in holder_sets:
            holder_sets[held_by] = tuple(sorted(r for lay in held_by for r in members[lay]))
        size = sizes[item]
        if size <= target or not item.shape or item.shape[0] <= 1:
            pieces.append((-size, keys[item.key], item.offsets, item, held_by))
            continue
        for cut in _cut(item, target, len(holder_sets[held_by])):
            pieces.append((-cut.nbytes, keys[cut.key], cut.offsets, cut, held_by))
    # Largest first (ties in a fixed order) is what makes greedy balance well.
    pieces.sort(key=_first_three)
    pick = _Chooser(nodes).pick
    assigned = [
        (pick(held_by, holder_sets[held_by], -size), order, item)
        for size, order, _, item, held_by in pieces
    ]
    assigned.sort(key=_first_two_and_offsets)
    make = Piece._make
    return Plan(tuple([make((*item, writer)) for writer, _, item in assigned]), tuple(keys), nodes)


def _first_three(p: tuple[int, int, tuple[int, ...], Item, tuple[str, ...]]
                 ) -> tuple[int, int, tuple[int, ...]]:
    return p[0], p[1], p[2]


def _first_two_and_offsets(a: tuple[int, int, Item]) -> tuple[int, int, tuple[int, ...]]:
    return a[0], a[1], a[2].offsets


def _check_keys(layouts: dict[str, tuple[Item, ...]], members: dict[str, list[int]]
                ) -> dict[str, int]:
    """Every rank must hold the same tensors (keys, dtypes, global shapes), in one order."""
    (first_layout, first), *others = layouts.items()
    rank0 = members[first_layout][0]
    want = [(i.key, i.dtype, i.global_shape) for i in first]
    if len({k for k, _, _ in want}) != len(want):
        raise PlanError(f"rank {rank0} describes a key twice")
    for layout, items in others:
        got = [(i.key, i.dtype, i.global_shape) for i in items]
        if got != want:
            raise PlanError(f"rank {members[layout][0]} and rank {rank0} disagree on the "
                            f"state's tensors: {_first_difference(got, want)}")
    return {k: n for n, (k, _, _) in enumerate(want)}


def _first_difference(got: list[tuple[str, str, tuple[int, ...]]],
                      want: list[tuple[str, str, tuple[int, ...]]]) -> str:
    for n, (a, b) in enumerate(zip(got, want, strict=False)):
        if a != b:
            return f"tensor {n} is {a[0]!r} {a[1]} {list(a[2])} vs {b[0]!r} {b[1]} {list(b[2])}"
    return f"{len(got)} tensors vs {len(want)}"


def _unique_boxes(layouts: dict[str, tuple[Item, ...]]) -> dict[Item, tuple[str, ...]]:
    """Each distinct box and the layouts that hold it."""
    held_by: dict[Item, list[str]] = {}
    for layout, items in layouts.items():
        for item in items:
            held_by.setdefault(item, []).append(layout)
    return {item: tuple(h) for item, h in held_by.items()}


def _check_tiling(boxes: dict[Item, tuple[str, ...]]) -> None:
    """The distinct boxes of each key must lie inside it and cover it exactly once."""
    by_key: dict[str, list[Item]] = {}
    for item in boxes:
        if len(item.offsets) != len(item.global_shape) or len(item.shape) != len(
                item.global_shape) or any(
                o < 0 or o + n > g for o, n, g in zip(item.offsets, item.shape, item.global_shape,
                                                      strict=True)):
            raise PlanError(f"{item.key}: box at {list(item.offsets)} of shape {list(item.shape)} "
                            f"lies outside the tensor's shape {list(item.global_shape)}")
        by_key.setdefault(item.key, []).append(item)
    # An optimizer's states are sharded as their parameter is: one grid check
    # serves every key with the same boxes.
    checked: dict[tuple[tuple[tuple[int, ...], tuple[int, ...]], ...], bool] = {}
    for key, items in by_key.items():
        whole = math.prod(items[0].global_shape)
        volume = sum(math.prod(i.shape) for i in items)
        if volume == whole and len(items) > 1:
            boxes_of_key = tuple(sorted((i.offsets, i.shape) for i in items))
            overlap = checked.get(boxes_of_key)
            if overlap is None:
                overlap = checked[boxes_of_key] = _overlapping(items)
        else:
            overlap = False
        if volume != whole or overlap:
            raise PlanError(f"{key}: the ranks' shards hold {volume} elements of a tensor of "
                            f"{whole}, and must cover it once (shards overlap or leave gaps)")


_MAX_GRID_CELLS = 1 << 20


def _overlapping(items: list[Item]) -> bool:
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


def _cut(item: Item, target: int, holders: int) -> list[Item]:
    """Row ranges of item, each about `target` bytes (one piece if only one rank holds it)."""
    if not item.shape or item.shape[0] <= 1 or holders <= 1 or item.nbytes <= target:
        return [item]
    n = math.ceil(item.nbytes / target)
    if n > holders:
        # A multiple of the holders, so that a huge tensor alone splits evenly.
        n = math.ceil(n / holders) * holders
    n = min(item.shape[0], n)
    rows, extra = divmod(item.shape[0], n)
    out, start = [], 0
    for i in range(n):
        count = rows + (i < extra)
        out.append(Item(item.key, item.dtype, item.global_shape,
                        (item.offsets[0] + start, *item.offsets[1:]),
                        (count, *item.shape[1:])))
        start += count
    return out


class _Chooser:
    """The holder whose share is least filled: a rank's load weighted by the
    ranks on its node, so that every node (one set of drives) is filled
    alike however many ranks it has, and the ranks of one node alike.

    Weighing ranks and nodes in one key matters: choosing the least-loaded
    node first and a rank there second balanced nodes but left the ranks of
    an HSDP job (a box's holders one per node) up to 2x apart. A key changes
    only when its own rank is chosen, so each holder set keeps a lazy
    min-heap whose stale entries (the rank was chosen for another set) are
    refreshed when they surface. Ties go to the lower rank: deterministic."""

    def __init__(self, nodes: dict[int, str]) -> None:
        per_node = Counter(nodes.values())
        self.weight = {r: per_node[n] for r, n in nodes.items()}
        self.load: dict[int, int] = dict.fromkeys(nodes, 0)  # weighted
        self.heaps: dict[tuple[str, ...], list[tuple[int, int]]] = {}

    def pick(self, held_by: tuple[str, ...], holders: tuple[int, ...], nbytes: int) -> int:
        """held_by names the holder set (its layouts); holders are its ranks."""
        heap = self.heaps.get(held_by)
        if heap is None:
            heap = self.heaps[held_by] = [(self.load[r], r) for r in holders]
            heapq.heapify(heap)
        load = self.load
        while True:
            recorded, rank = heap[0]
            if recorded == load[rank]:
                break
            heapq.heapreplace(heap, (load[rank], rank))
        load[rank] += nbytes * self.weight[rank]
        heapq.heapreplace(heap, (load[rank], rank))
        return rank


class PlanCache:
    """The last plan and the descriptions it was made for: an unchanged layout
    (the usual case, save after save) costs a digest comparison, not a plan."""

    def __init__(self) -> None:
        self.digests: tuple[str, ...] | None = None
        self.plan: Plan | None = None

    def get(self, digests: Sequence[str]) -> Plan | None:
        return self.plan if self.digests == tuple(digests) else None

    def put(self, digests: Sequence[str], plan: Plan) -> None:
        self.digests, self.plan = tuple(digests), plan
