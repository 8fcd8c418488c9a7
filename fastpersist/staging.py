"""Staging memory: where an asynchronous save keeps its snapshot.

Host buffers are page-aligned (so the engine can write them with O_DIRECT),
pinned when CUDA is available (so device-to-host copies run at full
bandwidth and asynchronously), allocated on first use and reused by every
later save, and bounded by a budget. A save that needs more than the budget
waits for buffers that earlier writes release: the trainer's stall grows, the
memory does not.
"""

from __future__ import annotations

import mmap
import threading
from collections.abc import Callable

import torch

from .errors import CheckpointError


def _allocate(nbytes: int, pinned: bool) -> torch.Tensor:
    if pinned:
        # cudaHostAlloc'd memory is page-aligned.
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    if nbytes == 0:
        return torch.empty(0, dtype=torch.uint8)
    # An anonymous mapping: page-aligned, and returned to the OS when freed.
    return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=torch.uint8, count=nbytes)


class StagingPool:
    """Reusable staging buffers, at most `budget` bytes in all (0: no limit).

    `allocate(nbytes, pinned)` makes a buffer and `free(buffer)` runs when the
    pool lets one go (daemon mode: shared-memory segments, unlinked on free).
    """

    def __init__(self, allocate: Callable[[int, bool], torch.Tensor] = _allocate,
                 free: Callable[[torch.Tensor], None] | None = None) -> None:
        self._allocate = allocate
        self._free_fn = free
        self._cond = threading.Condition()
        self._free: list[tuple[torch.Tensor, bool]] = []  # (buffer, pinned)
        self._allocated = 0  # bytes in all buffers, free or in use

    @property
    def allocated_bytes(self) -> int:
        return self._allocated

    def acquire(self, nbytes: int, budget: int, pinned: bool,
                timeout: float | None = None) -> torch.Tensor:
        """A buffer of at least `nbytes`, waiting for releases if the budget is full."""
        if budget and nbytes > budget:
            raise CheckpointError(
                f"a staging buffer of {nbytes} bytes does not fit the staging budget of "
                f"{budget} bytes"
            )
        with self._cond:
            while True:
                # The budget may have shrunk since the free buffers were made.
                while budget and self._free and self._allocated > budget:
                    self._drop(max(self._free, key=lambda e: e[0].numel()))
                fits = [e for e in self._free if e[0].numel() >= nbytes and e[1] == pinned]
                if fits:
                    entry = min(fits, key=lambda e: e[0].numel())
                    # By identity: list.remove would compare tensors with ==.
                    self._free = [e for e in self._free if e is not entry]
                    return entry[0]
                # Free buffers that are too small (or of the wrong kind) make room;
                # with no budget they go too, so staging grows instead of piling up.
                while self._free and (not budget or self._allocated + nbytes > budget):
                    self._drop(self._free[0])
                if not budget or self._allocated + nbytes <= budget:
                    break
                if not self._cond.wait(timeout):
                    raise CheckpointError(f"timed out waiting for {nbytes} bytes of staging memory")
            self._allocated += nbytes
        try:
            return self._allocate(nbytes, pinned)
        except BaseException:
            with self._cond:
                self._allocated -= nbytes
                self._cond.notify_all()
            raise

    def _drop(self, entry: tuple[torch.Tensor, bool]) -> None:
        self._free = [e for e in self._free if e is not entry]
        self._allocated -= entry[0].numel()
        if self._free_fn is not None:
            self._free_fn(entry[0])

    def release(self, buf: torch.Tensor, pinned: bool) -> None:
        with self._cond:
            self._free.append((buf, pinned))
            self._cond.notify_all()

    def clear(self) -> None:
        """Drop the free buffers (the memory goes back to the OS)."""
        with self._cond:
            for entry in list(self._free):
                self._drop(entry)
