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

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from itertools import accumulate
from typing import Any

import torch

from ..format import dtypes
from ..tensors.datafile import file_order
from ..tensors.plan import StoredTensor, memory_of

_Gather = Callable[[Any, Sequence[int], Sequence[int], Sequence[int], int], None]
gather: _Gather | None
try:
    from .._engine import gather
except ImportError:  # no C extension: torch copies every tensor
    gather = None


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


def needs_pinned(tensors: Iterable[StoredTensor]) -> bool:
    """Whether a snapshot of `tensors` stages into pinned host memory: only
    where there is something to copy from a GPU (cudaHostAlloc costs more
    than plain memory and stays resident). The one rule for every save."""
    return torch.cuda.is_available() and any(t.source.is_cuda for t in tensors)


_side_streams: dict[torch.device, torch.cuda.Stream] = {}


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    if device not in _side_streams:
        _side_streams[device] = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
    return _side_streams[device]


@dataclass
class StagedFile:
    """One data file's tensors, copied (or being copied) into `buffer`.

    `tensors` are the file's tensors as the writer must write them: views of
    the buffer, in the caller's order, made when first asked for (on the
    writer's thread, not in the caller's stall); without a buffer (unstaged),
    the live tensors themselves. `entries` are the tensors given to stage_file:
    once staged, their sources are the caller's live tensors, which the writer
    must never read (they change as training goes on); their names, dtypes,
    shapes and sizes are the snapshot's, for whoever needs only those (a
    daemon, which reads the buffer whole).

    The buffer goes back to its pool only through StagingPool.give_back, which
    reads the loan recorded here: lend() before a reader in another process
    (fastpersistd) may see the buffer, returned() once that reader said it is
    done with it. A buffer lent and never returned is quarantined.
    """

    entries: list[StoredTensor]
    buffer: torch.Tensor | None  # None: unstaged, written from the live tensors
    pinned: bool = False  # the buffer's kind, for returning it to the pool
    events: list[torch.cuda.Event] = field(default_factory=list)
    # Where stage_file put the entries: file_order(entries) and each one's start
    # in the buffer (starts[i] for order[i]), with the data's end last.
    order: list[StoredTensor] = field(default_factory=list)
    starts: list[int] = field(default_factory=list)
    _views: list[StoredTensor] | None = field(default=None, init=False, repr=False)
    _lent: bool = field(default=False, init=False, repr=False)
    _returned: bool = field(default=False, init=False, repr=False)
    _given_back: bool = field(default=False, init=False, repr=False)

    @property
    def tensors(self) -> list[StoredTensor]:
        if self.buffer is None:
            return self.entries
        if self._views is None:
            self._views = _views_in(self.buffer, self.entries, self.order, self.starts)
        return self._views

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
    """Copy `tensors` into `buffer` laid out as the file's data section
    (datafile.plan_file's order and offsets, relative to the data's start)."""
    order = file_order(tensors)
    starts = list(accumulate((t.nbytes for t in order), initial=0))
    if starts[-1] > buffer.numel():
        raise ValueError(f"{starts[-1]} bytes of tensors do not fit a {buffer.numel()}-byte "
                         "staging buffer")
    # Contiguous CPU tensors, small and large, are copied by one C call for the
    # whole file (_engine.gather) on as many threads as torch's intra-op pool
    # has (OMP_NUM_THREADS where set, so ranks sharing a node do not
    # oversubscribe it), instead of a view and a copy_ each: ~1.5 us of Python
    # a tensor saved (most of a snapshot of 100,000 small ones), and no OpenMP
    # region per tensor. A 1.08 GB state of 83 tensors: 0.84x the time of per-tensor
    # copy_ into preallocated buffers, 1.03x before (async_stall.py). Device
    # tensors and non-contiguous ones are copied by torch.
    addresses: list[int] = []  # what gather copies: from, to, how much
    offsets: list[int] = []
    lengths: list[int] = []
    others: list[tuple[StoredTensor, int]] = []  # (tensor, start): copied by torch
    for t, start, end in zip(order, starts[:-1], starts[1:], strict=True):
        source = t.source
        if gather is not None and source.is_cpu and source.is_contiguous():
            addresses.append(source.data_ptr())
            offsets.append(start)
            lengths.append(end - start)
        else:
            others.append((t, start))
    if addresses:
        assert gather is not None
        gather(memory_of(buffer), addresses, offsets, lengths, torch.get_num_threads())
    by_device: dict[torch.device, list[tuple[torch.Tensor, torch.Tensor]]] = {}
    for t, start in others:
        view = _view(buffer, t, start)
        by_device.setdefault(t.source.device, []).append((view, t.source))
    events = []
    for device, pairs in by_device.items():
        if device.type == "cuda":
            events.append(_copy_from_cuda(device, pairs))
        else:  # the CPU, and any other device: a plain synchronous copy
            for view, source in pairs:
                view.copy_(source)
    return StagedFile(tensors, buffer, pinned, events, order, starts)


def _view(buffer: torch.Tensor, t: StoredTensor, start: int) -> torch.Tensor:
    """t's bytes in the buffer (at `start`), as a tensor of t's dtype and shape."""
    dtype = dtypes.from_name(t.dtype)
    view = buffer[start : start + t.nbytes].view(dtype)
    return view if len(t.shape) == 1 else view.view(t.shape)


def _views_in(buffer: torch.Tensor, entries: list[StoredTensor], order: list[StoredTensor],
              starts: list[int]) -> list[StoredTensor]:
    """StagedFile.tensors: each entry as a view of its bytes in the buffer, in
    the entries' order."""
    # The buffer seen as each dtype, whole: a tensor's view is then one slice (and
    # a reshape unless it is 1-D), which matters for states of many small tensors.
    # File order puts larger elements first, so each start is a multiple of its size.
    typed: dict[str, torch.Tensor] = {}
    by_name: dict[str, StoredTensor] = {}
    for t, start, end in zip(order, starts[:-1], starts[1:], strict=True):
        whole = typed.get(t.dtype)
        if whole is None:
            size = dtypes.itemsize(t.dtype)
            whole = typed[t.dtype] = buffer[: buffer.numel() // size * size].view(
                dtypes.from_name(t.dtype))
        size = whole.element_size()
        view = whole[start // size : end // size]
        if len(t.shape) != 1:
            view = view.view(t.shape)
        by_name[t.name] = StoredTensor(t.name, t.dtype, t.shape, view, end - start)
    return [by_name[t.name] for t in entries]


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
