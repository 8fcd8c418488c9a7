"""Who of a box's holders writes it, so that every node and every rank ends
with its share of the job's bytes (planner.py decides what the boxes are).

Two ways, for the two kinds of box a job has:

- Chooser.pick, for a box several layouts hold (replicated across them: a
  norm over TP ranks, a scalar every rank has): each piece, largest first, to
  the least-filled holder. A choice per piece, but such boxes are few.
- fill, for a layout's own boxes (most of the job's bytes: what only that
  layout's data-parallel replicas hold): the layout's boxes in its order,
  cut into one consecutive run per member, each run sized to bring the
  members' loads level. Choosing per piece there was most of a plan's time at
  thousands of ranks (about 2 us a piece, with the sort before it, at a
  million pieces), and the runs keep each writer's pieces of a tensor together.

Loads are weighted by the ranks on a rank's node, so that every node (one set
of drives) is filled alike however many ranks it has, and the ranks of one
node alike. Weighing ranks and nodes in one key matters: choosing the least-
loaded node first and a rank there second balanced nodes but left the ranks of
an HSDP job (a box's holders one per node) up to 2x apart.
"""

from __future__ import annotations

import heapq
import math
from collections import Counter
from collections.abc import Callable
from typing import Any

# A box: planner.Item (key, dtype, global_shape, offsets, shape), typed loosely
# here so that this module does not import the planner that imports it.
Box = Any


class Chooser:
    """Every rank's weighted load, and the least-filled of a box's holders.

    A key changes only when its own rank is chosen, so each holder set keeps
    a lazy min-heap whose stale entries (the rank was chosen for another set)
    are refreshed when they surface. Ties go to the lower rank: deterministic."""

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

    def levels(self, ranks: list[int], nbytes: int) -> list[float]:
        """How many of `nbytes` each of `ranks` takes so that their weighted
        loads end as level as they can (water filling: the least filled are
        topped up first; one already above the level takes nothing)."""
        by_load = sorted(ranks, key=lambda r: (self.load[r], r))
        inverse = loaded = 0.0  # sums of 1/weight and load/weight of the ranks below the level
        level = 0.0
        for n, r in enumerate(by_load):
            w = self.weight[r]
            inverse += 1 / w
            loaded += self.load[r] / w
            level = (nbytes + loaded) / inverse
            if n + 1 == len(by_load) or level <= self.load[by_load[n + 1]]:
                break
        return [max(0.0, (level - self.load[r]) / self.weight[r]) for r in ranks]


def fill(own: list[Box], sizes: list[int], ranks: list[int], chooser: Chooser, target: int,
         mine: dict[int, list[Box]], piece: Callable[[tuple[Any, ...]], Box]) -> None:
    """Give `own` (one layout's boxes, of `sizes` bytes, which only `ranks`
    hold) to those ranks: consecutive runs, rows cut where a run ends (a box
    of one row, or of at most target/16 bytes, goes whole to the run it
    mostly falls in), and runs over `target` bytes cut into pieces of about
    `target`, as the chosen pieces are, so that no piece is larger than a
    plan's pieces have been. Adds each rank's pieces, piece((*box, rank)), to
    mine[rank] in the layout's order, and their bytes to the rank's load."""
    smallest_cut = target // 16  # a box up to this goes whole: a run is off by at most that
    total = sum(sizes)
    ends = [math.floor(e) for e in _running(chooser.levels(ranks, total))]
    ends[-1] = total
    got = [0] * len(ranks)
    j, last = 0, len(ranks) - 1
    run_end, rank, out = ends[0], ranks[0], mine[ranks[0]]  # run j's
    position = 0  # the bytes of `own` given to ranks so far
    for box, size in zip(own, sizes, strict=True):
        box_end = position + size
        if box_end <= run_end or j == last:  # the usual case: all of it in this run
            if size <= target or not box.shape:
                out.append(piece((*box, rank)))
            else:
                out += _pieces(box, size, 0, box.shape[0], target, rank, piece)
            got[j] += size
            position = box_end
            continue
        rows = box.shape[0] if box.shape else 1
        row_bytes = size // rows if rows else 0
        start_row = 0
        while start_row < rows:
            while j < last and ends[j] <= position:
                j += 1
            if j == last or box_end <= ends[j]:
                count = rows - start_row
            elif rows <= 1 or size <= smallest_cut:
                # Unsplittable: here if most of it is, else to the next run.
                if ends[j] - position < size / 2:
                    j += 1
                    continue
                count = rows
            else:
                count = min(rows - start_row, round((ends[j] - position) / row_bytes))
                if count == 0:
                    j += 1
                    continue
            taken = size if count == rows else count * row_bytes
            mine[ranks[j]] += _pieces(box, taken, start_row, count, target, ranks[j], piece)
            got[j] += taken
            position += taken
            start_row += count
            if start_row < rows:
                j += 1  # this run is full
        position = box_end
        run_end, rank, out = ends[j], ranks[j], mine[ranks[j]]
    for r, n in zip(ranks, got, strict=True):
        chooser.load[r] += n * chooser.weight[r]


def _running(xs: list[float]) -> list[float]:
    out, total = [], 0.0
    for x in xs:
        total += x
        out.append(total)
    return out


def _pieces(box: Box, nbytes: int, start: int, rows: int, target: int, rank: int,
            piece: Callable[[tuple[Any, ...]], Box]) -> list[Box]:
    """Rows start..start+rows of `box` (nbytes of it) as rank's pieces of
    about `target` bytes each."""
    n = 1 if nbytes <= target or rows <= 1 else min(rows, math.ceil(nbytes / target))
    if n == 1 and (not box.shape or (start == 0 and rows == box.shape[0])):
        return [piece((*box, rank))]
    key, dtype, global_shape, offsets, shape = box
    first, other_offsets, other_sizes = offsets[0], offsets[1:], shape[1:]
    each, extra = divmod(rows, n)
    out = []
    for i in range(n):
        count = each + (i < extra)
        out.append(piece((key, dtype, global_shape, (first + start, *other_offsets),
                          (count, *other_sizes), rank)))
        start += count
    return out


__all__ = ["Chooser", "fill"]
