"""Asynchronous saves: the trainer pays for the snapshot, the write overlaps training.

Call sequence of one async save (caller = the training thread,
writer = the Saver's background thread):

    caller  1. report an earlier save's unobserved failure, if any
    caller  2. flatten and plan the state (state.encode, plan.plan_tensors)
    caller  3. wait while max_in_flight saves are still persisting (backpressure)
    caller  4. make the staging directory (CheckpointWriter.begin)
    caller  5. per data file: take a staging buffer (waits for one under the
               budget), copy the tensors into it, hand it to the writer; a
               snapshot that fits the budget takes all its buffers first and
               hands its files over once all are copied (Saver._snapshot)
    caller  6. return the SaveFuture (after the device copies finished, unless
               wait_for_snapshot=False: then future.wait_snapshot() does that)
    writer  7. per data file: wait for its copies, write it with the engine,
               give the buffer back (StagingPool.give_back: see staging.py)
    writer  8. commit (manifest, fsync, rename) and resolve the future

A failure in 7 or 8 aborts the checkpoint (nothing is left behind), and is
raised by future.result(); if nobody asks, the next save raises it.
"""

from __future__ import annotations

import atexit
import os
import queue
import threading
import time
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .. import gcpause
from ..background import lower_this_thread
from ..errors import CheckpointAbortedError, CheckpointError
from ..knobs import current as current_knobs
from ..storage.local_path import checkpoint_path
from ..tensors import plan, state
from ..tensors.plan import StoredTensor
from .futures import STOP, SaveFuture, observe_aborts, raise_failure_of, take_unobserved_failure
from .persist import CheckpointWriter
from .snapshot import StagedFile, group_into_files, stage_file
from .staging import StagingPool


