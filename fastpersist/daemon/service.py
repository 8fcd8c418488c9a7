"""What the gRPC layer calls: the daemon's checkpoints from Begin to their end.

The registry (registry.py) holds the state and its lock; the write workers
(writer.py) write and commit; this module takes requests in: Begin, Submit,
Commit, Abort, Wait/Watch, the jobs' calls (job_service.py), and the
housekeeping of idle checkpoints and shutdown.

Torch-free: this runs in the daemon.
"""

from __future__ import annotations

import os
import secrets
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from ..commit import delete_checkpoint
from ..engine import Engine, get_engine
from ..format import safetensors_file
from ..shm import Mapping
from . import logs
from .budgets import Budgets, check_fits
from .checkpoints import TERMINAL, Checkpoint, PendingFile, State
from .job_service import JobService, create_staging
from .metrics import Metrics
from .paths import RequestPath
from .registry import Registry
from .requests import (
    MAX_IN_FLIGHT_PER_CLIENT,
    RequestError,
    check_client,
    check_file_count,
    invalid,
    parse_data_file,
    parse_tree,
)
from .rootfs import Root, list_entries
from .writer import Writers


class Service:
    """Everything the gRPC layer calls; thread-safe."""

    def __init__(self, root: Root, shm_dir: Path, budgets: Budgets, metrics: Metrics,
                 write_concurrency: int = 2, idle_timeout: float = 300.0,
                 engine: Engine | None = None) -> None:
        self.root = root
        self.shm_dir = shm_dir
        self.budgets = budgets
        self.metrics = metrics
        self.idle_timeout = idle_timeout
        self.registry = Registry(budgets, metrics)
        self.jobs = JobService(self.registry, root)
        self.writers = Writers(self.registry, engine or get_engine(), write_concurrency)
        metrics.staging_budget.set(budgets.staging)

    # -- queries -----------------------------------------------------------

    def reserved(self, client: str | None = None) -> int:
        return self.registry.reserved(client)

    def in_flight(self) -> list[Checkpoint]:
        with self.registry.cond:
            return self.registry.in_flight()

    def busy_at(self, target: Path) -> bool:
        """Whether a checkpoint or job of `target` is in flight (Delete waits)."""
        with self.registry.cond:
            return self.registry.busy_at(target)

    # -- Begin ---------------------------------------------------------------

    def begin(self, path: RequestPath, client: str, staging_bytes: int,
              file_count: int, job_id: str = "", rank: int = 0) -> Checkpoint:
        check_client(client)
        check_file_count(file_count)
        target, relpath = path.under(self.root.path), path.text
        r = self.registry
        with r.cond:
            if r.draining:
                raise RequestError("UNAVAILABLE", "fastpersistd is shutting down")
            r.prune()
            mine = [c for c in r.checkpoints.values() if not c.terminal and c.client == client]
            if len(mine) >= MAX_IN_FLIGHT_PER_CLIENT:
                raise RequestError("RESOURCE_EXHAUSTED",
                                   f"client {client} has {len(mine)} checkpoints in flight, the "
                                   f"most one client may have")
            job, new_job = self.jobs.join(path, job_id) if job_id else (None, False)
            r.check_target_free(target, relpath, job)
            if job is not None and any(p.rank == rank and p.state not in (
                    State.FAILED, State.ABORTED) for p in job.parts):
                raise invalid(f"rank {rank} already has a part in job {job.id}")
            check_fits(self.budgets, r.checkpoints.values(), client, staging_bytes)
            created: list[tuple[str, ...]] = []
            if job is not None:
                staging = job.staging
            else:
                staging, created = create_staging(self.root, path)
            ck = Checkpoint(secrets.token_hex(12), client, target, relpath, staging, file_count,
                            staging_bytes, job, rank)
            ck.remove_parents = lambda: self.root.remove_created(created)
            if job is not None:
                if new_job:
                    r.jobs[job.id] = job
                job.parts.append(ck)
                job.touch()
            r.checkpoints[ck.id] = ck
            r.update_gauges()
        logs.info("begin", checkpoint=ck.id, client=client, path=relpath, files=file_count,
                  staging_bytes=staging_bytes, **({"job": job.id, "rank": rank} if job else {}))
        return ck

    # -- Submit ----------------------------------------------------------------

    def check_submit(self, ident: str, index: int, header: bytes, data_length: int
                     ) -> tuple[Checkpoint, list[safetensors_file.ParsedEntry]]:
        """Validate a submission before its data is mapped or received."""
        r = self.registry
        with r.cond:
            ck = r.get(ident)
            r.require_receiving(ck, "submit a file to")
            entries = parse_data_file(index, header, data_length, ck.files_total)
            if index in ck.submitted:
                raise invalid(f"data file {index} was already submitted")
            dup = next((e.name for e in entries if e.name in ck.names), None)
            if dup is not None:
                raise invalid(f"tensor {dup!r} is already in another data file")
            if ck.mapped_bytes + data_length > ck.reserved:
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
                if index in ck.submitted:
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
            ck.bytes_total += len(header) + len(data.view)
            ck.pending.append(PendingFile(index, header, entries, data))
            ck.last_activity = time.monotonic()
            if ck.first_submit is None:
                ck.first_submit = time.monotonic()
            r.cond.notify_all()

    # -- Commit / Abort --------------------------------------------------------

    def commit(self, ident: str, tree_json: str, tensor_order: list[str]) -> None:
        tree = parse_tree(tree_json)
        r = self.registry
        with r.cond:
            ck = r.get(ident)
            r.require_receiving(ck, "commit")
            missing = sorted(set(range(ck.files_total)) - ck.submitted)
            if missing:
                raise RequestError("FAILED_PRECONDITION",
                                   f"data files {missing[:10]} were not submitted")
            if len(tensor_order) != len(ck.names) or set(tensor_order) != ck.names:
                raise invalid(f"tensor_order lists {len(tensor_order)} names; the data files "
                              f"hold {len(ck.names)} different ones")
            ck.tree = tree
            ck.tensor_order = list(tensor_order)
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

    # -- jobs (job_service.py) ----------------------------------------------------

    def begin_job(self, path: RequestPath, client: str) -> str:
        return self.jobs.begin_job(path, client)

    def commit_job(self, job_id: str, manifest: bytes, node: str) -> None:
        self.jobs.commit_job(job_id, manifest, node)

    def abort_job(self, job_id: str, reason: str = "aborted by the client") -> None:
        self.jobs.abort_job(job_id, reason)

    # -- List / Delete -----------------------------------------------------------

    def list(self, path: RequestPath) -> tuple[list[tuple[str, str, int, float]],
                                               list[Checkpoint]]:
        """The checkpoints in the directory `path` (rootfs.list_entries) and the
        ones in flight anywhere under it."""
        try:
            fd = self.root.open_dir(path.parts)
        except (FileNotFoundError, NotADirectoryError):
            raise RequestError("NOT_FOUND", f"{path.text or '.'} is not a directory") from None
        try:
            entries = list(list_entries(fd))
        finally:
            os.close(fd)
        directory = path.under(self.root.path)
        with self.registry.cond:
            in_flight = [c for c in self.registry.in_flight() if directory in c.target.parents]
        return entries, in_flight

    def delete(self, path: RequestPath) -> None:
        """Delete the committed checkpoint at `path` (commit.delete_checkpoint),
        by its name in its directory, held open."""
        not_found = RequestError("NOT_FOUND", f"{path.text} is not a committed checkpoint")
        try:
            parent_fd = self.root.open_dir(path.parts[:-1])
        except FileNotFoundError:
            raise not_found from None
        try:
            try:
                os.close(self.root.checkpoint_dir(parent_fd, path.parts[-1]))
            except FileNotFoundError:
                raise not_found from None
            if self.busy_at(path.under(self.root.path)):
                raise RequestError("FAILED_PRECONDITION",
                                   f"a checkpoint of {path.text} is in flight")
            delete_checkpoint(path.under(self.root.path), dir_fd=parent_fd)
        finally:
            os.close(parent_fd)
        logs.info("deleted", path=path.text)

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
            last: dict[str, Any] | None = None
        try:
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
        finally:
            self.watch_ended(ck)

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
        """Abort checkpoints nobody watches and nobody has touched for idle_timeout."""
        now = time.monotonic()
        r = self.registry
        with r.cond:
            for ck in list(r.checkpoints.values()):
                if (not ck.terminal and not ck.handed_over and ck.watchers == 0
                        and now - ck.last_activity > self.idle_timeout):
                    logs.warning("idle-abort", checkpoint=ck.id, client=ck.client)
                    r.finish(ck, State.ABORTED,
                             f"no request for {self.idle_timeout:.0f} s before Commit",
                             "CheckpointAbortedError")
            for job in list(r.jobs.values()):
                idle = job.idle_seconds(now)
                if idle is not None and idle > self.idle_timeout and not job.owner:
                    # Its parts here are written; the daemon that began it commits it
                    # (a later part of this node takes it on again by its id).
                    del r.jobs[job.id]
                    job.close()
                    logs.debug("forgot-job", job=job.id, path=job.relpath)
                elif idle is not None and idle > self.idle_timeout:
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
            while any(not c.terminal or c.busy for c in r.checkpoints.values()) or any(
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
        return True
