"""Tensor memory as the engine's segments.

fastpersist.plan.memory_of builds a ctypes array type per size (about 0.1 ms
a tensor); DCP states have thousands of small tensors, so this goes through
numpy instead (a few microseconds): the same zero-copy view of the bytes.
"""

from __future__ import annotations

from typing import Any

import torch


def bytes_of(t: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous CPU tensor's memory (kept alive by the view)."""
    assert t.device.type == "cpu" and t.is_contiguous()
    array: Any = t.detach().reshape(-1).view(torch.uint8).numpy()
    return memoryview(array).cast("B")
