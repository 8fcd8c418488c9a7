"""What the gRPC layer calls: the daemon's checkpoints from Begin to their end.

The registry (registry.py) holds the state and its lock; the write workers
(writer.py) write and commit; this module takes requests in: Begin, Submit,
Commit, Abort, Wait/Watch, and the housekeeping of idle checkpoints and
shutdown. The jobs' calls are `self.jobs` (job_service.py), List and Delete
`self.catalog` (catalog.py).

Torch-free: this runs in the daemon.
"""

from __future__ import annotations

import os
import secrets
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from ..engine import Engine, get_engine
from ..format import safetensors_file
from ..protocol.shm import Mapping
from ..storage.retention import AfterCommit
from . import large_requests, logs
from .after_commit import AfterCommits, check_target
from .budgets import DEFAULT_STREAMS, Budgets, parsing, stream_block
from .catalog import Catalog
from .checkpoints import TERMINAL, Checkpoint, PendingFile, State
from .job_service import JobService, create_staging
from .memory import MemoryTier
from .metrics import Metrics
from .paths import RequestPath
from .registry import Registry
from .requests import (
    RequestError,
    check_client,
    check_compression,
    check_durability,
    check_file_count,
    invalid,
    parse_data_file,
    parse_tree,
)
from .rootfs import Entry, Root, manifest_at
from .stream_file import Slots
from .streams import Streams
from .tiering import DaemonTier
from .writer import Writers


