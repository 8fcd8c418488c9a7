"""DCP's AsyncStager on fastpersist's StagingPool: dcp.async_save snapshots
the state into reused host buffers instead of allocating a copy per save.

stage(state_dict) copies every tensor (a DTensor's local shard, a plain
tensor) into one buffer from the pool (page-aligned; pinned when a tensor is
on CUDA) and returns the same structure over views of it; other values are
deep-copied. The buffer returns to the pool when the save is done with it:
FastPersistWriter gives it back as soon as its files are written; a
FastPersistStager used with another writer gives it back when the last
staged tensor is garbage-collected (when DCP drops the staged state after
the save). The pool is shared by every stager of the process unless one is
given, and bounded by FASTPERSIST_STAGING_BUDGET (0: unbounded): a stage()
that does not fit waits for buffers that earlier saves give back.

With AsyncCheckpointerType.PROCESS, DCP pickles the staged state into its
save process (torch.multiprocessing moves the buffer into shared memory): a
buffer whose writer was pickled is dropped from the pool, never reused (see
FastPersistWriter.__getstate__), and the next save allocates a new one.
"""

from __future__ import annotations

import copy
import threading
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.tensor import DTensor  # imported by the line above already

from ...adapters import StagingPool, settings
from .memory import bytes_of

_ALIGN = 64  # every element size divides it

_shared: StagingPool | None = None
_shared_lock = threading.Lock()


def _forget(buffer: torch.Tensor) -> None:
    """A buffer that may still be read elsewhere leaves the pool; its memory is
    freed when the last tensor over it is."""


def shared_pool() -> StagingPool:
    """The process's staging pool for DCP saves."""
    global _shared
    with _shared_lock:
        if _shared is None:
            _shared = StagingPool(let_go=_forget)
        return _shared


class Lease:
    """One staged state's buffer, as StagingPool.give_back needs to know it."""

    def __init__(self, buffer: torch.Tensor, pinned: bool) -> None:
        self.buffer: torch.Tensor | None = buffer
        self.pinned = pinned
        self.handed_off = False  # read by another process: never reuse
        self._live = 0
        self._lock = threading.Lock()

    def wait_copied(self) -> None:
        """Copies into the buffer finish before stage() returns."""

    def readers_done(self) -> bool:
        return not self.handed_off

    def claim_buffer(self) -> torch.Tensor | None:
        with self._lock:
            buffer, self.buffer = self.buffer, None
        return buffer


