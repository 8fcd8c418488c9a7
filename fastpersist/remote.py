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
               return the buffers to the pool, resolve the future

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
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import torch

from . import plan, shm, state
from ._proto import fastpersist_pb2 as pb
from .daemon_client import DaemonClient, failure, grpc_target
from .datafile import plan_file
from .errors import (
    CheckpointAbortedError,
    CheckpointError,
    DaemonError,
    DaemonUnavailableError,
    PostCommitError,
)
from .knobs import current as current_knobs
from .plan import StoredTensor, memory_of
from .retention import AfterCommit
from .saver import _STOP, SaveFuture, Saver
from .snapshot import StagedFile, group_into_files, stage_file
from .staging import StagingPool

COMMITTED = pb.CheckpointStatus.COMMITTED
TERMINAL = (pb.CheckpointStatus.COMMITTED, pb.CheckpointStatus.FAILED,
            pb.CheckpointStatus.ABORTED)


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
    progress: Progress  # open from Begin on: the daemon's sign that we are alive
    after_commit: AfterCommit | None = None  # a Checkpointer's, applied by the daemon
    handed_over: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None


class Progress:
    """Follows a checkpoint's progress stream on a thread of its own: Open's
    (DaemonClient.open), or a Watch. The open stream is also the daemon's sign
    that this client is alive: if it closes before Commit (this process died),
    the daemon aborts the checkpoint."""

    def __init__(self, client: DaemonClient, ident: str, call: Any = None) -> None:
        self._cond = threading.Condition()
        self._status: pb.CheckpointStatus | None = None
        self._error: BaseException | None = None
        self._ended = False
        self._client = client
        self._call = call if call is not None else client.stub.Watch(
            pb.WaitRequest(checkpoint_id=ident))
        self._thread = threading.Thread(target=self._follow, name="fastpersist-watch",
                                        daemon=True)
        self._thread.start()

    def _follow(self) -> None:
        try:
            for status in self._call:
                with self._cond:
                    self._status = status
                    self._cond.notify_all()
        except grpc.RpcError as exc:
            with self._cond:
                self._error = self._client.error(exc, "lost the checkpoint's progress stream")
        finally:
            with self._cond:
                self._ended = True
                self._cond.notify_all()

    def wait(self, files_written: int | None = None) -> pb.CheckpointStatus:
        """Until `files_written` files are durable (None: until the end)."""
        with self._cond:
            while True:
                s = self._status
                if s is not None and (s.state in TERMINAL or (
                        files_written is not None and s.files_written >= files_written)):
                    if s.state in TERMINAL and s.state != COMMITTED:
                        raise failure(s)
                    return s
                if self._error is not None:
                    raise self._error
                if self._ended:
                    raise DaemonUnavailableError(
                        "fastpersistd closed the progress stream before the checkpoint finished")
                self._cond.wait()

    def close(self) -> None:
        self._call.cancel()
        self._thread.join(timeout=5)


class SegmentBuffers:
    """Staging buffers backed by shared-memory segments the daemon can map."""

    def __init__(self, group: int | None) -> None:
        self.group = group
        self._lock = threading.Lock()
        self._by_ptr: dict[int, shm.Segment] = {}
        self._registered: dict[int, bool] = {}  # page-locked with cudaHostRegister

    def allocate(self, nbytes: int, pinned: bool) -> torch.Tensor:
        # At least a page, so that every buffer is a real mapping with a name.
        segment = shm.Segment(shm.shm_dir(), max(nbytes, 4096), self.group)
        assert segment.map is not None
        buffer = torch.frombuffer(segment.map, dtype=torch.uint8)[:nbytes]
        if pinned:
            # Page-lock the shared pages so device-to-host copies run async and
            # at full bandwidth, as into cudaHostAlloc'd staging.
            cudart = torch.cuda.cudart()  # type: ignore[no-untyped-call]
            rc = cudart.cudaHostRegister(buffer.data_ptr(), segment.size, 0)
            if int(rc) != 0:
                segment.close()
                raise CheckpointError(f"cudaHostRegister of {segment.size} bytes failed ({rc})")
        with self._lock:
            self._by_ptr[buffer.data_ptr()] = segment
            self._registered[buffer.data_ptr()] = pinned
        return buffer

    def free(self, buffer: torch.Tensor) -> None:
        with self._lock:
            segment = self._by_ptr.pop(buffer.data_ptr(), None)
        if segment is None:
            return
        if self._registered.pop(buffer.data_ptr(), False):
            torch.cuda.cudart().cudaHostUnregister(buffer.data_ptr())  # type: ignore[no-untyped-call]
        segment.close()

    def segment_of(self, buffer: torch.Tensor) -> shm.Segment:
        with self._lock:
            return self._by_ptr[buffer.data_ptr()]


