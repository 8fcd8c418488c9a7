"""Memory: tensor bytes as the engine's segments, and pausing the garbage collector.

bytes_of goes through numpy (a few microseconds a tensor): the same zero-copy
view as fastpersist's memory_of, but one that keeps the tensor alive (the
stager's aliases outlive the call that makes them).

Building or parsing the JSON of a checkpoint with thousands of items makes
hundreds of thousands of small objects and no cycles; the collector's passes
over them were half the time of read_metadata. no_gc is fastpersist's pause
(gcpause.paused), which nests with the saves and loads of other threads.
"""

from __future__ import annotations

from typing import Any

import torch

from ...adapters import gc_paused as no_gc


def bytes_of(t: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous CPU tensor's memory (kept alive by the view)."""
    assert t.device.type == "cpu" and t.is_contiguous()
    array: Any = t.detach().reshape(-1).view(torch.uint8).numpy()
    return memoryview(array).cast("B")


__all__ = ["bytes_of", "no_gc"]