class FastPersistStager(AsyncStager):
    """An AsyncStager whose snapshots live in fastpersist's reused staging buffers."""

    # stage() returns once the copies are complete: nothing to synchronise later.
    _synchronize_after_execute = False

    def __init__(self, *, staging_budget: int | None = None,
                 pool: StagingPool | None = None) -> None:
        self._budget = settings().staging_budget if staging_budget is None else staging_budget
        self._pool = pool if pool is not None else shared_pool()

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        staged, lease = self.stage_leased(state_dict)
        if lease is not None:
            _release_when_collected(staged, lease, self._pool)
        return staged

    def stage_leased(self, state_dict: dict[str, Any]) -> tuple[dict[str, Any], Lease | None]:
        """The staged state and its buffer's lease, for the caller to release()."""
        sources: list[torch.Tensor] = []
        local_ids: set[int] = set()
        in_bytes: set[int] = set()
        _walk(state_dict, sources, local_ids, in_bytes)
        total, offsets = 0, []
        for t in sources:
            offsets.append(total)
            total += -(-t.numel() * t.element_size() // _ALIGN) * _ALIGN
        if not total:
            return _rebuild(state_dict, {}), None
        pinned = any(t.device.type == "cuda" for t in sources)
        buffer = self._pool.acquire(total, self._budget, pinned)
        lease = Lease(buffer, pinned)
        try:
            # With DTensors in the state, every staged tensor gets a storage of
            # its own (see _aliases); without, those that DCP stores as
            # torch.save bytes do (in_bytes: torch.save writes a tensor's whole
            # storage, which for a view of the buffer is the buffer, holding the
            # other tensors of this state and an earlier save's leftovers).
            alias = _aliases(buffer) if local_ids or in_bytes else None
            views: dict[int, torch.Tensor] = {}
            devices = set()
            for t, off in zip(sources, offsets, strict=True):
                cuda = t.device.type == "cuda"
                own = alias is not None and (bool(local_ids) or id(t) in in_bytes)
                if own and not cuda:
                    assert alias is not None
                    view = alias(t, off)
                else:  # a device copy lands in the pinned buffer's own storage
                    n = t.numel() * t.element_size()
                    view = buffer[off:off + n].view(t.dtype).view(t.shape)
                view.copy_(t.detach(), non_blocking=cuda)
                if cuda:
                    devices.add(t.device)
                    if own:
                        assert alias is not None
                        view = alias(t, off)
                views[id(t)] = view
            for device in devices:
                torch.cuda.current_stream(device).synchronize()
            staged = _rebuild(state_dict, views)
        except BaseException:
            self.release(lease)
            raise
        return staged, lease

    def release(self, lease: Lease) -> None:
        """The save is done with the lease's buffer (a second call does nothing)."""
        self._pool.give_back(lease)

    def synchronize_staging(self) -> None:
        """stage() is synchronous."""

    def close(self) -> None:
        """Nothing to do: buffers in use return when their saves are done; the
        free ones stay for the next save."""


def _local(t: torch.Tensor) -> torch.Tensor | None:
    """A DTensor's local shard; None for a plain tensor."""
    return t._local_tensor if isinstance(t, DTensor) else None


def _stageable(t: torch.Tensor) -> bool:
    return type(t) in (torch.Tensor, torch.nn.Parameter) and t.layout == torch.strided \
        and not t.is_quantized


def _walk(obj: Any, out: list[torch.Tensor], local_ids: set[int], in_bytes: set[int],
          under_tuple: bool = False) -> None:
    """The tensors to stage into `out`; the ids of DTensors' local tensors
    into `local_ids`, and of tensors under a tuple into `in_bytes`: DCP's
    traversal stops at a tuple (or namedtuple) and stores it whole with
    torch.save (torch.distributed.checkpoint._traverse)."""
    if isinstance(obj, torch.Tensor):
        local = _local(obj)
        t = obj if local is None else local
        if local is not None:
            local_ids.add(id(local))
        if _stageable(t) and t.numel():
            out.append(t)
            if under_tuple:
                in_bytes.add(id(t))
    elif isinstance(obj, dict):
        for v in obj.values():
            _walk(v, out, local_ids, in_bytes, under_tuple)
    elif isinstance(obj, (list, tuple)):
        inside = under_tuple or isinstance(obj, tuple)
        for v in obj:
            _walk(v, out, local_ids, in_bytes, inside)


def _rebuild(obj: Any, views: dict[int, torch.Tensor]) -> Any:
    if isinstance(obj, torch.Tensor):
        local = _local(obj)
        if local is not None:
            # As DCP's own stager does: the same spec (mesh, placements,
            # global shape) over the host copy of the shard.
            staged = views.get(id(local))
            if staged is None:
                staged = local.detach().to("cpu", copy=True)
            return DTensor(staged, obj._spec,  # type: ignore[no-untyped-call, attr-defined]
                           requires_grad=False)
        staged = views.get(id(obj))
        if staged is not None:
            return staged
        if _stageable(obj):  # empty
            return torch.empty(obj.shape, dtype=obj.dtype)
        return copy.deepcopy(obj)  # ShardedTensor and other tensor kinds
    if isinstance(obj, dict):
        items = [(k, _rebuild(v, views)) for k, v in obj.items()]
        if type(obj) is dict:
            return dict(items)
        # A subclass keeps its class and state (a defaultdict its default_factory,
        # which type(obj)(items) would take the items for).
        rebuilt = copy.copy(obj)
        rebuilt.clear()
        rebuilt.update(items)
        return rebuilt
    if isinstance(obj, list):
        return [_rebuild(v, views) for v in obj]
    if isinstance(obj, tuple):
        items = [_rebuild(v, views) for v in obj]
        return type(obj)(*items) if hasattr(obj, "_fields") else tuple(items)
    return copy.deepcopy(obj)


def _aliases(buffer: torch.Tensor) -> Callable[[torch.Tensor, int], torch.Tensor]:
    """A function giving, for a tensor like `t` at byte `offset` of `buffer`,
    a tensor with a storage of its own over that memory; each keeps the
    buffer alive for as long as it lives.

    Why: DCP's process executor pickles the staged state with
    torch.multiprocessing, which moves each storage it meets into shared
    memory. A DTensor over a slice of a staging buffer crashed the trainer
    there (SIGSEGV in _share_fd_cpu_, torch 2.13: the wrapper takes its local
    tensor's storage offset but has no storage); and once any view moved the
    buffer's storage, aliases by address into the old memory would dangle.
    With a storage per tensor, each moves alone and none starts past 0.
    """
    memory = bytes_of(buffer)  # keeps the buffer alive, and so does each alias

    def alias(t: torch.Tensor, offset: int) -> torch.Tensor:
        return torch.frombuffer(memory, dtype=t.dtype, count=t.numel(),
                                offset=offset).view(t.shape)

    return alias


def _release_when_collected(staged: Any, lease: Lease, pool: StagingPool) -> None:
    """Give the buffer back once every staged tensor over it is gone."""
    tensors: list[torch.Tensor] = []
    _collect_views(staged, lease, tensors)
    remaining = [len(tensors)]
    lock = threading.Lock()

    def gone() -> None:
        with lock:
            remaining[0] -= 1
            last = remaining[0] == 0
        if last:
            pool.give_back(lease)

    for t in tensors:
        weakref.finalize(t, gone)


def _collect_views(obj: Any, lease: Lease, out: list[torch.Tensor]) -> None:
    if isinstance(obj, torch.Tensor):
        local = _local(obj)
        out.append(obj if local is None else local)
    elif isinstance(obj, dict):
        for v in obj.values():
            _collect_views(v, lease, out)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            _collect_views(v, lease, out)
