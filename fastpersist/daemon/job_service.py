"""The jobs' calls: BeginJob, a part joining its job, CommitJob, AbortJob.

A job (jobs.py) is one distributed checkpoint's staging directory; its parts
are ordinary checkpoints begun with its id (service.py). CommitJob checks the
ranks' manifest against the directory and publishes it, as a worker commits a
checkpoint (commit.Staging).

Torch-free: this runs in the daemon.
"""

from __future__ import annotations

import shutil
import threading
from pathlib import Path

from ..errors import CheckpointError
from . import logs
from .checkpoints import Checkpoint, State
from .jobs import MARKER_NAME, Job, JobState, check_job_manifest
from .registry import Registry
from .requests import RequestError, check_client, code_for, invalid, split_job


class JobService:
    def __init__(self, registry: Registry) -> None:
        self.registry = registry

    def begin_job(self, target: Path, relpath: str, client: str) -> str:
        """Make a job's directory; returns its id (DIRECTORY:SECRET)."""
        check_client(client)
        r = self.registry
        with r.cond:
            if r.draining:
                raise RequestError("UNAVAILABLE", "fastpersistd is shutting down")
            r.prune()
            r.check_target_free(target, relpath, None)
            try:
                job: Job[Checkpoint]
                job, job_id = Job.begin(target, relpath)
            except CheckpointError as exc:
                raise RequestError(code_for(exc), str(exc)) from None
            except OSError as exc:
                raise RequestError("INTERNAL", f"cannot mark the job's directory: {exc}") from None
            r.jobs[job.id] = job
        logs.info("begin-job", job=job.id, client=client, path=relpath)
        return job_id

    def join(self, target: Path, relpath: str, job_id: str) -> tuple[Job[Checkpoint], bool]:
        """The job a part belongs to, and whether it is new here: one begun by
        another node's daemon (shared storage) is taken on by its directory
        (registered by the caller once the part is accepted). Lock held."""
        r = self.registry
        name, secret = split_job(job_id)
        job = r.jobs.get(name)
        new = job is None
        if job is None:
            try:
                job = Job.join(target, relpath, name, secret)
            except LookupError as exc:
                raise RequestError("NOT_FOUND", str(exc)) from None
            except (ValueError, OSError) as exc:
                raise invalid(str(exc)) from None
        elif not job.holds(secret):
            raise RequestError("NOT_FOUND", f"no job {name!r} with that secret")
        if job.target != target:
            raise invalid(f"job {job.id} saves {job.relpath}, not {relpath}")
        r.require_open(job)
        return job, new

    def commit_job(self, job_id: str, manifest: bytes, node: str) -> None:
        """Check the job manifest against the directory, write it, publish.
        The checks and the I/O run outside the lock, as a worker's commit does;
        meanwhile `committing` keeps parts out and aborts off."""
        r = self.registry
        with r.cond:
            job = r.get_job(job_id)
            if not job.owner:
                raise RequestError("FAILED_PRECONDITION",
                                   f"job {job.id} was begun by another daemon; commit it there")
            r.require_open(job)
            unfinished = [p.rank for p in job.parts if p.state != State.COMMITTED]
            if unfinished:
                raise RequestError("FAILED_PRECONDITION",
                                   f"the parts of ranks {sorted(unfinished)[:10]} are not "
                                   "durable yet")
            job.committing = True
            job.touch()
        published = False
        try:
            try:
                check_job_manifest(job, manifest, node)
            except ValueError as exc:  # refused: the job stays open for a good manifest
                raise invalid(f"job {job.id}: {exc}") from None
            try:
                (job.staging.path / MARKER_NAME).unlink()
                replaced = job.staging.commit(manifest, remove_replaced=False)
            except (OSError, CheckpointError) as exc:
                code = code_for(exc) if isinstance(exc, CheckpointError) else "INTERNAL"
                raise RequestError(code, f"cannot commit {job.relpath}: {exc}") from None
            published = True
        except BaseException as exc:
            with r.cond:
                job.committing = False
                job.touch()
                if not (isinstance(exc, RequestError) and exc.code == "INVALID_ARGUMENT"):
                    r.abort_job(job, f"commit failed: {exc}")
                r.cond.notify_all()
            raise
        finally:
            if published:
                with r.cond:
                    job.committing = False
                    job.finish(JobState.COMMITTED)
                    r.metrics.checkpoints.labels(result="committed").inc()
                    r.cond.notify_all()
        logs.info("committed-job", job=job.id, path=job.relpath, parts=len(job.parts))
        if replaced is not None:
            # The checkpoint it replaced: removed after the reply, which must not
            # wait for a large tree to be deleted (on a crash, startup does it).
            threading.Thread(target=shutil.rmtree, args=(replaced,), kwargs={
                "ignore_errors": True}, name="fpd-remove-replaced", daemon=True).start()

    def abort_job(self, job_id: str, reason: str = "aborted by the client") -> None:
        r = self.registry
        with r.cond:
            job = r.get_job(job_id)
            if job.state == JobState.COMMITTED or job.committing:
                raise RequestError("FAILED_PRECONDITION",
                                   f"job {job_id} is committed or being committed; delete the "
                                   "checkpoint instead")
            r.abort_job(job, reason)
