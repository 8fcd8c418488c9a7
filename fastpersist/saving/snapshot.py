"""Snapshots: a consistent copy of the state's tensors in staging memory.

The stored tensors are cut into data files that each fit a staging buffer
(one file when the whole state fits the budget). Each file's tensors are
copied into a buffer laid out exactly as the file's data section, so the
engine then writes the buffer as it is. CPU tensors are copied in the
caller's thread; CUDA tensors are copied device-to-host on a side stream that
first waits for the work already queued on the compute stream (so the copy
sees the values as of the save call), and an event marks the copy's end: no
global synchronize.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..format import dtypes
from ..tensors.datafile import FileLayout, plan_file
from ..tensors.plan import StoredTensor


@dataclass(frozen=True)
class FilePlan:
    tensors: list[StoredTensor]
    staged: bool  # False: too large for a staging buffer, written from the tensor itself

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)


def group_into_files(stored: list[StoredTensor], budget: int, file_bytes: int) -> list[FilePlan]:
    """Data files for a save: at most `file_bytes` each. With a staging
    `budget` (0: no limit) that the snapshot exceeds, also at most half the
    budget, so that one file can be copied while the previous one is written. A
    tensor larger than the cap gets a file of its own; if it does not fit the
    budget's slot either, that file is unstaged: written straight from the
    tensor while the caller waits (the stall grows, memory does not). Files
    follow the order of `stored`.
    """
    total = sum(t.nbytes for t in stored)
    # The whole snapshot fits the budget at once: files need not share it.
    slot = (budget if total <= budget else budget // 2) if budget else 0
    cap = max(min(file_bytes, slot) if budget else file_bytes, 1)
    files: list[FilePlan] = []
    current: list[StoredTensor] = []
    size = 0
    for t in stored:
        if t.nbytes > cap:
            if current:
                files.append(FilePlan(current, staged=True))
                current, size = [], 0
            files.append(FilePlan([t], staged=not budget or t.nbytes <= slot))
            continue
        if current and size + t.nbytes > cap:
            files.append(FilePlan(current, staged=True))
            current, size = [], 0
        current.append(t)
        size += t.nbytes
    if current or not files:
        files.append(FilePlan(current, staged=True))
    return files


_side_streams: dict[torch.device, torch.cuda.Stream] = {}


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    if device not in _side_streams:
        _side_streams[device] = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
    return _side_streams[device]


@dataclass
class StagedFile:
    """One data file's tensors, copied (or being copied) into `buffer`.

    The buffer goes back to its pool only through StagingPool.give_back, which
    reads the loan recorded here: lend() before a reader in another process
    (fastpersistd) may see the buffer, returned() once that reader said it is
    done with it. A buffer lent and never returned is quarantined.
    """

    tensors: list[StoredTensor]  # sources point into buffer
    buffer: torch.Tensor | None  # None: unstaged, written from the live tensors
    pinned: bool = False  # the buffer's kind, for returning it to the pool
    events: list[torch.cuda.Event] = field(default_factory=list)
    layout: FileLayout | None = None  # as staged (its `order` holds the sources, not views)
    _lent: bool = field(default=False, init=False, repr=False)
    _returned: bool = field(default=False, init=False, repr=False)
    _given_back: bool = field(default=False, init=False, repr=False)

    def wait_copied(self) -> None:
        """Block until every device-to-host copy into the buffer has finished."""
        for event in self.events:
            event.synchronize()

    def lend(self) -> None:
        """Record that the buffer is about to be read by another process; call
        it before that process can learn the buffer's name."""
        self._lent = True

    def returned(self) -> None:
        """The process it was lent to said it finished reading the buffer
        (fastpersistd reported the file written, or the checkpoint committed)."""
        self._returned = True

    def readers_done(self) -> bool:
        return not self._lent or self._returned

    def claim_buffer(self) -> torch.Tensor | None:
        """The buffer, for StagingPool.give_back: once (None afterwards)."""
        if self._given_back:
            return None
        self._given_back = True
        return self.buffer


def stage_file(tensors: list[StoredTensor], buffer: torch.Tensor, pinned: bool) -> StagedFile:
    """Copy `tensors` into `buffer` at their offsets in the file's data section."""
    layout: FileLayout = plan_file(tensors)
    data_start = layout.layout.data_start
    by_device: dict[torch.device, list[tuple[torch.Tensor, torch.Tensor]]] = {}
    staged = []
    # The buffer seen as each dtype, whole: a tensor's view is then one slice (and
    # a reshape unless it is 1-D), which matters for states of many small tensors.
    # File order puts larger elements first, so each offset is a multiple of its size.
    typed: dict[str, torch.Tensor] = {}
    for t, offset in zip(layout.order, layout.layout.offsets, strict=True):
        whole = typed.get(t.dtype)
        if whole is None:
            size = dtypes.itemsize(t.dtype)
            whole = typed[t.dtype] = buffer[: buffer.numel() // size * size].view(
                dtypes.from_name(t.dtype))
        size = whole.element_size()
        start = (offset - data_start) // size
        view = whole[start : start + t.nbytes // size]
        if len(t.shape) != 1:
            view = view.view(t.shape)
        by_device.setdefault(t.source.device, []).append((view, t.source))
        staged.append(StoredTensor(t.name, t.dtype, t.shape, view))
    events = []
    for device, pairs in by_device.items():
        if device.type == "cpu":
            for view, source in pairs:
                view.copy_(source)
        elif device.type == "cuda":
            events.append(_copy_from_cuda(device, pairs))
        else:
            for view, source in pairs:  # other devices: a plain synchronous copy
                view.copy_(source)
    # The caller's order (not the file order) keeps manifest order stable.
    by_name = {s.name: s for s in staged}
    return StagedFile([by_name[t.name] for t in tensors], buffer, pinned, events, layout)


def _copy_from_cuda(device: torch.device, pairs: list[tuple[torch.Tensor, torch.Tensor]]
                    ) -> torch.cuda.Event:
    compute = torch.cuda.current_stream(device)
    side = _side_stream(device)
    # The copy must see every kernel queued so far on the compute stream.
    side.wait_stream(compute)
    with torch.cuda.stream(side):
        for view, source in pairs:
            view.copy_(source, non_blocking=True)
            # Keep the caching allocator from reusing the source's memory for
            # compute-stream work before the copy has read it.
            source.record_stream(side)
        event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        event.record(side)
    return event
