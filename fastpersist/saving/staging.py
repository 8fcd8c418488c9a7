"""Staging memory: where an asynchronous save keeps its snapshot.

Host buffers are page-aligned (so the engine can write them with O_DIRECT),
pinned when CUDA is available (so device-to-host copies run at full
bandwidth and asynchronously), allocated on first use and reused by every
later save, and bounded by a budget. A save that needs more than the budget
waits for buffers that earlier writes release: the trainer's stall grows, the
memory does not.

The rule for every buffer (DESIGN.md): it goes back to the pool only when
every reader and writer of it is known to be finished. Its writers are the
device-to-host copies into it; its readers are the engine, and fastpersistd
when the buffer is a shared-memory segment lent to it. When that is not known
(a failed copy, a broken progress stream, a lost reply), the buffer is
quarantined: it leaves the pool and is never handed out again. The pool
enforces the rule itself, so that no call site has to remember it: a buffer
comes back only through give_back(staged), which waits for the copies into it
and reads what the staged file recorded about its loan (StagedFile.lend before
the daemon may read it, StagedFile.returned once the daemon said it is done).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Protocol

import torch

from ..anonmem import anonymous
from ..errors import CheckpointError


def _allocate(nbytes: int, pinned: bool) -> torch.Tensor:
    if pinned:
        # cudaHostAlloc'd memory is page-aligned.
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    if nbytes == 0:
        return torch.empty(0, dtype=torch.uint8)
    # Private anonymous memory (anonmem): page-aligned, returned to the OS when
    # freed. Its pages come in as the first snapshot's copy touches them, on
    # every thread of the copy (MAP_POPULATE, on this one thread, made a first
    # save of 1.08 GB 1.6x slower on two cores).
    return torch.frombuffer(anonymous(nbytes), dtype=torch.uint8, count=nbytes)


class Staged(Protocol):
    """A buffer's users, as the pool needs to know them (snapshot.StagedFile)."""

    @property
    def pinned(self) -> bool: ...

    def wait_copied(self) -> None:
        """Until every device copy into the buffer has finished (raises if one failed)."""

    def readers_done(self) -> bool:
        """Whether no reader outside this process may still read the buffer."""

    def claim_buffer(self) -> torch.Tensor | None:
        """The buffer, to give it back; None if it was given back already (it
        may have been handed out again since) or there is none."""


class _Unused:
    """A buffer taken and never used: no copy into it, no reader of it."""

    def __init__(self, buffer: torch.Tensor, pinned: bool) -> None:
        self._buffer: torch.Tensor | None = buffer
        self.pinned = pinned

    def wait_copied(self) -> None:
        pass

    def readers_done(self) -> bool:
        return True

    def claim_buffer(self) -> torch.Tensor | None:
        buffer, self._buffer = self._buffer, None
        return buffer