def socket_group(address: str) -> int | None:
    """The daemon socket's group: segments are made readable to it."""
    target, tls = grpc_target(address)
    if tls:
        return None
    try:
        return os.stat(target.removeprefix("unix:")).st_gid
    except OSError:
        return None


class RemoteSaver(Saver):
    """A Saver whose writes are done by fastpersistd at `address`."""

    def __init__(self, address: str, max_in_flight: int | None = None) -> None:
        super().__init__(max_in_flight)
        self.client = DaemonClient(address)
        self._segments = SegmentBuffers(socket_group(address))
        self._pool = StagingPool(self._segments.allocate, self._segments.free)
        _live_remote_savers.add(self)

    # -- caller side ------------------------------------------------------

    def save(self, obj: Any, path: str | os.PathLike[str], *, allow_pickle: bool = False,
             wait_for_snapshot: bool = True, on_commit: Callable[[Path], None] | None = None,
             overlap_writes: bool = False, after_commit: AfterCommit | None = None
             ) -> SaveFuture:
        """See Saver.save. overlap_writes: let the daemon write each file while
        the next is copied (fastpersist.save, whose caller waits for the whole
        save anyway). Otherwise, when the whole snapshot fits the staging budget,
        files are handed over once the copy is done, so that the daemon's writes
        do not compete with the caller's copy for cores and memory bandwidth:
        the stall is the copy, and the writes follow in the background.
        after_commit: a Checkpointer's policy, which the daemon applies in the
        checkpoint's directory before it reports it committed."""
        return self._entered(lambda: self._save(obj, path, allow_pickle, wait_for_snapshot,
                                                on_commit, overlap_writes, after_commit))

    def _save(self, obj: Any, path: str | os.PathLike[str], allow_pickle: bool,
              wait_for_snapshot: bool, on_commit: Callable[[Path], None] | None,
              overlap_writes: bool = False, after_commit: AfterCommit | None = None
              ) -> SaveFuture:
        self.raise_unobserved_failure()
        target = Path(os.path.abspath(os.fspath(path)))
        relative = self.client.relative(target)
        tree, leaves = state.encode(obj, allow_pickle=allow_pickle)
        stored = plan.plan_tensors(leaves)
        tree_json = json.dumps(tree, allow_nan=False)
        self._wait_for_room()
        knobs = current_knobs()
        budget = knobs.staging_budget
        files = group_into_files(stored, budget, knobs.file_bytes)
        staged_bytes = sum(f.nbytes for f in files if f.staged)
        largest_unstaged = max((f.nbytes for f in files if not f.staged), default=0)
        reserve = (min(staged_bytes, budget) if budget else staged_bytes) + largest_unstaged
        ident, stream = self.client.open(relative, reserve, len(files))
        future = SaveFuture(target)
        job = _Job(future, ident, relative, len(files), tree_json, [t.name for t in stored],
                   queue.Queue(), on_commit, budget, Progress(self.client, ident, stream),
                   after_commit)
        with self._lock:
            self._in_flight.append(future)
        self._ensure_thread()
        self._jobs.put(job)
        pinned = torch.cuda.is_available() and any(t.source.device.type == "cuda"
                                                   for t in stored)
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
                staged = stage_file(file.tensors, buffer, pinned)
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
        job.handoff.put(_STOP)
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
            if job is _STOP:
                return
            self._persist_remote(job)

    def _persist_remote(self, job: _Job) -> None:
        future = job.future
        future._persist_started = time.perf_counter()
        queue_done = False
        sent: list[StagedFile] = []  # buffers the daemon may still read
        progress: Progress | None = None
        try:
            progress = job.progress
            while True:
                item = job.handoff.get()
                if item is _STOP:
                    queue_done = True
                    break
                if isinstance(item, BaseException):
                    queue_done = True
                    raise CheckpointError(f"snapshot of {future.path} failed: {item}") from item
                index, staged, streamed = item
                try:
                    if self._abort.is_set():
                        raise CheckpointAbortedError(f"save of {future.path} was aborted")
                    self._submit(job, index, staged)
                finally:
                    if streamed is not None:
                        streamed.set()
                    sent.append(staged)
                if job.budget and index < job.files_total - 1:
                    # Staging is bounded and more files follow: the caller may be
                    # waiting for this buffer; take it back once it is written.
                    progress.wait(files_written=index + 1)
                    self._release(sent.pop())
            self.client.commit(job.ident, job.tree_json, job.tensor_order,
                               after_commit=job.after_commit)
            job.handed_over.set()
            status = progress.wait()
            if status.after_commit_error:
                raise PostCommitError(status.after_commit_error)
        except DaemonError as exc:
            self._fail_job(job, self._cause(job, exc), queue_done)
            return
        except BaseException as exc:
            self._fail_job(job, exc, queue_done)
            return
        finally:
            if progress is not None:
                progress.close()
            for staged in sent:
                self._release(staged)
        try:
            if job.on_commit is not None:
                job.on_commit(future.path)
        except BaseException as exc:
            self._fail(future, exc)
            return
        future.persist_seconds = time.perf_counter() - future._persist_started
        future._staged = []
        future._future.set_result(None)

    def _cause(self, job: _Job, exc: DaemonError) -> BaseException:
        """A call refused because the checkpoint already failed in the daemon
        (a full disk while the first files were written, say) reports that
        failure, not the refusal."""
        if exc.code != "FAILED_PRECONDITION":
            return exc
        try:
            status = self.client.wait(job.ident, timeout=5.0)
        except CheckpointError:
            return exc
        if status.state in TERMINAL and status.state != COMMITTED:
            return failure(status)
        return exc

    def _fail_job(self, job: _Job, exc: BaseException, queue_done: bool) -> None:
        if not job.handed_over.is_set():
            # Gone or already finished: then it aborts on its own.
            with contextlib.suppress(CheckpointError):
                self.client.abort(job.ident)
        if not queue_done:
            self._drain(job)
        job.error = exc
        job.handed_over.set()
        self._fail(job.future, exc)

    def _submit(self, job: _Job, index: int, staged: StagedFile) -> None:
        submit_staged(self.client, self._segments, job.ident, index, staged)

    def _release(self, staged: StagedFile) -> None:
        if staged.buffer is not None:
            self._pool.release(staged.buffer, staged.pinned)

    def _drain(self, job: _Job) -> None:
        while True:
            item = job.handoff.get()
            if item is _STOP or isinstance(item, BaseException):
                return
            _, staged, streamed = item
            if streamed is not None:
                streamed.set()
            self._release(staged)

    def close(self, *, abort: bool = False) -> None:
        super().close(abort=abort)
        self.client.close()


