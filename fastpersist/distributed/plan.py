"""A plan's data: the boxes ranks hold (Item), the pieces writers write
(Piece), and the plan itself (Plan, on the coordinator) with each rank's part
of it (Share, what the coordinator sends that rank). planner.make_plan makes
plans; runs.py cuts a layout's own boxes at the runs' bounds.
"""

from __future__ import annotations

import bisect
import functools
import hashlib
import itertools
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from .. import gcpause
from ..format import dtypes
from .boxes import key_of, kind_of
from .runs import layout_pieces, run_pieces
from .table import Box, BoxTable

# Boxes larger than this are cut into row ranges (unless the caller says
# otherwise): big enough that a piece is written at full speed, small enough
# that a handful of huge tensors still balances over many writers.
DEFAULT_MIN_PIECE_BYTES = 4 << 20


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


def described(items: Sequence[Item]) -> bytes:
    """A rank's items as it sends them to the coordinator: as a table
    (table.BoxTable, which the coordinator makes again of what it gets)."""
    return BoxTable.of(items).sent()


def layout_digest(items: Sequence[Item]) -> str:
    """Fingerprint of a rank's items. Each rank computes its own (in parallel),
    so that the planner groups ranks of one layout without comparing items,
    and a plan cache can tell an unchanged layout from a few bytes per rank."""
    h = hashlib.blake2b(digest_size=16)
    for i in items:
        h.update(repr((i.key, i.dtype, i.global_shape, i.offsets, i.shape)).encode())
    return h.hexdigest()


def keys_digest(items: Sequence[Item]) -> str:
    """Fingerprint of the keys a rank holds (not their boxes): with
    union=True, ranks with equal keys (a pipeline stage) have one tree."""
    return hashlib.blake2b("\n".join(map(key_of, items)).encode(), digest_size=16).hexdigest()


@dataclass(frozen=True)
class RankInfo:
    """What one rank tells the coordinator: where it runs and what it holds.
    `layout` is layout_digest(items); ranks with equal layouts hold the same
    boxes. A table carries the fingerprint of its tensors (table.py)."""

    rank: int
    node: str
    items: tuple[Box, ...] | BoxTable  # a table: what ranks send (described)
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


class Layout(NamedTuple):
    """One layout of a plan: its items, its members (the ranks that hold it,
    ascending), where each member's run of its own bytes ends (balance.bounds)
    and which of its items are shared with other layouts (a bitmap, bit n for
    item n: those are not its own; their pieces are chosen one by one)."""

    items: Sequence[Box]  # a table.BoxTable, from the planner
    members: tuple[int, ...]
    ends: tuple[int, ...]
    shared: bytes


@dataclass(frozen=True)
class Share:
    """A rank's part of a plan: what it needs, with its own items, to work out
    the pieces it writes (pieces()). Its own boxes are two numbers, a run
    (runs.py), so that what the coordinator sends a rank does not grow with
    the job: at 16,384 ranks the pieces of every rank were 300,000 objects to
    make and pickle on rank 0, while the others waited."""

    rank: int
    node: str
    start: int  # its run of its layout's own bytes: [start, end)
    end: int | None  # None: the last run, to the end
    shared: bytes  # its layout's Layout.shared
    target: int  # the plan's piece size
    chosen: tuple[Piece, ...]  # its pieces of shared boxes, in the keys' order

    def pieces(self, items: Sequence[Box]) -> list[Piece]:
        """Its pieces, given the items of its layout: in the keys' order, then by offsets."""
        own = own_items(items, self.shared)
        mine = run_pieces(own, sizes_of(own), self.start, self.end, self.target, self.rank,
                          make_piece)
        if not self.chosen:
            return mine
        order = dict(zip(map(key_of, items), itertools.count()))
        return _merged(mine, self.chosen, order)

    @staticmethod
    def of(sent: SentShare) -> Share:
        """The Share that Plan.shares sent as `sent`."""
        rank, node, start, end, shared, target, chosen = sent
        return Share(rank, node, start, end, shared, target, tuple(map(Piece._make, chosen)))


# A Share as it travels (Plan.shares, Share.of): its fields, its chosen
# pieces as plain tuples. Pickle writes a plain tuple in C, where a Share or
# a named tuple costs a Python call each: at 16,384 ranks rank 0 spent 0.13 s
# making a Share a rank and pickling it, while the others waited.
SentShare = tuple[int, str, int, "int | None", bytes, int, tuple[tuple[object, ...], ...]]


