"""Asynchronous distributed saves: async_save and Checkpointer with a process group.

save() runs the quick half of a distributed save in the caller (describe,
plan, stage: a few small collectives), copies this rank's pieces, and only
those, into staging memory, and hands the rest (write, commit) to one
background thread. The next save first waits for the previous one: every
rank must run the job's collectives in the same order, and the background
thread's and the caller's share one gloo group. That group is not the
training group, so the background exchanges never block training collectives.

With a daemon (FASTPERSIST_DAEMON, or Checkpointer's daemon=), the pieces are
copied into shared memory and each rank hands them to its node's fastpersistd
as one part of the job (storage.ThroughDaemon).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import threading
import time
import weakref
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ..errors import CheckpointAbortedError, CheckpointError, DistributedCheckpointError
from ..knobs import current as current_knobs
from ..saving.futures import SaveFuture, observe_aborts, raise_failure_of, take_unobserved_failure
from ..saving.snapshot import FilePlan, StagedFile, group_into_files, stage_file
from ..storage.retention import AfterCommit
from .coordinator import Save, coordinator_for
from .part_files import PartFiles
from .storage import ThroughDaemon, storage_for

# Through a daemon a rank's part is cut into files of at most this much (or
# FASTPERSIST_FILE_BYTES, if less): a blocking save hands each file over as
# soon as it is copied, and files this small let the daemon begin writing
# early and leave a short last copy (with 256 MiB files a rank's quarter of a
# 1 GiB state was written only once all of it was copied). Async saves through
# the daemon are cut the same way, so that both kinds reuse one set of
# shared-memory buffers (a different cut would map new segments at each switch).
DAEMON_FILE_BYTES = 64 << 20


class DistributedSaver:
    """The Saver interface (save, wait, close) for saves over a process group."""

    def __init__(self, group: dist.ProcessGroup | None, *, node_local: bool = False,
                 daemon: str = "") -> None:
        self.co = coordinator_for(group)
        self.node_local = node_local
        self.storage = storage_for(daemon)
        self._pool = self.storage.pool
        _live_savers.add(self)
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="fastpersist-dist-writer")
        self._lock = threading.Lock()
        self._futures: list[SaveFuture] = []
        self._closed = False
        self._abort = threading.Event()

    @property
    def staging_bytes(self) -> int:
        return self._pool.allocated_bytes

    def save(self, obj: Any, path: str | os.PathLike[str], *, allow_pickle: bool = False,
             wait_for_snapshot: bool = True,
             on_commit: Callable[[Path], None] | None = None,
             after_commit: AfterCommit | None = None,
             compression: str | None = None, overlap_writes: bool = False) -> SaveFuture:
        """See async_save. on_commit(path) runs on rank 0 after the commit;
        after_commit (a Checkpointer's policy) is applied by whoever commits
        the job (rank 0, or its daemon) right after the commit. Either failing
        fails the save on every rank (phase "after commit"), committed.
        overlap_writes (a blocking save, whose caller waits for the writes
        anyway): each file goes to the storage as soon as it is copied, so that
        a daemon writes one while the next is copied (DAEMON_FILE_BYTES).
        Otherwise the writes begin once the whole copy is done, and do not
        compete with it for the caller's cores."""
        if self._closed:
            raise CheckpointError("this saver is closed")
        self.raise_unobserved_failure()
        self.wait()  # the previous save's collectives end before this one's begin
        job = Save(self.co, obj, path, self.storage, node_local=self.node_local,
                   allow_pickle=allow_pickle, aborted=self._abort.is_set,
                   after_commit=after_commit, compression=compression)
        future = SaveFuture(job.target)
        job.prepare()  # raises the same error on every rank
        files: PartFiles | BaseException
        try:
            pieces = job.my_pieces()
            cap = current_knobs().file_bytes
            if isinstance(self.storage, ThroughDaemon):
                cap = min(cap, DAEMON_FILE_BYTES)
            plans = [f for f in group_into_files(pieces, 0, cap) if f.tensors]
        except Exception as exc:
            files = exc  # reported in the write phase, so that every rank fails together
        else:
            pinned = any(t.source.is_cuda for t in pieces)
            if overlap_writes:
                buffers = [self._pool.acquire(f.nbytes, 0, pinned) for f in plans]
                files = PartFiles(len(plans), sum(b.numel() for b in buffers))
                self._start_finish(job, files, future, on_commit)
                self._copy(plans, buffers, pinned, files, future)
            else:
                files = self._copied(plans, pinned, future)
        if not overlap_writes or isinstance(files, BaseException):
            self._start_finish(job, files, future, on_commit)
        future._snapshot_done.set()
        if isinstance(files, BaseException) or files.failed:
            future._observed = True
            future._future.exception()  # the job's error, raised on every rank, names it
            future.result()
        if wait_for_snapshot:
            future.wait_snapshot()
        future.snapshot_seconds = time.perf_counter() - future._started
        return future

    def _start_finish(self, job: Save, files: PartFiles | BaseException, future: SaveFuture,
                      on_commit: Callable[[Path], None] | None) -> None:
        with self._lock:
            self._futures.append(future)
        self._writer.submit(self._finish, job, files, future, on_commit)

    def _copied(self, plans: list[FilePlan], pinned: bool, future: SaveFuture
                ) -> PartFiles | BaseException:
        """Every file copied into staging, before any is written."""
        staged: list[StagedFile] = []
        buffer = None  # taken and not yet copied into
        try:
            for file in plans:
                buffer = self._pool.acquire(file.nbytes, 0, pinned)
                staged.append(stage_file(file.tensors, buffer, pinned))
                buffer = None
        except Exception as exc:
            # The other ranks go on to write: this rank reports there, so that
            # every rank fails the save together. Nothing was lent to a daemon
            # yet: the buffers go back to the pool (shared-memory segments
            # would otherwise outlive the process); the one whose copy failed
            # leaves it (StagingPool.discard).
            if buffer is not None:
                self._pool.discard(buffer, pinned)
            for f in staged:
                self._pool.give_back(f)
            return exc
        future._staged = staged
        return PartFiles.copied(staged)

    def _copy(self, plans: list[FilePlan], buffers: list[torch.Tensor], pinned: bool,
              files: PartFiles, future: SaveFuture) -> None:
        """Copy file after file into its buffer, each handed to the writer as
        soon as it is copied. A failed copy fails the part (the writer reports
        it in the write phase, on every rank); the buffer it was copying into
        leaves the pool, the ones not reached go back to it, and the files
        already handed over go back through the writer (_finish)."""
        unused = list(reversed(buffers))
        try:
            for file in plans:
                buffer = unused.pop()
                try:
                    staged = stage_file(file.tensors, buffer, pinned)
                except BaseException:
                    self._pool.discard(buffer, pinned)
                    raise
                future._staged.append(staged)
                files.put(staged)
        except BaseException as exc:
            self._pool.give_back_unused(unused, pinned)
            files.fail(exc)
            if not isinstance(exc, Exception):
                raise  # (an interrupt: the writer has failed the part)
            return
        files.close()

    def _finish(self, job: Save, files: PartFiles | BaseException, future: SaveFuture,
                on_commit: Callable[[Path], None] | None) -> None:
        future._persist_started = time.perf_counter()
        try:
            job.finish(files)
            if on_commit is not None or job.after_commit_policy is not None:
                # `latest` and retention are done; every rank returns after.
                job.after_commit(on_commit)
        except DistributedCheckpointError as exc:
            if self._abort.is_set() and set(exc.failures) == {self.co.rank}:
                # Failed only because we gave it up: to us, that is an abort.
                aborted = CheckpointAbortedError(f"save of {future.path} was aborted")
                aborted.__cause__ = exc
                future._future.set_exception(aborted)
            else:
                future._future.set_exception(exc)
        except BaseException as exc:
            future._future.set_exception(exc)
        else:
            future._future.set_result(None)
        finally:
            if isinstance(files, PartFiles):
                for f in files.taken():  # (once the caller has put its last)
                    # Reused, or quarantined if the daemon may still read it.
                    self._pool.give_back(f)
            future.persist_seconds = time.perf_counter() - future._persist_started

    def wait(self) -> None:
        """Until every save so far has finished (either way)."""
        with self._lock:
            pending = list(self._futures)
        for f in pending:
            f._future.exception()

    def raise_unobserved_failure(self) -> None:
        with self._lock:
            self._futures, failed = take_unobserved_failure(self._futures)
        raise_failure_of(failed)

    def close(self, *, abort: bool = False) -> None:
        """Finish the save in flight, or with abort give it up, and free the
        staging memory. An abort fails the job on every rank (the others get a
        DistributedCheckpointError naming this rank) and leaves nothing on
        disk, unless the save was already past its write phase: then it still
        commits. Either way this waits for the job's last exchange, so that
        the other ranks are not left waiting for this one."""
        self._closed = True
        if abort:
            self._abort.set()
        self.wait()
        self._writer.shutdown(wait=True)
        self.storage.close()
        with self._lock:
            observe_aborts(self._futures)
        self.raise_unobserved_failure()


_savers: dict[tuple[Any, bool, str], DistributedSaver] = {}


def saver_for(group: dist.ProcessGroup | None, node_local: bool, daemon: str = ""
              ) -> DistributedSaver:
    """The process-wide saver for async_save (and save, through a daemon)."""
    key = (group if group is not None else "world", node_local, daemon)
    saver = _savers.get(key)
    if saver is None or saver._closed:
        saver = _savers[key] = DistributedSaver(group, node_local=node_local, daemon=daemon)
    return saver


# Through a daemon, staging buffers are shared-memory files: they outlive a
# process that exits without unlinking them (the daemon reclaims those, but
# only while it runs). At exit, after the writer threads ended (concurrent
# futures joins them before atexit handlers run), unlink ours.
_live_savers: weakref.WeakSet[DistributedSaver] = weakref.WeakSet()


@atexit.register
def _free_staging_at_exit() -> None:
    for saver in list(_live_savers):
        with contextlib.suppress(Exception):
            saver.storage.close()
