"""Memory: tensor bytes as the engine's segments, and pausing the garbage collector.

bytes_of goes through numpy (a few microseconds a tensor): the same zero-copy
view as fastpersist.tensors.plan.memory_of, but one that keeps the tensor alive.
(memory_of once built a ctypes array type per size, ~0.1 ms a tensor; it no
longer does.)

Building or parsing the JSON of a checkpoint with thousands of items makes
hundreds of thousands of small objects and no cycles; the collector's passes
over them were half the time of read_metadata (no_gc).
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator
from typing import Any

import torch


def bytes_of(t: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous CPU tensor's memory (kept alive by the view)."""
    assert t.device.type == "cpu" and t.is_contiguous()
    array: Any = t.detach().reshape(-1).view(torch.uint8).numpy()
    return memoryview(array).cast("B")


@contextlib.contextmanager
def no_gc() -> Iterator[None]:
    """The cyclic garbage collector paused (process-wide) for the block."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
