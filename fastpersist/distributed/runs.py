"""A layout's own boxes cut into one consecutive run per member: which rows of
which boxes a member writes, given only where its run starts and ends.

The coordinator decides each member's run as a byte range of the layout's own
boxes, in the layout's order (balance.bounds: sized to level the members'
loads); the member works out its pieces from its own items and that range.
The rule is stateless so that a member needs nothing of the other runs: a row
(a box's first-dimension slice) belongs to the run its middle byte falls in,
and a box that is not cut (one row, a scalar, or at most target/16 bytes: a
run is then off by at most that) belongs, whole, to the run its middle byte
falls in. Every row is in exactly one run, since the runs partition the bytes
(the last run reaches to infinity, so that a box of no bytes at the very end
still has a writer). A member's rows of a box over `target` bytes are cut
into pieces of about `target`, as a plan's chosen pieces are.

run_pieces (a member, at every save that makes a plan) and layout_pieces (the
coordinator's expansion of the whole plan, for checks and tests) share
rows_in, so both give the same pieces.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Sequence
from typing import Any

from .boxes import SHAPE

# A box: planner.Item or a plain tuple of its fields (plan.Box), read by
# position (boxes.py); typed loosely here so that this module does not
# import the planner that imports it.
Box = Any
MakePiece = Callable[[tuple[Any, ...]], Box]


def rows_in(box: Box, size: int, at: int, start: int, end: int | None, target: int
            ) -> tuple[int, int] | None:
    """The rows lo..hi of `box` (`size` bytes, its first byte at position
    `at` of the layout's own bytes) whose middle falls in [start, end), or
    None; end None: no end. An uncut box is all of it (a box of no rows
    included: it has a writer too) or None."""
    shape = box[SHAPE]
    rows = shape[0] if shape else 1
    if rows <= 1 or size <= target // 16:
        middle2 = 2 * at + size  # twice the middle: integers only
        inside = 2 * start <= middle2 and (end is None or middle2 < 2 * end)
        return (0, rows) if inside else None
    row = size // rows
    lo = _before(start, at, row, rows)
    hi = rows if end is None else _before(end, at, row, rows)
    return (lo, hi) if hi > lo else None


def _before(x: int, at: int, row: int, rows: int) -> int:
    """How many of the rows (`row` bytes each, from `at`) have their middle
    before x: rows i with 2(at + i*row) + row < 2x."""
    n = -((2 * at + row - 2 * x) // (2 * row))  # ceil((2x - 2at - row) / 2row)
    return min(max(n, 0), rows)


def run_pieces(own: Sequence[Box], sizes: Sequence[int], start: int, end: int | None,
               target: int, rank: int, piece: MakePiece) -> list[Box]:
    """The pieces of the run [start, end) of `own` (a layout's own boxes, in
    its order, of `sizes` bytes), as piece((*box, rank)), in that order."""
    out: list[Box] = []
    at = 0
    for box, size in zip(own, sizes, strict=True):
        if end is not None and at > end:
            break  # this box and those after it have their middles past the run
        if at + size >= start:
            rows = rows_in(box, size, at, start, end, target)
            if rows is not None:
                out += _pieces(box, size, rows, target, rank, piece)
        at += size
    return out


def layout_pieces(own: Sequence[Box], sizes: Sequence[int], ends: Sequence[int],
                  members: Sequence[int], target: int, piece: MakePiece
                  ) -> dict[int, list[Box]]:
    """Every member's run_pieces at once: member j's run is [ends[j-1], ends[j])
    (the first from 0, the last without an end), walked box by box."""
    out: dict[int, list[Box]] = {r: [] for r in members}
    starts = [0, *ends[:-1]]
    last = len(members) - 1
    at = 0
    for box, size in zip(own, sizes, strict=True):
        # From the run that holds the box's first byte to the last that
        # starts within it (runs of no bytes on the way included).
        j = min(bisect.bisect_right(ends, at), last)
        while j <= last and starts[j] <= at + size:
            rows = rows_in(box, size, at, starts[j], None if j == last else ends[j], target)
            if rows is not None:
                out[members[j]] += _pieces(box, size, rows, target, members[j], piece)
            j += 1
        at += size
    return out


def _pieces(box: Box, size: int, rows: tuple[int, int], target: int, rank: int,
            piece: MakePiece) -> list[Box]:
    """Rows lo..hi of `box` (`size` bytes whole) as rank's pieces of about
    `target` bytes each: the box itself where that is all of it."""
    lo, hi = rows
    shape = box[SHAPE]
    whole = not shape or (lo == 0 and hi == shape[0])
    nbytes = size if whole else size // shape[0] * (hi - lo)
    n = 1 if nbytes <= target or hi - lo <= 1 else min(hi - lo, math.ceil(nbytes / target))
    if n == 1 and whole:
        return [piece((*box, rank))]
    return list(map(piece, split_rows(box, lo, hi, n, (rank,))))


def split_rows(box: Box, lo: int, hi: int, n: int, tail: tuple[Any, ...] = ()
               ) -> list[tuple[Any, ...]]:
    """Rows lo..hi of `box` in n consecutive ranges as near equal as rows
    allow (the first ones a row longer), each as the box's fields with its
    offsets and shape, then `tail`: the one way a box is cut into pieces,
    here and for the planner's shared boxes."""
    key, dtype, global_shape, offsets, shape = box
    first, other_offsets, other_sizes = offsets[0], offsets[1:], shape[1:]
    each, extra = divmod(hi - lo, n)
    out = []
    start = lo
    for i in range(n):
        count = each + (i < extra)
        out.append((key, dtype, global_shape, (first + start, *other_offsets),
                    (count, *other_sizes), *tail))
        start += count
    return out


__all__ = ["layout_pieces", "rows_in", "run_pieces", "split_rows"]
