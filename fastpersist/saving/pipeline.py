"""The one save pipeline: every way of saving in the background (async_save,
Checkpointer, through fastpersistd, a distributed job) is a SavePipeline over
a Sink (sink.py), which decides where the bytes go.

Call sequence of one save (caller = the training thread, writer = the
pipeline's one background thread):

    caller  1. report an earlier save's unobserved failure, if any
    caller  2. flatten and plan the state (sink.plan; the GC paused)
    caller  3. wait while max_in_flight saves are still persisting
               (backpressure; a collective sink: until the last one ended)
    caller  4. reserve the destination (sink.begin)
    caller  5. per data file: take a staging buffer from the pool (waiting for
               one under the budget), copy the tensors into it (GC paused),
               hand it to the writer; a snapshot that fits the budget takes
               all its buffers first, and hands its files over once all are
               copied unless overlap_writes (so the writes do not compete
               with the copy the caller waits for)
    caller  6. return the SaveFuture (after the device copies and the sink's
               taking it over, unless wait_for_snapshot=False: then
               future.wait_snapshot() waits for them)
    writer  7. job.write: the files durable, the commit, the policies after it;
               the buffers go back to the pool (StagingPool.give_back decides:
               reused, or quarantined while a reader may still read them)
    writer  8. resolve the future

Staging is allocated on first use and reused by every later save; prepare_staging
takes it ahead of the first. A failure in 7 is raised by future.result(), or else
by the next save. A preemption signal during a save exits as it returns (preemption.py).
"""

from __future__ import annotations

import dataclasses
import os
import queue
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from .. import gcpause
from ..background import lower_this_thread
from ..errors import CheckpointError
from ..knobs import current as current_knobs
from ..storage.retention import AfterCommit
from . import preemption
from .files import StagedFiles
from .futures import STOP, SaveFuture, observe_aborts, raise_failure_of, take_unobserved_failure
from .registry import register
from .sink import SaveRequest, Sink, SinkJob, target_of
from .snapshot import FilePlan, StagedFile, needs_pinned, stage_file

T = TypeVar("T")


class _Owned:
    """Stands among a future's waiters: wait_snapshot() also waits until the
    sink owns the snapshot (a daemon's hand-over)."""

    def __init__(self, job: SinkJob) -> None:
        self.job = job

    def wait_copied(self) -> None:
        self.job.owned()


