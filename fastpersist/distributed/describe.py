"""What one rank holds: its state's tensors as boxes of the job's global tensors."""

from __future__ import annotations

import hashlib
import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import UnsupportedValueError
from ..format import dtypes
from ..tensors.numpy_values import is_numpy
from ..tensors.plan import memory_of
from ..tensors.state import TensorLeaf, is_dtensor
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


# Plain tensors up to this size are compared between ranks (replica_values);
# larger ones are not: it would cost reading every rank's whole state.
SMALL_TENSOR_BYTES = 64 << 10
_PRIMITIVES = (int, float, bool, str, bytes, type(None), torch.dtype, torch.device)


def replica_values(obj: Any, path: str = "") -> list[tuple[str, str]]:
    """(path, fingerprint) of the values a job checkpoint keeps one copy of
    although every rank passes its own: non-tensor values (rank 0's are kept)
    and small plain CPU tensors (their writer's are kept). The ranks compare
    them to warn when they differ (e.g. per-rank RNG states or counters)."""
    out: list[tuple[str, str]] = []
    _collect(obj, path, out)
    return out


def _collect(obj: Any, path: str, out: list[tuple[str, str]]) -> None:
    if isinstance(obj, torch.Tensor):
        if (obj.device.type == "cpu" and not is_dtensor(obj)
                and obj.numel() * obj.element_size() <= SMALL_TENSOR_BYTES):
            data = obj.detach().contiguous()
            crc = zlib.crc32(memory_of(data)) if data.numel() else 0
            out.append((path, f"{data.dtype}{tuple(data.shape)}:{crc:08x}"))
    elif isinstance(obj, Mapping):
        for k, v in obj.items():
            _collect(v, f"{path}.{k}" if path else str(k), out)
    elif isinstance(obj, list | tuple):
        for i, v in enumerate(obj):
            _collect(v, f"{path}.{i}" if path else str(i), out)
    elif is_numpy(obj) and hasattr(obj, "dtype") and hasattr(obj, "tobytes"):
        # Stored as a tensor (fastpersist.tensors.state), so its writer's is kept as well.
        small = obj.nbytes <= SMALL_TENSOR_BYTES
        crc = zlib.crc32(obj.tobytes()) if small else 0
        out.append((path, f"numpy {obj.dtype}{tuple(obj.shape)}:{crc:08x}" if small
                    else f"numpy {obj.dtype}{tuple(obj.shape)}"))
    elif isinstance(obj, _PRIMITIVES):
        out.append((path, repr(obj)))


def values_digest(values: list[tuple[str, str]]) -> str:
    return hashlib.blake2b(repr(values).encode(), digest_size=16).hexdigest()


def differing_keys(per_rank: list[list[tuple[str, str]]]) -> list[str]:
    """Paths whose fingerprint is not the same on every rank (or not on all)."""
    dicts = [dict(values) for values in per_rank]
    keys: set[str] = set().union(*dicts)
    return sorted(k for k in keys if any(d.get(k) != dicts[0].get(k) for d in dicts[1:]))