@dataclass(frozen=True)
class Plan:
    """The coordinator's plan: the layouts with their runs, and the pieces of
    shared boxes by writer; from those, every rank's share (shares) and, on
    demand, every piece (pieces)."""

    keys: tuple[str, ...]  # the job's tensors, in the ranks' order (union=True: the union)
    nodes: dict[int, str] = field(hash=False)
    layouts: dict[str, Layout] = field(hash=False)
    chosen: dict[int, tuple[Piece, ...]] = field(hash=False)  # pieces of shared boxes
    target: int = DEFAULT_MIN_PIECE_BYTES
    unique_bytes: int = 0
    # What is worked out from the plan alone, once (every piece, written.py's
    # globals): a plan is made once and used save after save (PlanCache).
    memo: dict[str, object] = field(default_factory=dict, hash=False, compare=False,
                                    repr=False)

    @gcpause.paused()  # as make_plan
    def shares(self) -> list[SentShare]:
        """Each rank's share as it is sent (Share.of reads it), in rank order:
        O(1) a rank, plus its chosen pieces."""
        chosen = {r: tuple(map(tuple, got)) for r, got in self.chosen.items()}
        nodes, target = self.nodes, self.target
        out: dict[int, SentShare] = {}
        for lay in self.layouts.values():
            for r, start, end in _runs(lay):
                out[r] = (r, nodes[r], start, end, lay.shared, target, chosen.get(r, ()))
        return [out[r] for r in sorted(out)]

    def share(self, rank: int) -> Share:
        for lay in self.layouts.values():
            if rank in lay.members:
                r, start, end = next(run for run in _runs(lay) if run[0] == rank)
                return Share(r, self.nodes[r], start, end, lay.shared, self.target,
                             self.chosen.get(r, ()))
        raise KeyError(rank)

    def for_rank(self, rank: int) -> list[Piece]:
        return [p for p in self.pieces if p.writer == rank]

    @property
    def pieces(self) -> tuple[Piece, ...]:
        """Every piece, by writer, each writer's as its Share.pieces gives
        them: the coordinator's view of the whole plan (checks, tests,
        benchmarks), worked out once. A save does not need it."""
        pieces = self.memo.get("pieces")
        if pieces is None:
            mine: dict[int, list[Piece]] = {}
            for lay in self.layouts.values():
                own = own_items(lay.items, lay.shared)
                # In the layout's order of keys, as Share.pieces (with
                # union=True, layouts may list their keys in different orders).
                order = dict(zip(map(key_of, lay.items), itertools.count()))
                for r, got in layout_pieces(own, sizes_of(own), lay.ends, lay.members,
                                            self.target, make_piece).items():
                    mine[r] = _merged(got, self.chosen.get(r, ()), order)
            pieces = self.memo["pieces"] = tuple(itertools.chain.from_iterable(
                mine[r] for r in sorted(mine)))
        assert isinstance(pieces, tuple)
        return pieces

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


def _runs(lay: Layout) -> Iterator[tuple[int, int, int | None]]:
    """Each member of lay with its run of the layout's own bytes, [start,
    end): from the end before it (0 for the first) to its own (None, to the
    end, for the last)."""
    return zip(lay.members, (0, *lay.ends[:-1]), (*lay.ends[:-1], None), strict=True)


# Piece._make's way, without its checks: plans make hundreds of thousands.
make_piece = functools.partial(tuple.__new__, Piece)


def own_items(items: Sequence[Box], shared: bytes) -> list[Box]:
    """The items whose bit is clear in `shared` (bitmap's)."""
    own = itertools.chain.from_iterable(map(_CLEAR_BITS.__getitem__, shared))
    return list(itertools.compress(items, own))


def bitmap(flags: Sequence[bool]) -> bytes:
    """Bit n set where flags[n]: a layout's shared items in 1/8 byte each."""
    padded = [*flags, *[False] * (-len(flags) % 8)]
    return bytes(map(_PACKED.__getitem__, zip(*[iter(padded)] * 8, strict=True)))


# own_items' and bitmap's tables, so that both run in C: per byte value,
# whether each of its bits (lowest first) is clear, and the other way round.
_CLEAR_BITS = [tuple(not b >> i & 1 for i in range(8)) for b in range(256)]
_PACKED = {tuple(bool(b >> i & 1) for i in range(8)): b for b in range(256)}


def _merged(mine: list[Piece], chosen: Sequence[Piece], order: dict[str, int]) -> list[Piece]:
    """A rank's pieces of its own boxes (in the keys' order) with its pieces
    of shared boxes put in between: a rank holds one box of a key, own or
    shared, so each goes after the keys before it."""
    for p in chosen:
        mine.insert(bisect.bisect_right(mine, order[p.key], key=lambda q: order[q.key]), p)
    return mine


def sizes_of(boxes: Sequence[Box]) -> list[int]:
    """Each box's bytes (Item.nbytes), worked out once per dtype and shape
    (a job has few shapes and many boxes), the rest in C: each rank does
    this for its layout's thousands of boxes at every plan."""
    kinds = list(map(kind_of, boxes))
    size = {(dtype, shape): math.prod(shape) * dtypes.itemsize(dtype)
            for dtype, shape in dict.fromkeys(kinds)}
    return list(map(size.__getitem__, kinds))



class PlanCache:
    """The last plan (the coordinator's) or share (another rank's) and the
    descriptions it was made for: an unchanged layout (the usual case, save
    after save) costs a digest comparison, not a plan."""

    def __init__(self) -> None:
        self.digests: tuple[str, ...] | None = None
        self.plan: Plan | Share | None = None

    def get(self, digests: Sequence[str]) -> Plan | Share | None:
        return self.plan if self.digests == tuple(digests) else None

    def put(self, digests: Sequence[str], plan: Plan | Share) -> None:
        self.digests, self.plan = tuple(digests), plan


__all__ = ["DEFAULT_MIN_PIECE_BYTES", "Box", "Item", "Layout", "Piece", "Plan", "PlanCache",
           "RankInfo", "SentShare", "Share", "bitmap", "described", "keys_digest", "layout_digest",
           "make_piece", "sizes_of"]
