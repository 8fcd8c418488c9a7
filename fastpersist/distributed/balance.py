"""Who of a box's holders writes it, so that every node and every rank ends
with its share of the job's bytes (planner.py decides what the boxes are).

Two ways, for the two kinds of box a job has:

- Chooser.pick, for a box several layouts hold (replicated across them: a
  norm over TP ranks, a scalar every rank has): each piece, largest first, to
  the least-filled holder. A choice per piece, but such boxes are few.
- bounds, for a layout's own boxes (most of the job's bytes: what only that
  layout's data-parallel replicas hold): the layout's boxes in its order,
  cut into one consecutive run per member (runs.py), each run sized to bring
  the members' loads level. Choosing per piece there was most of a plan's
  time at thousands of ranks (about 2 us a piece, with the sort before it, at
  a million pieces); a run is two numbers, which is all the coordinator sends
  a member of its own boxes, and it keeps a writer's pieces of a tensor
  together.

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


def bounds(chooser: Chooser, ranks: list[int], total: int) -> list[int]:
    """Where each of `ranks`' runs of a layout's own bytes (`total` of them,
    which only those ranks hold) ends, so that their loads end level: rank
    j's run is [ends[j-1], ends[j]) (runs.py cuts the boxes there). The
    last run ends at `total`."""
    ends, running = [], 0.0
    for share in chooser.levels(ranks, total):
        running += share
        ends.append(min(math.floor(running), total))
    ends[-1] = total
    return ends


__all__ = ["Chooser", "bounds"]
