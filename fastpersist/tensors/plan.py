"""Which bytes to store: the state's tensors -> the tensors of a data file.

Tensors that share storage are stored once. Identical aliases (tied weights)
become one stored tensor that every alias refers to, and load gives back one
object. Different views of one storage (a slice and its base, say) become one
stored span of bytes that each view is rebuilt from, so sharing survives the
round trip as it does with torch.save. A lone non-contiguous tensor is stored
contiguous, and a small view of a big storage stores only its own bytes.
"""

from __future__ import annotations

import ctypes
from collections.abc import Iterable
from typing import Any, NamedTuple

import torch

from ..format import dtypes
from .state import TensorLeaf


class StoredTensor(NamedTuple):
    """One tensor of a data file: its header entry and the CPU memory to write.

    A NamedTuple, not a frozen dataclass: a save makes one or two per tensor,
    and a frozen dataclass's __init__ took 0.7 us (a NamedTuple's 0.25 us)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    source: torch.Tensor  # contiguous, exactly the bytes to store (CPU or a device)
    # source.nbytes, as a field: a save reads it several times a tensor (file
    # grouping, staging, writing), and a field is read 4x faster than a
    # property that asks the tensor.
    nbytes: int


# PyMemoryView_FromMemory(address, length, PyBUF_WRITE): a memoryview of raw
# memory for well under a microsecond. (A ctypes array type per length cost
# ~0.1 ms for each new length, and each type stayed in ctypes' cache.)
_memory_view = ctypes.pythonapi.PyMemoryView_FromMemory
_memory_view.argtypes = (ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int)
_memory_view.restype = ctypes.py_object
_PYBUF_WRITE = 0x200


def memory_of(t: torch.Tensor) -> memoryview:
    """A zero-copy, writable byte view of a contiguous CPU tensor's memory,
    for the engine.

    The caller keeps `t` alive while the view is in use.
    """
    assert t.is_cpu and t.is_contiguous()
    view: memoryview = _memory_view(t.data_ptr(), t.nbytes, _PYBUF_WRITE)
    return view


class _Names:
    def __init__(self) -> None:
        self.used: set[str] = set()

    def unique(self, name: str) -> str:
        if name not in self.used:
            self.used.add(name)
            return name
        candidate, n = name, 1
        while candidate in self.used:
            candidate, n = f"{name}~{n}", n + 1
        self.used.add(candidate)
        return candidate


def _view_key(t: torch.Tensor) -> tuple[Any, ...]:
    return (t.dtype, tuple(t.shape), t.stride(), t.storage_offset())


def _byte_extent(t: torch.Tensor) -> tuple[int, int]:
    start = int(t.storage_offset()) * t.element_size()
    if t.numel() == 0:
        return start, start
    last = sum((int(size) - 1) * stride for size, stride in zip(t.shape, t.stride(), strict=True))
    return start, start + (last + 1) * t.element_size()


def _contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.is_contiguous() else t.contiguous()


def _group_by_storage(leaves: Iterable[TensorLeaf]) -> list[list[TensorLeaf]]:
    groups: dict[Any, list[TensorLeaf]] = {}
    for leaf in leaves:
        storage = leaf.tensor.untyped_storage()
        if storage.nbytes() == 0:
            key: Any = ("empty", id(leaf))
        else:
            key = (leaf.tensor.device, storage.data_ptr())
        group = groups.get(key)
        if group is None:
            groups[key] = [leaf]
        else:
            group.append(leaf)
    return list(groups.values())


def plan_tensors(leaves: list[TensorLeaf]) -> list[StoredTensor]:
    """The tensors to store; fills each leaf's node with its entry (and view)."""
    names = _Names()
    used = names.used
    name_of = dtypes.names_by_dtype()  # (state.encode admits only storable dtypes)
    stored: list[StoredTensor] = []
    for group in _group_by_storage(leaves):
        index = len(stored)
        if len(group) == 1:  # the common case, inlined: a state may hold 100,000
            leaf = group[0]
            t = leaf.tensor
            name = leaf.path
            if name in used:
                name = names.unique(name)
            else:
                used.add(name)
            if not t.is_contiguous():
                t = t.contiguous()
            stored.append(StoredTensor(name, name_of[t.dtype], tuple(t.shape), t, t.nbytes))
            leaf.node["e"] = index
            continue
        if len({_view_key(leaf.tensor) for leaf in group}) == 1:
            t = group[0].tensor
            dtype = dtypes.to_name(t.dtype)
            assert dtype is not None  # state.encode admits only storable dtypes
            source = _contiguous(t)
            stored.append(StoredTensor(names.unique(group[0].path), dtype, tuple(t.shape),
                                       source, source.nbytes))
            for leaf in group:
                leaf.node["e"] = index
            continue
        extents = [_byte_extent(leaf.tensor) for leaf in group]
        # Start the span on a 16-byte boundary so every view's offset in it stays
        # a multiple of its element size.
        lo = min(start for start, _ in extents) // 16 * 16
        hi = max(end for _, end in extents)
        # Tensors made from one buffer separately (torch.from_numpy of an array
        # and of a slice of it) have storages of their own at one address: the
        # largest holds every extent (offsets count from that address).
        base = max((leaf.tensor for leaf in group), key=lambda t: t.untyped_storage().nbytes())
        span = torch.empty(0, dtype=torch.uint8, device=base.device)
        span.set_(base.untyped_storage(), lo, (hi - lo,), (1,))
        stored.append(StoredTensor(names.unique(group[0].path + ".__storage__"), "U8",
                                   (hi - lo,), _contiguous(span), hi - lo))
        for leaf, (start, _) in zip(group, extents, strict=True):
            t = leaf.tensor
            leaf.node["e"] = index
            leaf.node["view"] = {
                "dtype": dtypes.to_name(t.dtype),
                "shape": list(t.shape),
                "stride": list(t.stride()),
                "offset": start - lo,
            }
    return stored