class Service:
    """Everything the gRPC layer calls; thread-safe."""

    def __init__(self, root: Root, shm_dir: Path, budgets: Budgets, metrics: Metrics,
                 write_concurrency: int = 2, idle_timeout: float = 300.0,
                 engine: Engine | None = None, max_streams: int = DEFAULT_STREAMS,
                 tier: DaemonTier | None = None, memory: MemoryTier | None = None) -> None:
        self.root = root
        self.shm_dir = shm_dir
        # Segments are opened by name in the directory held open (shm.open_range).
        self.shm_fd = os.open(shm_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        self.budgets, self.metrics = budgets, metrics
        self.idle_timeout = idle_timeout
        self.registry = Registry(budgets, metrics)
        self.tier, self.memory = tier, memory  # memory: None when off
        self.after_commits = after_commits = AfterCommits(metrics, tier, self.memory)
        self.jobs = JobService(self.registry, root, after_commits)
        self.catalog = Catalog(self.registry, root, self.memory)
        self.writers = Writers(self.registry, engine or get_engine(), write_concurrency,
                               after_commits, self.memory)
        self.streams = Streams(self.registry, Slots(max_streams, stream_block()))
        metrics.staging_budget.set(budgets.staging)

    # -- queries -----------------------------------------------------------

    def snapshot(self) -> tuple[int, int, int, int]:
        """(staging reserved, checkpoints in flight, the most reserved and the
        most mapped at once since the start), consistent with each other."""
        with self.registry.cond:
            ledger = self.registry.ledger
            return ledger.reserved(), ledger.in_flight(), ledger.peak, ledger.mapped_peak

    def in_flight(self) -> list[Checkpoint]:
        with self.registry.cond:
            return self.registry.in_flight()

    # -- Begin ---------------------------------------------------------------

    def begin(self, path: RequestPath, client: str, staging_bytes: int,
              file_count: int, job_id: str = "", rank: int = 0, *, leased: bool = False,
              compression: str = "", frame_bytes: int = 0, durability: str = "") -> Checkpoint:
        """Reserve the target and the staging under the lock; make the staging
        directory without it (a slow disk must not stall other requests); then
        hand out the id, unless the daemon began to drain meanwhile. leased:
        the request's stream is the client's lease (Open): the checkpoint is
        born watched, and watch_ended() must follow when the stream ends.
        durability="memory": kept in the memory tier alone (memory.py)."""
        check_client(client)
        check_file_count(file_count)
        frame_bytes = check_compression(compression, frame_bytes)
        memory_only = check_durability(durability, job_id, frame_bytes,
                                       self.memory is not None and self.memory.enabled)
        if memory_only and manifest_at(self.root, path) is not None:
            raise RequestError("ALREADY_EXISTS", f"a checkpoint is committed on disk at {path.text}"
                                                 "; a memory-only save may not shadow it")
        target, relpath = path.under(self.root.path), path.text
        r = self.registry
        joined = self.jobs.open_unknown(path, job_id) if job_id else None
        try:
            with r.cond:
                if r.draining:
                    raise RequestError("UNAVAILABLE", "fastpersistd is shutting down")
                r.prune()
                r.ledger.check(client, staging_bytes)
                job = self.jobs.attach(path, job_id, joined) if job_id else None
                r.check_target_free(target, relpath, job)
                if job is not None and any(p.rank == rank and p.state not in (
                        State.FAILED, State.ABORTED) for p in job.parts):
                    raise invalid(f"rank {rank} already has a part in job {job.id}")
                ck = Checkpoint(secrets.token_hex(12), client, target, relpath,
                                job.staging if job else None, file_count, staging_bytes, job,
                                rank, frame_bytes, memory_only)
                if job is not None:
                    if job is joined:
                        r.jobs[job.id] = job
                        joined = None
                    job.parts.append(ck)
                    job.touch()
                # Counted before anybody can see it: there is no moment in which
                # the checkpoint exists and its client's death would go unnoticed.
                ck.watchers = 1 if leased else 0
                r.add(ck)
        finally:
            if joined is not None:  # not taken on: refused, or another request was first
                joined.close()
        if ck.staging is None and not memory_only:
            self._make_staging(ck, path)
        logs.info("begin", checkpoint=ck.id, client=client, path=relpath, files=file_count,
                  staging_bytes=staging_bytes, **({"job": job.id, "rank": rank} if job else {}))
        return ck

    def _make_staging(self, ck: Checkpoint, path: RequestPath) -> None:
        r = self.registry
        try:
            staging, created = create_staging(self.root, path)
        except BaseException:
            with r.cond:
                r.discard(ck)
            raise
        with r.cond:
            ck.staging = staging
            ck.remove_parents = lambda: self.root.remove_created(created)
            if ck.terminal:  # drained meanwhile
                r.clean_up(ck)
                raise RequestError("UNAVAILABLE", "fastpersistd is shutting down")

    # -- Submit ----------------------------------------------------------------

    def check_submit(self, ident: str, index: int, header: bytes, data_length: int,
                     streamed: bool = False
                     ) -> tuple[Checkpoint, list[safetensors_file.ParsedEntry]]:
        """Validate a submission before its data is mapped or received. A
        streamed file is not held in memory (streams.py): it needs no staging."""
        r = self.registry
        with r.cond:
            ck = r.get(ident)
            r.require_receiving(ck, "submit a file to")
        # Linear in the header (bounded): parsed without the lock.
        with parsing(len(header)):
            entries = parse_data_file(index, header, data_length, ck.files_total)
        with r.cond:
            r.require_receiving(ck, "submit a file to")
            if index in ck.submitted or index in ck.streams:
                raise invalid(f"data file {index} was already submitted")
            dup = next((e.name for e in entries if e.name in ck.names), None)
            if dup is not None:
                raise invalid(f"tensor {dup!r} is already in another data file")
            if streamed and ck.memory_only:  # a streamed file is written to disk as it comes
                raise invalid("a memory-only checkpoint takes its files in shared memory only "
                              "(a tensor larger than the staging budget cannot be memory-only)")
            if not streamed and ck.mapped_bytes + data_length > ck.reserved:
                raise RequestError(
                    "RESOURCE_EXHAUSTED",
                    f"data file {index} ({data_length} bytes) would exceed the {ck.reserved} "
                    f"bytes of staging reserved at Begin ({ck.mapped_bytes} are still being "
                    "written)")
            return ck, entries

    def submit(self, ck: Checkpoint, index: int, header: bytes,
               entries: list[safetensors_file.ParsedEntry], data: Mapping) -> None:
        r = self.registry
        with r.cond:
            try:
                r.require_receiving(ck, "submit a file to")
                if index in ck.submitted or index in ck.streams:
                    raise invalid(f"data file {index} was already submitted")
                dup = next((e.name for e in entries if e.name in ck.names), None)
                if dup is not None:
                    raise invalid(f"tensor {dup!r} is already in another data file")
                if ck.mapped_bytes + len(data.view) > ck.reserved:
                    raise RequestError("RESOURCE_EXHAUSTED",
                                       f"data file {index} would exceed the checkpoint's "
                                       f"reserved staging of {ck.reserved} bytes")
            except RequestError:
                data.close()
                raise
            ck.submitted.add(index)
            ck.names.update(e.name for e in entries)
            ck.mapped_bytes += len(data.view)
            r.ledger.map(len(data.view))
            ck.bytes_total += len(header) + len(data.view)
            ck.pending.append(PendingFile(index, header, entries, data))
            ck.last_activity = time.monotonic()
            if ck.first_submit is None:
                ck.first_submit = time.monotonic()
            r.cond.notify_all()

    # -- Commit / Abort --------------------------------------------------------

    def commit(self, ident: str, tree_json: str, tensor_order: list[str],
               after_commit: AfterCommit | None = None) -> None:
        with parsing(len(tree_json)):
            tree = parse_tree(tree_json)
        r = self.registry
        with r.cond:
            ck = r.get(ident)
            r.require_receiving(ck, "commit")
            if after_commit is not None:
                if ck.job is not None:
                    raise invalid("a part of a job takes no after_commit; CommitJob does")
                check_target(ck.target, ck.relpath)
            if len(ck.submitted) != ck.files_total:
                missing = [i for i in range(ck.files_total) if i not in ck.submitted][:10]
                raise RequestError("FAILED_PRECONDITION",
                                   f"data files {missing} were not submitted")
            # Every file is in: the names cannot change any more (a file is
            # submitted once), so they are compared without the lock.
            names = ck.names
        same = len(tensor_order) == len(names) and set(tensor_order) == names
        with r.cond:
            r.require_receiving(ck, "commit")
            if not same:
                raise invalid(f"tensor_order lists {len(tensor_order)} names; the data files "
                              f"hold {len(names)} different ones")
            ck.tree = tree
            ck.tensor_order = list(tensor_order)
            ck.after_commit = after_commit
            ck.handed_over = True
            ck.state = State.WRITING
            ck.last_activity = time.monotonic()
            if ck.job is not None:
                ck.job.touch()
            r.cond.notify_all()
        logs.info("handed-over", checkpoint=ident, path=ck.relpath)

    def abort(self, ident: str, reason: str = "aborted by the client") -> None:
        r = self.registry
        with r.cond:
            ck = r.get(ident)
            if ck.state in (State.ABORTED, State.FAILED):
                return  # already gone: aborting again is a no-op
            if ck.handed_over:
                raise RequestError("FAILED_PRECONDITION",
                                   f"checkpoint {ident} was handed over (Commit); it cannot be "
                                   "aborted")
            r.finish(ck, State.ABORTED, reason, "CheckpointAbortedError")
        r.janitor.flush()  # answer once its staging directory is gone

    # -- List / Delete (catalog.py) ----------------------------------------------

    def list(self, path: RequestPath) -> tuple[list[Entry],
                                               list[Checkpoint]]:
        return self.catalog.list(path)

    def delete(self, path: RequestPath) -> None:
        self.catalog.delete(path)

    # -- Wait / Watch ----------------------------------------------------------

    def wait(self, ident: str, min_files: int = 0, *, alive: Callable[[], bool] = lambda: True
             ) -> dict[str, Any]:
        r = self.registry
        with r.cond:
            ck = r.get(ident)
            while not ck.terminal and not (min_files and ck.files_written >= min_files):
                if not alive():
                    break
                r.cond.wait(1.0)
            return ck.status()

    def watch(self, ident: str, alive: Callable[[], bool]) -> Iterator[dict[str, Any]]:
        """Statuses as they change, ending with a terminal one. While a watch is
        open the client is taken to be alive; see watch_ended."""
        r = self.registry
        with r.cond:
            ck = r.get(ident)
            ck.watchers += 1
        try:
            yield from self.follow(ck, alive)
        finally:
            self.watch_ended(ck)

    def follow(self, ck: Checkpoint, alive: Callable[[], bool],
               last: dict[str, Any] | None = None) -> Iterator[dict[str, Any]]:
        """ck's statuses from the first that differs from `last`, until a
        terminal one or until alive() turns false (checked every second)."""
        r = self.registry
        while True:
            with r.cond:
                status = ck.status()
                while status == last and alive():
                    r.cond.wait(1.0)
                    status = ck.status()
            if not alive():
                return
            last = status
            yield status
            if status["state"] in TERMINAL:
                return

    def watch_ended(self, ck: Checkpoint) -> None:
        r = self.registry
        with r.cond:
            ck.watchers -= 1
            if ck.watchers == 0 and not ck.handed_over and not ck.terminal:
                logs.warning("client-gone", checkpoint=ck.id, client=ck.client, path=ck.relpath)
                r.finish(ck, State.ABORTED,
                         "the client went away before handing the checkpoint over",
                         "CheckpointAbortedError")

    def reap_idle(self) -> None:
        """Abort checkpoints nobody watches and nobody has touched for
        idle_timeout, and jobs no rank committed. Housekeeping; the jobs'
        directories are looked at without the lock."""
        now = time.monotonic()
        r = self.registry
        with r.cond:
            r.prune()
            self.streams.reap_stalled(now, self.idle_timeout)
            large_requests.reap_stalled(now, self.idle_timeout)
            for ck in list(r.checkpoints.values()):
                if (not ck.terminal and not ck.handed_over and ck.watchers == 0
                        and now - ck.last_activity > self.idle_timeout):
                    logs.warning("idle-abort", checkpoint=ck.id, client=ck.client)
                    r.finish(ck, State.ABORTED,
                             f"no request for {self.idle_timeout:.0f} s before Commit",
                             "CheckpointAbortedError")
            quiet = [j for j in r.jobs.values() if j.quiet()
                     and now - j.last_activity > self.idle_timeout]
        writes = [j.newest_write() for j in quiet]
        with r.cond:
            for job, newest in zip(quiet, writes, strict=True):
                idle = job.idle_seconds(now, newest)
                if r.jobs.get(job.id) is not job or idle is None or idle <= self.idle_timeout:
                    continue
                if not job.owner:
                    # Its parts here are written; the daemon that began it commits it
                    # (a later part of this node takes it on again by its id).
                    del r.jobs[job.id]
                    r.janitor.submit(f"forget the job {job.id}", job.close)
                    logs.debug("forgot-job", job=job.id, path=job.relpath)
                else:
                    logs.warning("idle-abort-job", job=job.id, path=job.relpath)
                    r.abort_job(job, f"no rank committed it for {self.idle_timeout:.0f} s "
                                     "after its parts were written")

    # -- shutdown ----------------------------------------------------------------

    def drain(self, timeout: float | None = None) -> bool:
        """Refuse new checkpoints, abort the ones not handed over, finish the
        rest. True if everything finished within timeout."""
        deadline = None if timeout is None else time.monotonic() + timeout
        r = self.registry
        with r.cond:
            r.draining = True
            for ck in list(r.checkpoints.values()):
                if not ck.terminal and not ck.handed_over:
                    r.finish(ck, State.ABORTED, "fastpersistd is shutting down",
                             "CheckpointAbortedError")
            while any(not c.terminal or c.in_use for c in r.checkpoints.values()) or any(
                    j.committing for j in r.jobs.values()):
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                r.cond.wait(left if left is not None else 1.0)
            # Only the ranks can commit a job (they hold its manifest); the ones
            # not committed by now are dropped with the daemon.
            for job in list(r.jobs.values()):
                r.abort_job(job, "fastpersistd is shutting down")
            r.stopping = True
            r.cond.notify_all()
        self.writers.join()
        r.janitor.stop()  # the clean-ups decided until now
        return True
