"""DCP's write items as fastpersist's stored tensors: grouped into data files,
and each one named and typed as its tensor record will be."""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.checkpoint.planner import WriteItem, WriteItemType

from ...adapters import StoredTensor, dtype_name
from ...errors import UnsupportedValueError
from .blocks import record_name


def _item_bytes(item: WriteItem) -> int:
    if item.tensor_data is not None:
        return item.tensor_storage_size() or 0
    return item.bytes_io_data.nbytes if item.bytes_io_data is not None else 0


def files_of(items: list[WriteItem], file_bytes: int) -> list[list[WriteItem]]:
    """Items grouped into files of about file_bytes (device tensors are copied
    to the host one file at a time)."""
    files: list[list[WriteItem]] = [[]]
    size = 0
    for item in items:
        n = _item_bytes(item)
        if files[-1] and size + n > file_bytes:
            files.append([])
            size = 0
        files[-1].append(item)
        size += n
    return [f for f in files if f]


def stored_item(item: WriteItem, data: Any, *, host: bool) -> StoredTensor:
    """The item (`data`: planner.resolve_data's) as a StoredTensor named by
    record_name: a bytes value's bytes (DCP's torch.save of it) as U8, or the
    tensor; with host=True, as a contiguous CPU tensor (zero-copy when it is
    one), else as it is (staging copies any device or layout by value)."""
    if item.type == WriteItemType.BYTE_IO:
        raw = bytearray(data.getbuffer())
        b = torch.frombuffer(raw, dtype=torch.uint8) if raw else torch.empty(0,
                                                                             dtype=torch.uint8)
        return StoredTensor(record_name(item.index.fqn, None), "U8", tuple(b.shape), b, b.nbytes)
    t: torch.Tensor = data.detach()
    if host:
        t = t.to("cpu").contiguous()
    dtype = dtype_name(t.dtype)
    if dtype is None:
        raise UnsupportedValueError(f"{item.index.fqn}: dtype {t.dtype} cannot be stored")
    return StoredTensor(record_name(item.index.fqn, item.index.offset or ()), dtype,
                        tuple(t.shape), t, t.numel() * t.element_size())
