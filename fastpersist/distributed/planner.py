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

make_plan is a pure, deterministic function of the ranks' descriptions: the
same descriptions give the same plan on any machine, and it can be tested with
thousands of simulated ranks in one process.
"""

from __future__ import annotations

import bisect
import functools
import hashlib
import itertools
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from ..errors import CheckpointError
from ..format import dtypes
from .balance import Chooser, fill
from .tiling import tiling_problem, unique_bytes

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
    # What is worked out from the plan alone, once (written.py's chunks of the
    # job manifest): a plan is made once and used save after save (PlanCache).
    memo: dict[str, object] = field(default_factory=dict, hash=False, compare=False,
                                    repr=False)

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
    by_key, several = _unique_boxes(layouts)
    problem = tiling_problem(by_key)
    if problem:
        raise PlanError(problem)
    total = unique_bytes(by_key)
    memo: dict[tuple[str, tuple[int, ...]], int] = {}
    # Cut so that each writer gets many pieces: the greedy choice below
    # balances to within about one piece, here 1/16 of a writer's share.
    target = max(min_piece_bytes, math.ceil(total / (len(ranks) * 16)), 1)
    chooser = Chooser(nodes)
    piece = functools.partial(tuple.__new__, Piece)  # Piece._make's way, without its checks
    mine: dict[int, list[Piece]] = {r: [] for r in nodes}
    chosen: dict[int, list[Piece]] = {}  # the pieces of shared boxes
    # 1. Boxes that several layouts hold (a norm replicated over TP ranks, a
    # scalar every rank has): cut, and each piece, largest first, to the
    # least-filled of all their holders.
    shared = list(several.items())
    holder_sets: dict[tuple[str, ...], tuple[int, ...]] = {}
    pieces: list[tuple[int, int, tuple[int, ...], Item, tuple[str, ...]]] = []
    for item, held_by in shared:
        if held_by not in holder_sets:
            holder_sets[held_by] = tuple(sorted(r for lay in held_by for r in members[lay]))
        for cut in _cut(item, target, len(holder_sets[held_by])):
            pieces.append((-cut.nbytes, keys[cut.key], cut.offsets, cut, held_by))
    pieces.sort(key=_first_three)  # largest first, ties in a fixed order
    for size, _, _, item, held_by in pieces:
        rank = chooser.pick(held_by, holder_sets[held_by], -size)
        chosen.setdefault(rank, []).append(piece((*item, rank)))
    # 2. Each layout's own boxes (most of a job's bytes), which only its
    # members hold: in the layout's order, cut into one run a member, the
    # runs sized to bring the members' loads level (balance.py). No
    # per-piece choice: at thousands of ranks that greedy choice was most of
    # the plan's time.
    for layout, items in layouts.items():
        own = list(itertools.filterfalse(several.__contains__, items))
        if own:
            fill(own, _sizes(own, memo), members[layout], chooser, target, mine, piece)
    # Each writer's pieces in the ranks' key order, then by offsets: the
    # order fill gives a writer its own pieces in (a layout's items are in
    # that order, _check_keys). A rank holds one box of a key, own or shared,
    # so its chosen pieces go in between, each after the keys before its own.
    order = keys.__getitem__
    out: list[Piece] = []
    for rank in sorted(mine):
        got = mine[rank]
        for p in sorted(chosen.get(rank, ()), key=lambda p: (keys[p.key], p.offsets)):
            got.insert(bisect.bisect_right(got, order(p.key), key=lambda q: order(q.key)), p)
        out += got
    return Plan(tuple(out), tuple(keys), nodes)


def _sizes(boxes: Iterable[Item], memo: dict[tuple[str, tuple[int, ...]], int]) -> list[int]:
    """Each box's bytes (Item.nbytes), worked out once per dtype and shape:
    a job has few shapes and many boxes."""
    out = []
    for box in boxes:
        shape = (box.dtype, box.shape)
        n = memo.get(shape)
        if n is None:
            n = memo[shape] = box.nbytes
        out.append(n)
    return out


def _first_three(p: tuple[int, int, tuple[int, ...], Item, tuple[str, ...]]
                 ) -> tuple[int, int, tuple[int, ...]]:
    return p[0], p[1], p[2]


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


def _unique_boxes(layouts: dict[str, tuple[Item, ...]]
                  ) -> tuple[list[list[Item]], dict[Item, tuple[str, ...]]]:
    """The distinct boxes of each key (in the keys' order), and those that
    several layouts hold with the layouts that hold them. Every layout lists
    the keys in one order (_check_keys), so a key's boxes are a column of
    the layouts' items, deduplicated in C: a Python step per box was a large
    part of a plan at thousands of ranks, and most keys are sharded (no box
    shared) or replicated (one box)."""
    names = list(layouts)
    by_key: list[list[Item]] = []
    several: dict[Item, tuple[str, ...]] = {}
    for column in zip(*layouts.values(), strict=True):
        distinct = dict.fromkeys(column)
        if len(distinct) < len(column):
            held: dict[Item, list[str]] = {}
            for layout, box in zip(names, column, strict=True):
                held.setdefault(box, []).append(layout)
            several.update((box, tuple(h)) for box, h in held.items() if len(h) > 1)
        by_key.append(list(distinct))
    return by_key, several


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
