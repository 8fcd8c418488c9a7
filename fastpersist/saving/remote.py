"""Saving through fastpersistd: the snapshot goes into shared memory, the daemon writes it.

Call sequence of one save (caller = the training thread, writer = the
RemoteSaver's background thread, daemon = fastpersistd):

    caller  1. flatten and plan the state, as in-process; Open (Begin: the
               daemon checks the path and reserves staging; its reply is a
               stream of progress, and while it is open, the daemon's sign
               that we are alive)
    caller  2. per data file: take a shared-memory buffer, copy the tensors in
               (laid out as the file's data section), hand it to the writer
    writer  3. SubmitShm per file; a tensor too large for the staging budget is
               streamed over gRPC instead (SubmitStream)
    writer  4. Commit: from the reply on, the checkpoint is the daemon's and is
               committed even if this process dies
    caller  5. returns the SaveFuture once 4 is done
    writer  6. follow the progress until the daemon reports it durable (or failed),
               give the buffers back to the pool, resolve the future

Buffers (the rule in staging.py): a segment is lent to the daemon from its
SubmitShm on, and goes back to the pool only once the daemon reported its
file written or the checkpoint committed (handover.Handover); a segment whose
fate is unknown (a lost reply, a broken stream, a failed checkpoint whose
worker may still read it) is quarantined: unlinked and never reused, while the
daemon's mapping keeps its pages. What the caller is told is the daemon's
word: after a lost Commit reply or a broken Watch stream (step 4 or 6) the
writer asks the daemon how the checkpoint ended before resolving the future
(committed: success; failed: that failure; no answer:
DaemonMayStillCommitError).

The on-disk checkpoint is the same as an in-process save's: same header, same
layout, the manifest built by the daemon from the same pieces.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import queue
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..errors import CheckpointAbortedError, CheckpointError
from ..knobs import current as current_knobs
from ..protocol.client import DaemonClient
from ..storage.local_path import checkpoint_path
from ..storage.retention import AfterCommit
from ..tensors import packed, plan, state
from .futures import STOP, SaveFuture
from .handover import Handover
from .saver import Saver
from .segments import SegmentBuffers, socket_group
from .snapshot import StagedFile, group_into_files, stage_file
from .staging import StagingPool


@dataclass
class _Job:
    future: SaveFuture
    ident: str
    relative: str
    files_total: int
    tree_json: str
    tensor_order: list[str]
    handoff: queue.Queue[Any]
    on_commit: Callable[[Path], None] | None
    budget: int  # FASTPERSIST_STAGING_BUDGET at the save (0: unbounded)
    handover: Handover  # its progress stream is open from Open on: our lease
    after_commit: AfterCommit | None = None  # a Checkpointer's, applied by the daemon
    handed_over: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None
    queue_done: bool = False  # the caller's last item (stop or error) was taken


class RemoteSaver(Saver):
    """A Saver whose writes are done by fastpersistd at `address`."""

    def __init__(self, address: str, max_in_flight: int | None = None) -> None:
        super().__init__(max_in_flight)
        self.client = DaemonClient(address)
        self._segments = SegmentBuffers(socket_group(address))
        self._pool = StagingPool(self._segments.allocate, self._segments.free,
                                 let_go=self._segments.free)
        _live_remote_savers.add(self)

    # -- caller side ------------------------------------------------------

    def save(self, obj: Any, path: str | os.PathLike[str], *, allow_pickle: bool = False,
             wait_for_snapshot: bool = True, on_commit: Callable[[Path], None] | None = None,
             compression: str | None = None, overlap_writes: bool = False,
             after_commit: AfterCommit | None = None) -> SaveFuture:
        """See Saver.save. overlap_writes: let the daemon write each file while
        the next is copied (fastpersist.save, whose caller waits for the whole
        save anyway). Otherwise, when the whole snapshot fits the staging budget,
        files are handed over once the copy is done, so that the daemon's writes
        do not compete with the caller's copy for cores and memory bandwidth:
        the stall is the copy, and the writes follow in the background.
        after_commit: a Checkpointer's policy, which the daemon applies in the
        checkpoint's directory before it reports it committed. compression:
        "zstd" has the daemon compress each staged file as it writes it (its
        CPU, not the caller's); a file too large for the staging budget, sent
        as a stream, is written raw."""
        return self._entered(lambda: self._save(obj, path, allow_pickle, wait_for_snapshot,
                                                on_commit, compression, overlap_writes,
                                                after_commit))

    def _save(self, obj: Any, path: str | os.PathLike[str], allow_pickle: bool,
              wait_for_snapshot: bool, on_commit: Callable[[Path], None] | None,
              compression: str | None = None, overlap_writes: bool = False,
              after_commit: AfterCommit | None = None) -> SaveFuture:
        compression = packed.check_compression(compression)
        self.raise_unobserved_failure()
        target = checkpoint_path(path)
        relative = self.client.relative(target)
        tree, leaves = state.encode(obj, allow_pickle=allow_pickle)
        stored = plan.plan_tensors(leaves)
        tree_json = json.dumps(tree, allow_nan=False)
        self._wait_for_room()
        knobs = current_knobs()
        budget = knobs.staging_budget
        files = group_into_files(stored, budget, knobs.file_bytes)
        staged_bytes = sum(f.nbytes for f in files if f.staged)
        # Unstaged files are streamed, and the daemon writes them to disk as they
        # arrive: they take none of its staging.
        reserve = min(staged_bytes, budget) if budget else staged_bytes
        ident, stream = self.client.open(relative, reserve, len(files),
                                         compression=compression or "",
                                         frame_bytes=knobs.frame_bytes if compression else 0)
        future = SaveFuture(target)
        job = _Job(future, ident, relative, len(files), tree_json, [t.name for t in stored],
                   queue.Queue(), on_commit, budget,
                   Handover(self.client, self._segments, ident, str(target), stream),
                   after_commit)
        with self._lock:
            self._in_flight.append(future)
        self._ensure_thread()
        self._jobs.put(job)
        pinned = torch.cuda.is_available() and any(t.source.is_cuda for t in stored)
        # Without a budget nothing waits for a write to free memory, so the
        # hand-over may wait for the end of the copy (see save()).
        deferred: list[tuple[int, StagedFile, None]] | None = (
            [] if not overlap_writes and not budget else None)
        try:
            for index, file in enumerate(files):
                if not file.staged:
                    streamed = threading.Event()
                    job.handoff.put((index, StagedFile(file.tensors, None), streamed))
                    streamed.wait()  # sent from the tensor itself while we wait
                    continue
                buffer = self._pool.acquire(file.nbytes, budget, pinned)
                try:
                    staged = stage_file(file.tensors, buffer, pinned)
                except BaseException:
                    self._pool.discard(buffer, pinned)  # (no reader saw it)
                    raise
                future._staged.append(staged)
                if deferred is not None:
                    deferred.append((index, staged, None))
                else:
                    job.handoff.put((index, staged, None))
            for item in deferred or ():
                job.handoff.put(item)
        except BaseException as exc:
            job.handoff.put(exc)  # the writer aborts the checkpoint
            future._observed = True
            raise
        job.handoff.put(STOP)
        future._snapshot_done.set()
        if wait_for_snapshot:
            self._wait_handed_over(job)
        else:
            # wait_snapshot() also waits for the hand-over, so that "the caller may
            # change the state" and "the daemon owns it" stay one moment.
            future._staged.append(_HandOver(job))  # type: ignore[arg-type]
        future.snapshot_seconds = time.perf_counter() - future._started
        return future

    @staticmethod
    def _wait_handed_over(job: _Job) -> None:
        job.handed_over.wait()
        if job.error is not None:
            job.future._observed = True
            raise job.error

    # -- writer side ------------------------------------------------------

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is STOP:
                return
            self._persist_remote(job)

    def _persist_remote(self, job: _Job) -> None:
        future = job.future
        future._persist_started = time.perf_counter()
        taken: list[StagedFile] = []  # every file taken from the caller
        handover = job.handover
        error: BaseException | None = None
        try:
            self._hand_over(job, handover, taken)
        except BaseException as exc:
            error = exc
            if isinstance(exc, Exception):
                error = handover.outcome_after(exc, handed_over=job.handed_over.set)
        finally:
            handover.close()
            # The pool decides: reused, or quarantined if the daemon may still read it.
            for staged in taken:
                self._pool.give_back(staged)
            if not job.queue_done:
                self._drain(job)
        if error is not None:
            job.error = error
            job.handed_over.set()
            self._fail(future, error)
            return
        job.handed_over.set()  # also when only the outcome query found it committed
        try:
            if job.on_commit is not None:
                job.on_commit(future.path)
        except BaseException as exc:
            self._fail(future, exc)
            return
        future.persist_seconds = time.perf_counter() - future._persist_started
        future._staged = []
        future._future.set_result(None)

    def _hand_over(self, job: _Job, handover: Handover, taken: list[StagedFile]) -> None:
        while True:
            item = job.handoff.get()
            if item is STOP:
                job.queue_done = True
                break
            if isinstance(item, BaseException):
                job.queue_done = True
                raise CheckpointError(f"snapshot of {job.future.path} failed: {item}") from item
            index, staged, streamed = item
            taken.append(staged)
            try:
                if self._abort.is_set():
                    raise CheckpointAbortedError(f"save of {job.future.path} was aborted")
                handover.submit(index, staged)
            finally:
                if streamed is not None:
                    streamed.set()
            if job.budget and index < job.files_total - 1:
                # Staging is bounded and more files follow: the caller may be
                # waiting for this buffer; take it back once it is written.
                handover.wait_written(index + 1)
                self._pool.give_back(staged)
        handover.commit(job.tree_json, job.tensor_order, job.after_commit)
        job.handed_over.set()
        handover.wait_end()

    def _drain(self, job: _Job) -> None:
        """After a failure: give back the buffers still queued, unblock the caller."""
        while True:
            item = job.handoff.get()
            if item is STOP or isinstance(item, BaseException):
                return
            _, staged, streamed = item
            if streamed is not None:
                streamed.set()
            # Waits for the device copies into it (the caller may not have).
            self._pool.give_back(staged)

    def close(self, *, abort: bool = False) -> None:
        super().close(abort=abort)
        self.client.close()


class _HandOver:
    """Stands in the future's staged list so that wait_snapshot() (with
    wait_for_snapshot=False) returns only after the hand-over."""

    def __init__(self, job: _Job) -> None:
        self.job = job

    def wait_copied(self) -> None:
        RemoteSaver._wait_handed_over(self.job)


_remote_savers: dict[str, RemoteSaver] = {}
_remote_lock = threading.Lock()


def remote_saver(address: str) -> RemoteSaver:
    """The process-wide RemoteSaver for `address` (fastpersist.save / async_save)."""
    with _remote_lock:
        saver = _remote_savers.get(address)
        if saver is None or saver._closed:
            saver = _remote_savers[address] = RemoteSaver(address)
        return saver


# Segments are files: they outlive a process that exits without unlinking them
# (the daemon reclaims those, but only while it runs). At exit, after the saves
# in flight finished, unlink ours.
_live_remote_savers: weakref.WeakSet[RemoteSaver] = weakref.WeakSet()


@atexit.register
def _unlink_segments_at_exit() -> None:
    for saver in list(_live_remote_savers):
        with contextlib.suppress(Exception):
            saver.stop_thread()
            saver._pool.clear()
