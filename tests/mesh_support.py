"""Simulated TP x FSDP meshes for the planner's tests (imported as
`mesh_support`, as support.py): each rank's boxes of a list of tensors."""

from __future__ import annotations

import dataclasses
import math
import pickle
import random

from fastpersist.distributed.plan import Item, RankInfo, described, layout_digest
from fastpersist.distributed.table import BoxTable

# A tensor of a simulated state: key, dtype, global shape, and whether it is
# replicated over TP (a norm) rather than cut by it.
Tensor = tuple[str, str, tuple[int, ...], bool]


def chunk(n: int, parts: int, i: int) -> tuple[int, int]:
    """torch.chunk's part i of n rows: (start, length); the last may be short or empty."""
    size = math.ceil(n / parts)
    start = min(i * size, n)
    return start, max(0, min(n, start + size) - start)


def mesh_items(tensors: list[Tensor], tp: int, fsdp: int, t: int, f: int,
               damage: random.Random | None = None) -> tuple[Item, ...]:
    """The boxes of TP rank t and FSDP rank f: TP cuts dim 1 (unless the
    tensor is replicated), then FSDP dim 0; a scalar is whole everywhere.
    `damage`: moves about one box in 20 a row up or down (a gap, an overlap
    or a box outside its tensor)."""
    out = []
    for key, dtype, shape, replicated in tensors:
        if not shape:
            out.append(Item.whole(key, dtype, shape))
            continue
        offsets, sizes = [0, 0], list(shape)
        if not replicated:
            offsets[1], sizes[1] = chunk(shape[1], tp, t)
        offsets[0], sizes[0] = chunk(shape[0], fsdp, f)
        if damage is not None and damage.random() < 0.05:
            offsets[0] += damage.choice([-1, 1])
        out.append(Item(key, dtype, shape, tuple(offsets), tuple(sizes)))
    return tuple(out)


def as_sent(ranks: list[RankInfo]) -> list[RankInfo]:
    """The ranks' descriptions as rank 0 gets them: described, pickled,
    unpickled and read as tables, as the coordinator does."""
    sent = [pickle.loads(pickle.dumps(described(r.items))) for r in ranks]  # as torch's
    return [dataclasses.replace(r, items=BoxTable.received(s, r.rank))
            for r, s in zip(ranks, sent, strict=True)]


def ranks_of(items_per_rank: list[tuple[Item, ...]], per_node: int) -> list[RankInfo]:
    """Ranks that hold these items, per_node to a node."""
    return [RankInfo(r, f"node{r // per_node}", items, layout_digest(items))
            for r, items in enumerate(items_per_rank)]