class Saver:
    """Runs async saves on one background thread, at most max_in_flight at once.

    fastpersist.async_save uses a process-wide Saver; a Checkpointer has its own.
    """

    def __init__(self, max_in_flight: int | None = None) -> None:
        self._max_in_flight = max_in_flight  # None: FASTPERSIST_MAX_IN_FLIGHT, at each save
        self._pool = StagingPool()
        self._jobs: queue.Queue[Any] = queue.Queue()
        self._in_flight: list[SaveFuture] = []
        # Re-entrant: close() may run in a signal handler that interrupted save().
        self._lock = threading.RLock()
        self._saving_in: int | None = None  # thread id inside save(), if any
        self._thread: threading.Thread | None = None
        self._abort = threading.Event()
        self._closed = False
        _live_savers.add(self)

    # -- caller side ------------------------------------------------------

    def save(self, obj: Any, path: str | os.PathLike[str], *, allow_pickle: bool = False,
             wait_for_snapshot: bool = True,
             on_commit: Callable[[Path], None] | None = None,
             compression: str | None = None) -> SaveFuture:
        """See async_save. on_commit(path) runs on the writer thread after the
        commit and before the future resolves; its failure fails the future.
        compression="zstd": the writer thread compresses each staged file
        before writing it (the caller pays only the snapshot's copy)."""
        return self._entered(lambda: self._save(obj, path, allow_pickle, wait_for_snapshot,
                                                on_commit, compression))

    def prepare_staging(self, obj: Any, *, allow_pickle: bool = False) -> int:
        """Allocate and fault in the staging memory that saves of `obj` take,
        now, so that the first save stalls no longer than the later ones. (A
        fresh process's first snapshot otherwise also maps its buffers and
        takes a page fault per page of them as it copies: 1.37 s against 0.10
        s for 1.08 GB here; pinned buffers for CUDA tensors cost more to make.)

        Only the shapes, dtypes and devices of obj's tensors matter, not their
        values. It first waits for the saves in flight (their buffers come back
        to the pool and are reused, not doubled). Call it before the training
        loop, not while another thread saves. With a staging budget smaller
        than one snapshot it prepares as many buffers of the largest file's
        size as the budget holds, which every file then reuses. Returns the
        bytes of staging ready.
        """
        if self._closed:
            raise CheckpointError("this Saver is closed")
        with gcpause.paused():
            _, leaves = state.encode(obj, allow_pickle=allow_pickle)
            stored = plan.plan_tensors(leaves)
        self.wait()
        knobs = current_knobs()
        budget = knobs.staging_budget
        sizes = [f.nbytes for f in group_into_files(stored, budget, knobs.file_bytes)
                 if f.staged]
        if budget and sum(sizes) > budget:
            # Files are acquired one at a time then, each taking the smallest free
            # buffer it fits: buffers of the largest size fit every file.
            largest = max(sizes)
            sizes = [largest] * min(len(sizes), budget // largest)
        pinned = any(t.source.is_cuda for t in stored)
        buffers = self._pool.acquire_all(sizes, budget, pinned)
        try:
            if not pinned:  # cudaHostAlloc'd and registered memory is resident already
                for buffer in buffers:
                    buffer.fill_(0)  # first touch, on torch's threads as a copy would
        finally:
            self._pool.give_back_unused(buffers, pinned)
            if self._closed:  # closed meanwhile: its pool was cleared before these came back
                self._pool.clear()
        return sum(b.numel() for b in buffers)

    def _entered(self, save: Callable[[], SaveFuture]) -> SaveFuture:
        """Run one save() call: refused once closed, and marked as running on this
        thread (see close())."""
        if self._closed:
            raise CheckpointError("this Saver is closed")
        self._saving_in = threading.get_ident()
        try:
            return save()
        finally:
            self._saving_in = None

    def _save(self, obj: Any, path: str | os.PathLike[str], allow_pickle: bool,
              wait_for_snapshot: bool, on_commit: Callable[[Path], None] | None,
              compression: str | None = None) -> SaveFuture:
        self.raise_unobserved_failure()
        target = checkpoint_path(path)
        with gcpause.paused():  # many tensors make many objects, and no cycles
            tree, leaves = state.encode(obj, allow_pickle=allow_pickle)
            stored = plan.plan_tensors(leaves)
        self._wait_for_room()
        knobs = current_knobs()
        future = SaveFuture(target)
        writer = CheckpointWriter.begin(target, tree, stored, compression)
        files: queue.Queue[Any] = queue.Queue()
        with self._lock:
            self._in_flight.append(future)
        self._ensure_thread()
        self._jobs.put((future, writer, files, on_commit))
        try:
            self._snapshot(stored, knobs.staging_budget, knobs.file_bytes, future, files)
        except BaseException as exc:
            files.put(exc)  # the writer aborts the checkpoint
            future._observed = True  # the caller gets this error now, not at the next save
            raise
        files.put(STOP)
        future._snapshot_done.set()
        if wait_for_snapshot:
            future.wait_snapshot()
        future.snapshot_seconds = time.perf_counter() - future._started
        return future

    def _snapshot(self, stored: list[StoredTensor], budget: int, file_bytes: int,
                  future: SaveFuture, files: queue.Queue[Any]) -> None:
        """Copy the state into staging, file by file, and queue the files for the writer.

        A snapshot that fits the budget (or with none) takes all its buffers
        first (acquire_all): from the second save of a state on, the same ones,
        warm, whatever the writer's pace. Its files go to the writer once the
        whole copy is done, so that the writer's checksums and I/O do not compete
        with the copy that the caller is waiting for (as with fastpersistd). A
        larger snapshot waits for the writes of its earlier files to free room.
        """
        # Pinned staging only where there is something to copy from a GPU.
        pinned = any(t.source.is_cuda for t in stored)
        plans = group_into_files(stored, budget, file_bytes)
        sizes = [f.nbytes for f in plans if f.staged]
        whole = not budget or sum(sizes) <= budget
        upfront = self._pool.acquire_all(sizes, budget, pinned) if whole else []
        upfront.reverse()  # popped from the end, in file order
        deferred: list[StagedFile] = []  # copied, not yet handed to the writer
        try:
            for file in plans:
                if not file.staged:
                    # Written from the tensor itself while we wait.
                    written = threading.Event()
                    files.put((StagedFile(file.tensors, None), written))
                    written.wait()
                    continue
                buffer = (upfront.pop() if upfront
                          else self._pool.acquire(file.nbytes, budget, pinned))
                try:
                    with gcpause.paused():
                        staged = stage_file(file.tensors, buffer, pinned)
                except BaseException:
                    # Out of the budget (kept if a device copy may still land
                    # in it); the untouched ones in `upfront` go back below.
                    self._pool.discard(buffer, pinned)
                    raise
                future._staged.append(staged)
                if whole:
                    deferred.append(staged)
                else:
                    files.put((staged, None))
            while deferred:
                files.put((deferred.pop(0), None))
        except BaseException:
            self._pool.give_back_unused(upfront, pinned)
            for staged in deferred:
                self._pool.give_back(staged)  # waits for its device copies
            raise

    def wait(self) -> None:
        """Block until every save handed over so far has finished (either way)."""
        with self._lock:
            pending = list(self._in_flight)
        for f in pending:
            f._future.exception()  # waits; failures stay unobserved for the next save

    def close(self, *, abort: bool = False) -> None:
        """Finish (or, with abort, cleanly abandon) in-flight saves and stop the thread.

        An aborted save leaves no trace on disk; its future raises
        CheckpointAbortedError. A save already past its last data file commits.
        Raises the failure of a save whose result nobody looked at.
        """
        if self._saving_in == threading.get_ident():
            # A signal handler interrupted save() on this thread: waiting here
            # for the writer, which waits for this save() to finish, would hang.
            raise CheckpointError(
                "close() was called from inside save() (from a signal handler?); set a flag "
                "in the handler and call close() from the training loop instead"
            )
        self._closed = True
        if abort:
            self._abort.set()
        self.stop_thread()
        self._pool.clear()
        # A failure nobody looked at is not dropped on the floor at shutdown.
        with self._lock:
            observe_aborts(self._in_flight)
        self.raise_unobserved_failure()

    def stop_thread(self) -> None:
        """Wait for the saves in flight, then stop the writer thread and join it."""
        self.wait()
        if self._thread is not None:
            self._jobs.put(STOP)
            self._thread.join()
            self._thread = None

    @property
    def max_in_flight(self) -> int:
        return self._max_in_flight or current_knobs().max_in_flight

    @property
    def staging_bytes(self) -> int:
        return self._pool.allocated_bytes

    def _wait_for_room(self) -> None:
        while True:
            # Also prunes the finished saves, after reporting an unobserved failure.
            self.raise_unobserved_failure()
            with self._lock:
                if len(self._in_flight) < self.max_in_flight:
                    return
                oldest = self._in_flight[0]
            oldest._future.exception()  # backpressure: wait for it to finish

    def raise_unobserved_failure(self) -> None:
        """Raise the failure of a finished save whose result nobody looked at."""
        with self._lock:
            self._in_flight, failed = take_unobserved_failure(self._in_flight)
        raise_failure_of(failed)

    def _ensure_thread(self) -> None:
        # Under the lock: the first saves of two threads must not both start a
        # writer (close() stops one, and would wait for the other forever).
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="fastpersist-writer",
                                                daemon=True)
                self._thread.start()

    # -- writer side ------------------------------------------------------

    def _run(self) -> None:
        lower_this_thread()  # the persist yields the cores to training (background.py)
        while True:
            job = self._jobs.get()
            if job is STOP:
                return
            future, writer, files, on_commit = job
            self._persist(future, writer, files, on_commit)

    def _persist(self, future: SaveFuture, writer: CheckpointWriter,
                 files: queue.Queue[Any], on_commit: Callable[[Path], None] | None) -> None:
        future._persist_started = time.perf_counter()
        queue_done = False  # whether the caller's last item (stop or error) was taken
        try:
            while True:
                item = files.get()
                if item is STOP:
                    queue_done = True
                    break
                if isinstance(item, BaseException):
                    queue_done = True
                    raise CheckpointError(f"snapshot of {writer.target} failed: {item}") from item
                staged, written = item
                try:
                    if self._abort.is_set():
                        raise CheckpointAbortedError(f"save of {writer.target} was aborted")
                    staged.wait_copied()
                    writer.write_file(staged.tensors)
                finally:
                    if written is not None:
                        written.set()
                    self._pool.give_back(staged)
            writer.commit()
        except BaseException as exc:
            writer.abort()
            if not queue_done:
                _drain(files, self._pool)
            self._fail(future, exc)
            return
        try:
            if on_commit is not None:
                on_commit(writer.target)
        except BaseException as exc:
            self._fail(future, exc)
            return
        future.persist_seconds = time.perf_counter() - future._persist_started
        future._staged = []  # every copy is done; do not pin the buffers' views
        future._future.set_result(None)

    @staticmethod
    def _fail(future: SaveFuture, exc: BaseException) -> None:
        assert future._persist_started is not None
        future.persist_seconds = time.perf_counter() - future._persist_started
        future._future.set_exception(exc)


def _drain(files: queue.Queue[Any], pool: StagingPool) -> None:
    """After a failure: release the buffers still queued, unblock the caller."""
    while True:
        item = files.get()
        if item is STOP or isinstance(item, BaseException):
            return
        staged, written = item
        if written is not None:
            written.set()
        # Waits for the device copies into it (the caller may not have).
        pool.give_back(staged)


# The writer threads are daemons, so a process that returns from async_save and
# exits would kill a save halfway. At exit, finish what is in flight and stop
# the writer threads: a daemon thread still running Python while the
# interpreter finalizes is killed by a forced unwind, which aborts the process
# if it passes through C++ frames (torch's tensor destructors).
_live_savers: weakref.WeakSet[Saver] = weakref.WeakSet()


@atexit.register
def _finish_in_flight_saves() -> None:
    for saver in list(_live_savers):
        saver.stop_thread()


_default_saver: Saver | None = None
_default_lock = threading.Lock()


def default_saver() -> Saver:
    global _default_saver
    with _default_lock:
        if _default_saver is None:
            _default_saver = Saver()
        return _default_saver
