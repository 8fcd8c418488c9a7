"""What one rank holds: its state's tensors as boxes of the job's global tensors."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import UnsupportedValueError
from ..format import dtypes
from ..state import TensorLeaf
from .planner import Item, Piece


@dataclass(frozen=True)
class Held:
    """One leaf: the box it is of its global tensor, and this rank's data for it."""

    item: Item
    local: torch.Tensor  # the box's data, shaped as item.shape


def describe(leaves: list[TensorLeaf]) -> list[Held]:
    """Plain tensors are whole boxes (replicated wherever the key recurs);
    DTensors are the box their placement gives this rank."""
    out = []
    for leaf in leaves:
        t = leaf.tensor
        dtype = dtypes.to_name(t.dtype)
        if dtype is None:
            raise UnsupportedValueError(
                f"{leaf.path}: a tensor of dtype {t.dtype} cannot be stored")
        if leaf.node.get("sharded"):
            offsets, shape, local = _dtensor_box(leaf.path, t)
            out.append(Held(Item(leaf.path, dtype, tuple(t.shape), offsets, shape), local))
        else:
            out.append(Held(Item.whole(leaf.path, dtype, tuple(t.shape)), t))
    return out


def _dtensor_box(path: str, t: torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...],
                                                      torch.Tensor]:
    from torch.distributed.tensor import DTensor, Partial
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    assert isinstance(t, DTensor)
    if any(isinstance(p, Partial) for p in t.placements):
        raise UnsupportedValueError(
            f"{path}: a DTensor with a Partial placement holds an unreduced sum; reduce it "
            "(redistribute to Replicate or Shard) before saving")
    shape, offsets = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    local = t.to_local()
    if tuple(local.shape) != tuple(shape):
        raise UnsupportedValueError(
            f"{path}: the DTensor's local shard is {list(local.shape)}, its placement says "
            f"{list(shape)} (uneven sharding this version cannot describe)")
    return tuple(int(o) for o in offsets), tuple(int(n) for n in shape), local


def piece_source(held: Held, piece: Piece) -> torch.Tensor:
    """This rank's data for `piece` (a row range of held's box), contiguous."""
    if not piece.shape:
        return held.local.contiguous()
    start = piece.offsets[0] - held.item.offsets[0]
    return held.local.narrow(0, start, piece.shape[0]).contiguous()