class SavePipeline:
    """Saves in the background on one writer thread, at most max_in_flight
    persisting at once, into the sink's destination (module docstring)."""

    def __init__(self, sink: Sink, max_in_flight: int | None = None) -> None:
        self.sink = sink
        # None: FASTPERSIST_MAX_IN_FLIGHT at each save; a collective sink runs one.
        self._max_in_flight = 1 if sink.collective else max_in_flight
        self._jobs: queue.Queue[Any] = queue.Queue()
        self._in_flight: list[SaveFuture] = []
        # Re-entrant: close() may run in a signal handler that interrupted save().
        self._lock = threading.RLock()
        self._saving_in: int | None = None  # thread id inside save(), if any
        self._thread: threading.Thread | None = None
        self._abort = threading.Event()
        self._closed = False
        register(self)

    @property
    def pool(self) -> Any:
        return self.sink.pool

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def max_in_flight(self) -> int:
        return self._max_in_flight or current_knobs().max_in_flight

    @property
    def staging_bytes(self) -> int:
        return int(self.sink.pool.allocated_bytes)

    @property
    def hands_over(self) -> bool:  # safe once fastpersistd owns it (preemption.py)
        return not self.sink.writes_in_process and not self.sink.collective

    def in_flight(self) -> list[SaveFuture]:  # begun, not yet ended
        with self._lock:
            return [f for f in self._in_flight if not f.done()]

    def saving_on(self, thread: int) -> bool:
        return self._saving_in == thread

    # -- the caller's side ----------------------------------------------------

    def save(self, obj: Any, path: str | os.PathLike[str], *, allow_pickle: bool = False,
             wait_for_snapshot: bool = True, compression: str | None = None,
             overlap_writes: bool = False, after_commit: AfterCommit | None = None,
             on_commit: Callable[[Path], None] | None = None, durability: str = "disk"
             ) -> SaveFuture:
        """See fastpersist.async_save; the module docstring for the steps.
        after_commit: a Checkpointer's policy, applied by whoever commits.
        on_commit(path) runs after the commit (a distributed job: on rank 0);
        a failure of either fails the future, the checkpoint committed."""
        request = self._request(path, allow_pickle, compression, overlap_writes, after_commit,
                                on_commit, durability)
        return self._entered(lambda: self._save(obj, request, wait_for_snapshot))

    def save_blocking(self, obj: Any, path: str | os.PathLike[str], *,
                      allow_pickle: bool = False, compression: str | None = None,
                      after_commit: AfterCommit | None = None) -> None:
        """fastpersist.save: durable on return. A sink that writes in this
        process writes straight from the live tensors, in the caller's thread
        (no staging, no copy); otherwise the files are staged and handed over
        each as soon as it is copied."""
        request = self._request(path, allow_pickle, compression, True, after_commit, None)
        if not self.sink.writes_in_process:
            self._entered(lambda: self._save(obj, request, True)).result()
            return
        self._entered(lambda: self._write_inline(obj, dataclasses.replace(request, inline=True)))

    def _write_inline(self, obj: Any, request: SaveRequest) -> None:
        if self.sink.collective:
            self.wait()  # the previous save's collectives end before this one's begin
        with gcpause.paused():  # a state of many tensors makes many objects, no cycles
            planned = self.sink.plan(obj, request)
            job = self.sink.begin(planned, request)
            # Every file the job cut, an empty state's one empty file too (the layout
            # every save makes): written from the live tensors, nothing staged.
            files = StagedFiles(len(job.files), 0)
            for file in job.files:
                files.put(StagedFile(file.tensors, None))
            files.close()
            job.write(files, self.sink.pool)

    def prepare_staging(self, obj: Any, *, allow_pickle: bool = False) -> int:
        """Allocate and fault in the staging memory that saves of `obj` take,
        now, so that the first save stalls no longer than the later ones (a
        first snapshot otherwise also faults its buffers in: 1.37 s against
        0.10 s for 1.08 GB here).

        Only the shapes, dtypes and devices of obj's tensors matter. It first
        waits for the saves in flight (their buffers are reused, not doubled).
        Call it before the training loop, not while another thread saves. Over
        the staging budget: StagingPool.prepare. Returns the bytes of staging
        ready: 0 for a sink that learns its share only at each save (a
        distributed job).
        """
        if self._closed:
            raise CheckpointError("this saver is closed")
        request = SaveRequest(Path("/"), allow_pickle)
        with gcpause.paused():
            files = self.sink.cut(self.sink.plan(obj, request), request)
        if files is None:
            return 0
        self.wait()
        pinned = needs_pinned(t for f in files for t in f.tensors)
        try:
            return self.sink.pool.prepare([f.nbytes for f in files if f.staged],
                                          self.sink.staging_budget(), pinned)
        finally:
            if self._closed:  # closed meanwhile: its pool was cleared before these came back
                self.sink.pool.clear()

    def _request(self, path: str | os.PathLike[str], allow_pickle: bool,
                 compression: str | None, overlap_writes: bool,
                 after_commit: AfterCommit | None, on_commit: Callable[[Path], None] | None,
                 durability: str = "disk") -> SaveRequest:
        return SaveRequest(target_of(path, self.sink.takes_urls), allow_pickle, compression,
                           overlap_writes, after_commit, on_commit, self._abort.is_set,
                           durability=durability)

    def _entered(self, save: Callable[[], T]) -> T:
        """Run one save() call: refused once closed, and marked as running on this
        thread (see close(); a preemption signal defers its exit to the end)."""
        if self._closed:
            raise CheckpointError("this saver is closed")
        self._saving_in = threading.get_ident()
        try:
            return save()
        finally:
            self._saving_in = None
            preemption.after_save()

    def _save(self, obj: Any, request: SaveRequest, wait_for_snapshot: bool) -> SaveFuture:
        self.raise_unobserved_failure()
        with gcpause.paused():  # many tensors make many objects, and no cycles
            planned = self.sink.plan(obj, request)
        if self.sink.collective:
            self.wait()  # the previous save's collectives end before this one's begin
        self._wait_for_room()
        job = self.sink.begin(planned, request)
        future = SaveFuture(request.target)
        future.add_waiter(_Owned(job))
        plans = job.files
        pinned = needs_pinned(t for f in plans for t in f.tensors)
        sizes = [f.nbytes for f in plans if f.staged]
        budget = job.budget
        whole = not budget or sum(sizes) <= budget
        pool = self.sink.pool
        try:
            upfront = pool.acquire_all(sizes, budget, pinned) if whole else []
        except BaseException as exc:
            # The job is begun: its writer must end it (abort it) all the same.
            self._hand_to_writer(future, job, StagedFiles(len(plans), 0))[1].fail(exc)
            self._snapshot_failed(future, exc)
            raise
        _, files = self._hand_to_writer(future, job, StagedFiles(
            len(plans), sum(b.numel() for b in upfront) if whole else budget, not whole))
        try:
            self._snapshot(plans, upfront, budget, pinned, request.overlap_writes or not whole,
                           files, future)
        except BaseException as exc:
            files.fail(exc)  # the writer aborts the checkpoint
            self._snapshot_failed(future, exc)
            raise
        files.close()
        future.snapshot_taken()
        if wait_for_snapshot:
            try:
                future.wait_snapshot()
            except BaseException:
                future.observe()  # (the hand-over failed: raised here, not again)
                raise
        future.snapshot_finished()
        return future

    def _hand_to_writer(self, future: SaveFuture, job: SinkJob, files: StagedFiles
                        ) -> tuple[SaveFuture, StagedFiles]:
        with self._lock:
            self._in_flight.append(future)
        self._ensure_thread()
        self._jobs.put((future, job, files))
        return future, files

    def _snapshot_failed(self, future: SaveFuture, exc: BaseException) -> None:
        """The copy failed: the caller gets this error now, not at the next save.
        A collective sink reports it in its write phase, on every rank: that
        error, which names this rank and the others', is the one raised."""
        future.snapshot_taken()
        future.observe()
        if self.sink.collective and isinstance(exc, Exception):
            future.result()

    def _snapshot(self, plans: list[FilePlan], upfront: list[Any], budget: int, pinned: bool,
                  each_as_copied: bool, files: StagedFiles, future: SaveFuture) -> None:
        """Copy the state into staging, file by file, and hand the files to the
        writer: each as soon as it is copied, or all once the copy is done.
        A snapshot larger than the budget waits for the writes of its earlier
        files to free room."""
        pool = self.sink.pool
        upfront = list(reversed(upfront))  # popped from the end, in file order
        deferred: list[StagedFile] = []  # copied, not yet handed to the writer
        try:
            for file in plans:
                if not file.staged:
                    # Written from the tensor itself while we wait.
                    files.put_and_wait(StagedFile(file.tensors, None))
                    continue
                buffer = upfront.pop() if upfront else pool.acquire(file.nbytes, budget, pinned)
                try:
                    with gcpause.paused():
                        staged = stage_file(file.tensors, buffer, pinned)
                except BaseException:
                    # Out of the budget (kept if a device copy may still land
                    # in it); the untouched ones in `upfront` go back below.
                    pool.discard(buffer, pinned)
                    raise
                future.add_waiter(staged)
                if each_as_copied:
                    files.put(staged)
                else:
                    deferred.append(staged)
            for staged in deferred:
                files.put(staged)
            deferred = []
        except BaseException:
            pool.give_back_unused(upfront, pinned)
            for staged in deferred:
                pool.give_back(staged)  # waits for its device copies
            raise

    def wait(self) -> None:
        """Block until every save handed over so far has finished (either way)."""
        with self._lock:
            pending = list(self._in_flight)
        for f in pending:
            f.outcome()  # waits; failures stay unobserved for the next save

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
        self.close_sink()
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

    def close_sink(self) -> None:
        """Let the staging go (shared-memory segments are files that would
        outlive the process) and close the sink."""
        self.sink.pool.clear()
        self.sink.close()

    def raise_unobserved_failure(self) -> None:
        """Raise the failure of a finished save whose result nobody looked at."""
        with self._lock:
            self._in_flight, failed = take_unobserved_failure(self._in_flight)
        raise_failure_of(failed)

    def _wait_for_room(self) -> None:
        while True:
            # Also prunes the finished saves, after reporting an unobserved failure.
            self.raise_unobserved_failure()
            with self._lock:
                if len(self._in_flight) < self.max_in_flight:
                    return
                oldest = self._in_flight[0]
            oldest.outcome()  # backpressure: wait for it to finish

    def _ensure_thread(self) -> None:
        # Under the lock: the first saves of two threads must not both start a
        # writer (close() stops one, and would wait for the other forever).
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="fastpersist-writer",
                                                daemon=True)
                self._thread.start()

    # -- the writer's side ------------------------------------------------------

    def _run(self) -> None:
        lower_this_thread()  # the persist yields the cores to training (background.py)
        while True:
            item = self._jobs.get()
            if item is STOP:
                return
            future, job, files = item
            self._persist(future, job, files)

    def _persist(self, future: SaveFuture, job: SinkJob, files: StagedFiles) -> None:
        future.persisting()
        error: BaseException | None = None
        try:
            job.write(files, self.sink.pool)
        except BaseException as exc:
            error = exc
        # Back in the pool before the future resolves: the next save reuses them.
        for staged in files.drain():  # each as it is put, up to the caller's last
            # Reused, or quarantined if a reader may still read it.
            self.sink.pool.give_back(staged)
        if error is None:
            future.succeed()
        else:
            future.fail(error)


__all__ = ["SavePipeline"]
