"""The write workers: data files to disk as they arrive, then the commit.

Fairness: the workers take the next file from the client served least
recently, one file per checkpoint at a time, so one client with a large
checkpoint cannot starve another. A checkpoint whose files are all written
after Commit is committed by the worker that finds it runnable: the manifest
written last and the directory renamed into place (commit.Staging), or, for
a part of a job, its records reported (jobs.py).

Torch-free: this runs in the daemon.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import threading
import time

from .._version import __version__
from ..engine import Engine, Segment
from ..errors import CheckpointIOError, MemoryTierError
from ..format.manifest import FileRecord, Manifest, TensorRecord
from ..storage import dirs
from ..storage.commit import os_error
from . import logs
from .after_commit import AfterCommits, held_parent
from .checkpoints import Checkpoint, PendingFile, State
from .jobs import part_json
from .memory import MemoryTier
from .registry import Registry
from .requests import invalid


class Writers:
    def __init__(self, registry: Registry, engine: Engine, concurrency: int,
                 after_commits: AfterCommits, memory: MemoryTier | None = None) -> None:
        self.registry = registry
        self.memory = memory
        self.engine = engine
        self.busy = 0  # workers writing or committing (registry lock)
        self.idle_since = time.monotonic()
        self.released_at = 0.0
        self.after_commits = after_commits
        self.threads = [threading.Thread(target=self._work, name=f"fpd-writer-{i}", daemon=True)
                        for i in range(concurrency)]
        for t in self.threads:
            t.start()

    def join(self) -> None:
        for t in self.threads:
            t.join()

    def release_memory(self, idle: float = 30.0) -> None:
        """Once no file has been written for `idle` seconds (and at most that
        often), free the C engine's cached bounce buffers and have malloc give
        back what it holds free. The engine keeps its buffers for the next
        write: io_threads x block_size per file being written (8 x 2 MiB by
        default; with --write-concurrency 2, up to 32 MiB of RSS). And big
        requests parsed on many threads at once leave memory free but held by
        malloc's arenas (measured: 440 MiB of RSS after 32 clients sent 3 MB
        headers and 7 MB trees at once; deploy/README.md). A daemon idle
        between checkpoints need not hold either."""
        now = time.monotonic()
        with self.registry.cond:
            if (self.busy or now - self.idle_since < idle
                    or now - self.released_at < idle):
                return
            self.released_at = now
        try:
            from .. import _engine
        except ImportError:
            pass  # the reference engine caches nothing
        else:
            _engine.release_buffers()
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None).malloc_trim(0)  # glibc: every arena

    def _next(self) -> Checkpoint | None:
        r = self.registry
        runnable = [c for c in r.checkpoints.values() if c.runnable()]
        if not runnable:
            return None
        # Least recently served client first; within a client, oldest checkpoint.
        return min(runnable, key=lambda c: r.served.get(c.client, -1))

    def _work(self) -> None:
        while not self.registry.stopping:
            try:
                self._work_once()
            except Exception as exc:  # a bug here must not silently stop a writer
                logs.error("worker-error", error=repr(exc))

    def _work_once(self) -> None:
        r = self.registry
        while True:
            with r.cond:
                ck = self._next()
                while ck is None:
                    if r.stopping:
                        return
                    r.cond.wait()
                    ck = self._next()
                ck.busy = True
                self.busy += 1
                r.tick += 1
                r.served[ck.client] = r.tick
                job = ck.pending.popleft() if ck.pending else None
            try:
                if job is not None:
                    self._write(ck, job)
                else:
                    self._commit(ck)
            except BaseException as exc:
                with r.cond:
                    r.fail(ck, exc)
            finally:
                if job is not None:
                    job.data.close()
                with r.cond:
                    ck.busy = False
                    self.busy -= 1
                    self.idle_since = time.monotonic()
                    if job is not None:
                        ck.mapped_bytes -= job.nbytes
                        r.ledger.unmap(job.nbytes)
                    r.release(ck)
                    r.cond.notify_all()

    def _write(self, ck: Checkpoint, job: PendingFile) -> None:
        name = ck.file_name(job.index, packed=bool(ck.frame_bytes))
        if ck.memory_only:  # into the memory tier alone: no staging directory
            assert self.memory is not None
            copied = self.memory.copy_only(ck, job, name)
            with self.registry.cond:
                ck.record_file(job.index, job.data_start + job.nbytes, job.data_start,
                               job.entries, copied)
            return
        assert ck.staging is not None and ck.staging.fds is not None
        fds = ck.staging.fds
        if not dirs.is_entry(ck.staging.path.name, fds.parent, fds.staging):
            # Moved away (a job aborted by the daemon that began it) or replaced.
            raise CheckpointIOError(errno.ESTALE, f"the staging directory of {ck.relpath} was "
                                                  "moved or removed")
        views = [job.data.view[e.begin:e.end] for e in job.entries]
        started = time.perf_counter()
        # The memory tier's copy (memory.py) is made meanwhile, from the same segment.
        copying = self.memory.start_file(ck, job, name) if self.memory is not None else None
        crcs: list[int] | None = None
        try:
            if ck.frame_bytes:
                file, records = self._write_packed(name, job, views, ck.frame_bytes, fds.staging)
                size = file.size
            else:
                segments: list[Segment] = [(job.header, 0)]
                segments += [(v, job.data_start + e.begin)
                             for v, e in zip(views, job.entries, strict=True)]
                size = job.data_start + job.nbytes
                result = self.engine.write_file(name, segments, size, dir_fd=fds.staging)
                del segments
                assert result.crcs is not None
                crcs = result.crcs
        except FileExistsError:
            # Two parts of one rank (on two daemons): refuse rather than overwrite.
            raise invalid(f"{name} already exists in the staging directory of "
                          f"{ck.relpath}") from None
        except OSError as exc:
            raise os_error(exc, f"cannot save checkpoint {ck.relpath}") from exc
        finally:
            for view in views:
                view.release()
            if copying is not None:
                assert self.memory is not None
                self.memory.finish_file(ck, copying, job.index, crcs)
        seconds = time.perf_counter() - started
        r = self.registry
        r.metrics.write_seconds.observe(seconds)
        logs.debug("file-written", checkpoint=ck.id, file=name, bytes=job.nbytes,
                   seconds=round(seconds, 4))
        with r.cond:
            if ck.frame_bytes:
                ck.record_packed(job.index, file, records)
            else:
                assert crcs is not None
                ck.record_file(job.index, size, job.data_start, job.entries, crcs)
        r.metrics.bytes_written.inc(size)

    def _write_packed(self, name: str, job: PendingFile, views: list[memoryview],
                      frame_bytes: int, dir_fd: int) -> tuple[FileRecord, list[TensorRecord]]:
        """Begin's compression="zstd": the codec encodes the file's tensors (on
        its threads) and the engine writes them as the packed file `name`,
        the same bytes an in-process save with compression writes. Nothing
        made here outlives the call (it would keep the shared memory mapped).
        The codec reads the client's memory only through the engine's guarded
        copy, a frame at a time: a client that truncates its segment fails
        this checkpoint (EFAULT), where the fault would kill the daemon."""
        from ..codec import packing

        try:
            laid = packing.plan(name, [packing.RawTensor(e.name, e.dtype, e.shape, v)
                                       for e, v in zip(job.entries, views, strict=True)],
                                frame_bytes, self.engine.copy)
        except OSError as exc:
            raise OSError(exc.errno, f"reading data file {job.index} to compress it: "
                                     f"{exc.strerror}") from None
        result = self.engine.write_file(name, laid.segments, laid.size, dir_fd=dir_fd)
        assert result.crcs is not None
        return laid.records(result.crcs)

    def _commit(self, ck: Checkpoint) -> None:
        if ck.job is not None:
            self._part_durable(ck)
            return
        manifest = Manifest(
            files=tuple(ck.file_records[i] for i in range(ck.files_total)),
            tensors=tuple(ck.tensor_records[n] for n in ck.tensor_order),
            tree=ck.tree,
            fastpersist_version=__version__,
            created_unix=time.time(),
        )
        try:
            data = manifest.to_json()
        except ValueError as exc:  # NaN in a client's tree, say
            raise invalid(f"the tree cannot be written as JSON: {exc}") from None
        if ck.memory_only:
            self._memory_only(ck, data)
            return
        assert ck.staging is not None
        with held_parent(ck.staging, ck.after_commit) as parent:
            ck.staging.commit(data)
            self.after_commits.committed(ck.relpath, upload=ck.after_commit is None
                                         or ck.after_commit.upload)
            if self.memory is not None:
                self.memory.committed(ck, data)
            seconds = time.monotonic() - (ck.first_submit or time.monotonic())
            # Logged before the status says so: whoever sees COMMITTED finds the line.
            logs.info("committed", checkpoint=ck.id, path=ck.relpath, bytes=ck.bytes_written,
                      seconds=round(seconds, 3))
            # A Checkpointer's `latest` and retention: before COMMITTED is
            # reported, so that they are done even if the client is gone.
            error = "" if ck.after_commit is None or parent is None else \
                self.after_commits.apply(parent, ck.target, ck.relpath, ck.after_commit,
                                         ck.begun_unix)
        r = self.registry
        with r.cond:
            ck.after_commit_error = error
            r.finish(ck, State.COMMITTED, "", "")
            if seconds > 0:
                r.metrics.throughput.set(ck.bytes_written / seconds)

    def _memory_only(self, ck: Checkpoint, manifest: bytes) -> None:
        """Held by the memory tier as the only copy: nothing goes to disk, and
        no `latest`, retention or tier upload applies (they are the disk's)."""
        assert self.memory is not None
        why = self.memory.committed(ck, manifest, memory_only=True)
        if why:
            raise MemoryTierError(f"memory-only checkpoint {ck.relpath} is not kept in "
                                  f"memory: {why}")
        logs.info("committed", checkpoint=ck.id, path=ck.relpath, bytes=ck.bytes_written,
                  memory_only=True)
        with self.registry.cond:
            self.registry.finish(ck, State.COMMITTED, "", "")

    def _part_durable(self, ck: Checkpoint) -> None:
        """A part's files are durable in its job's directory: report their
        records (CommitJob publishes them with the rest of the job)."""
        r = self.registry
        with r.cond:
            if ck.terminal:  # its job was aborted meanwhile
                return
            records = [ck.tensor_records[n] for n in ck.tensor_order]
            ck.part_json = part_json([ck.file_records[i] for i in range(ck.files_total)],
                                     records)
            assert ck.job is not None
            ck.job.touch()
            r.finish(ck, State.COMMITTED, "", "")
        logs.info("part-written", checkpoint=ck.id, job=ck.job.id, rank=ck.rank,
                  bytes=ck.bytes_written)