def submit_staged(client: DaemonClient, segments: SegmentBuffers, ident: str, index: int,
                  staged: StagedFile) -> None:
    """Hand one data file to the daemon: by reference to its shared-memory
    buffer, or streamed from the tensors when it was not staged."""
    staged.wait_copied()
    layout = staged.layout or plan_file(staged.tensors)
    length = layout.data_bytes
    if staged.buffer is None:
        client.submit_stream(ident, index, layout.layout.header, length, _chunks(layout.order))
        return
    segment = segments.segment_of(staged.buffer)
    segment.seal(ident)  # the daemon takes only segments that carry the checkpoint's tag
    client.submit_shm(ident, index, layout.layout.header, segment.name, segment.data_offset,
                      length)


class _HandOver:
    """Stands in the future's staged list so that wait_snapshot() (with
    wait_for_snapshot=False) returns only after the hand-over."""

    def __init__(self, job: _Job) -> None:
        self.job = job

    def wait_copied(self) -> None:
        RemoteSaver._wait_handed_over(self.job)


def _chunks(order: list[StoredTensor]) -> Iterator[memoryview]:
    for t in order:
        source = t.source if t.source.device.type == "cpu" else t.source.cpu()
        yield memoryview(memory_of(source)).cast("B")


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
            saver._stop_thread()
            saver._pool.clear()