class StagingPool:
    """Reusable staging buffers, at most `budget` bytes in all (0: no limit).

    `allocate(nbytes, pinned)` makes a buffer and `free(buffer)` runs when the
    pool lets one go (daemon mode: shared-memory segments, unlinked on free).
    `let_go(buffer)` runs for a quarantined buffer that only a reader in another
    process may still use (daemon mode: unlink and unmap the segment; the
    daemon's own mapping keeps the pages until it is done). Without it, and for
    a buffer a device copy may still write into, a quarantined buffer is kept,
    never reused, for the life of the pool (quarantined_bytes).
    """

    def __init__(self, allocate: Callable[[int, bool], torch.Tensor] = _allocate,
                 free: Callable[[torch.Tensor], None] | None = None,
                 let_go: Callable[[torch.Tensor], None] | None = None) -> None:
        self._allocate = allocate
        self._free_fn = free
        self._let_go = let_go
        self._cond = threading.Condition()
        self._free: list[tuple[torch.Tensor, bool]] = []  # (buffer, pinned)
        self._allocated = 0  # bytes in all buffers, free or in use (not quarantined)
        self._kept: list[torch.Tensor] = []  # quarantined, still mapped here
        self.quarantined = 0  # buffers quarantined so far
        self.allocations = 0  # buffers allocated so far (a warm pool allocates none)

    @property
    def allocated_bytes(self) -> int:
        """Bytes of the buffers the pool may still hand out, free or in use."""
        return self._allocated

    @property
    def quarantined_bytes(self) -> int:
        """Bytes of quarantined buffers this process still holds (never reused)."""
        with self._cond:
            return sum(b.numel() for b in self._kept)
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
            self.allocations += 1
        try:
            return self._allocate(nbytes, pinned)
        except BaseException:
            with self._cond:
                self._allocated -= nbytes
                self._cond.notify_all()
            raise

    def acquire_all(self, sizes: list[int], budget: int, pinned: bool) -> list[torch.Tensor]:
        """A buffer for each size, in order, all taken before any is used: the
        buffers one snapshot takes then do not depend on how soon the writer of
        the previous files gives theirs back, so the pool holds a buffer per file
        after the first save, and a second save of the same state takes exactly
        those (no allocation, no page faults). The sizes must fit the budget
        together. On failure the buffers already taken go back."""
        taken: list[torch.Tensor] = []
        try:
            for nbytes in sizes:
                taken.append(self.acquire(nbytes, budget, pinned))
        except BaseException:
            self.give_back_unused(taken, pinned)
            raise
        return taken

    def give_back_unused(self, buffers: list[torch.Tensor], pinned: bool) -> None:
        """Buffers from acquire_all that no copy wrote and no reader saw."""
        for buffer in buffers:
            self.give_back(_Unused(buffer, pinned))

    def _drop(self, entry: tuple[torch.Tensor, bool]) -> None:
        self._free = [e for e in self._free if e is not entry]
        self._allocated -= entry[0].numel()
        if self._free_fn is not None:
            self._free_fn(entry[0])

    def give_back(self, staged: Staged) -> None:
        """The one way a buffer comes back from a save: to the free list once
        the copies into it finished and no outside reader may still read it;
        quarantined otherwise. A second give_back of the same staged file does
        nothing. Blocks while a device copy into the buffer is running."""
        buffer = staged.claim_buffer()
        if buffer is None:
            return
        try:
            staged.wait_copied()
        except Exception:
            # A failed device copy: whether the DMA engine is done with the
            # memory is unknown, so it is neither reused nor unmapped.
            self._quarantine(buffer, keep=True)
            return
        if not staged.readers_done():
            self._quarantine(buffer, keep=self._let_go is None)
            return
        with self._cond:
            self._free.append((buffer, staged.pinned))
            self._cond.notify_all()

    def discard(self, buffer: torch.Tensor, pinned: bool) -> None:
        """A buffer from acquire whose copy failed part-way (no reader saw it):
        out of the budget, which it would otherwise shrink for good. A copy
        from host memory has ended when it fails, so the buffer is freed; a
        device copy may still land in a pinned one, which is kept instead."""
        if pinned:
            self._quarantine(buffer, keep=True)
            return
        with self._cond:
            self._drop((buffer, pinned))
            self._cond.notify_all()

    def _quarantine(self, buffer: torch.Tensor, keep: bool) -> None:
        with self._cond:
            # Out of the budget: it is nobody's to reuse, and counting it would
            # shrink the budget for good.
            self._allocated -= buffer.numel()
            self.quarantined += 1
            if keep:
                self._kept.append(buffer)
            self._cond.notify_all()
        if not keep:
            assert self._let_go is not None
            self._let_go(buffer)

    def clear(self) -> None:
        """Drop the free buffers (the memory goes back to the OS). Buffers in
        use and quarantined ones stay."""
        with self._cond:
            for entry in list(self._free):
                self._drop(entry)

    def prepare(self, sizes: list[int], budget: int, pinned: bool) -> int:
        """Take and fault in buffers for files of `sizes` (pipeline.prepare_staging),
        then put them back free; the bytes made ready. Over the budget, as many
        of the largest size as it holds: acquire() then gives each file the
        smallest free buffer it fits, and those fit every file."""
        if budget and sum(sizes) > budget:
            largest = max(sizes)
            sizes = [largest] * min(len(sizes), budget // largest)
        buffers = self.acquire_all(sizes, budget, pinned)
        try:
            if not pinned:  # cudaHostAlloc'd and registered memory is resident already
                for buffer in buffers:
                    buffer.fill_(0)  # first touch, on torch's threads as a copy would
        finally:
            self.give_back_unused(buffers, pinned)
        return sum(b.numel() for b in buffers)
