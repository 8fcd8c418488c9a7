"""The jobs' calls: BeginJob, a part joining its job, CommitJob, AbortJob.

A job (jobs.py) is one distributed checkpoint's staging directory; its parts
are ordinary checkpoints begun with its id (service.py). CommitJob checks the
ranks' manifest against the directory and publishes it, as a worker commits a
checkpoint (commit.Staging); for a node-local checkpoint's part on a node
other than rank 0's, it prepares it instead, and ResolvePrepared later
publishes or discards it (prepared.py).

Torch-free: this runs in the daemon.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Mapping
from pathlib import Path

from ..errors import CheckpointError
from ..storage import dirs
from ..storage.commit import Staging, os_error
from ..storage.prepared import check_prepared_name, discard_prepared, prepare, publish_prepared
from ..storage.retention import AfterCommit
from . import logs
from .after_commit import AfterCommits, check_target, held_parent
from .budgets import parsing
from .checkpoints import Checkpoint, State
from .jobs import MARKER_NAME, Job, JobState, check_job_manifest
from .paths import RequestPath
from .registry import Registry
from .requests import RequestError, check_client, code_for, invalid, shown, split_job
from .rootfs import Root


def create_staging(root: Root, path: RequestPath) -> tuple[Staging, list[tuple[str, ...]]]:
    """A new staging directory for the checkpoint at `path`, its parents made
    where missing, all beneath the root (rootfs.py); and the parents it made."""
    parent_fd, created = root.make_parent(path.parts)
    try:
        return Staging.create_at(parent_fd, path.under(root.path)), created
    except CheckpointError as exc:
        root.remove_created(created)
        raise RequestError(code_for(exc), str(exc)) from None


class JobService:
    def __init__(self, registry: Registry, root: Root, after_commits: AfterCommits) -> None:
        self.registry = registry
        self.root = root
        self.after_commits = after_commits

    def begin_job(self, path: RequestPath, client: str) -> str:
        """Make a job's directory; returns its id (DIRECTORY:SECRET). The target
        is claimed under the lock; the directory is made without it."""
        check_client(client)
        target, relpath = path.under(self.root.path), path.text
        r = self.registry
        with r.cond:
            if r.draining:
                raise RequestError("UNAVAILABLE", "fastpersistd is shutting down")
            r.prune()
            r.check_target_free(target, relpath, None)
            r.claims[target] += 1
        job: Job[Checkpoint] | None = None
        try:
            staging, created = create_staging(self.root, path)
            try:
                job, job_id = Job.begin(staging, relpath)
            except OSError as exc:
                staging.abort()
                self.root.remove_created(created)
                error = os_error(exc, f"cannot mark the job's directory of {relpath}")
                raise RequestError(code_for(error), str(error)) from None
            job.remove_parents = lambda: self.root.remove_created(created)
        finally:
            with r.cond:
                r.claims[target] -= 1
                if not r.claims[target]:
                    del r.claims[target]
                if job is not None:
                    r.jobs[job.id] = job
                    if r.draining:
                        r.abort_job(job, "fastpersistd is shutting down")
                        raise RequestError("UNAVAILABLE", "fastpersistd is shutting down")
        logs.info("begin-job", job=job.id, client=client, path=relpath)
        return job_id

    def open_unknown(self, path: RequestPath, job_id: str) -> Job[Checkpoint] | None:
        """The job of a part, opened from its directory when this daemon does
        not know it (one begun by another node's daemon, on shared storage):
        reads the directory, so without the lock. None: known here already."""
        name, secret = split_job(job_id)
        with self.registry.cond:
            if name in self.registry.jobs:
                return None
        target, relpath = path.under(self.root.path), path.text
        try:
            parent_fd = self.root.open_dir(path.parts[:-1])
        except FileNotFoundError:
            raise RequestError("NOT_FOUND", f"no job {shown(name)}: {relpath} has no "
                                            "directory") from None
        try:
            return Job.join(parent_fd, target, relpath, name, secret)
        except LookupError as exc:
            raise RequestError("NOT_FOUND", str(exc)) from None
        except ValueError as exc:
            raise invalid(str(exc)) from None

    def attach(self, path: RequestPath, job_id: str, opened: Job[Checkpoint] | None
               ) -> Job[Checkpoint]:
        """The job a part belongs to: a known one, or the one open_unknown
        opened (which the caller registers). Lock held."""
        name, secret = split_job(job_id)
        job = self.registry.jobs.get(name) or opened
        if job is None:  # known a moment ago, forgotten since
            raise RequestError("NOT_FOUND", f"no job {shown(name)} (long finished)")
        if not job.holds(secret):
            raise RequestError("NOT_FOUND", f"no job {shown(name)} with that secret")
        if job.target != path.under(self.root.path):
            raise invalid(f"job {job.id} saves {job.relpath}, not {path.text}")
        self.registry.require_open(job)
        return job

    def commit_job(self, job_id: str, manifest: bytes, node: str,
                   after_commit: AfterCommit | None = None,
                   files: Mapping[str, bytes] | None = None) -> str:
        """Check the job manifest against the directory, write it, publish, then
        apply a Checkpointer's policy; returns what of it failed ("": nothing).
        The checks and the I/O run outside the lock, as a worker's commit does;
        meanwhile `committing` keeps parts out and aborts off. `files` (checked
        by requests.check_extra_files) are written beside the manifest, before it."""
        job = self._start_commit(job_id, after_commit)
        with held_parent(job.staging, after_commit) as parent:
            self._publish(job, manifest, node, files=files or {})
            self.after_commits.committed(job.relpath, upload=after_commit is None
                                         or after_commit.upload)
            # Jobs of one root commit in order (a distributed save waits for
            # the previous one), hence no `since`.
            return "" if after_commit is None or parent is None else self.after_commits.apply(
                parent, job.target, job.relpath, after_commit)

    def prepare_job(self, job_id: str, manifest: bytes, node: str, commit_node: str,
                    files: Mapping[str, bytes] | None = None) -> str:
        """commit_job for a node-local checkpoint's part on a node other than
        rank 0's (`commit_node`): made durable but not published; returns the
        prepared part's name, for ResolvePrepared."""
        job = self._start_commit(job_id, None)
        return self._publish(job, manifest, node, commit_node, files or {})

    def _start_commit(self, job_id: str, after_commit: AfterCommit | None) -> Job[Checkpoint]:
        """The job, checked and marked `committing`."""
        r = self.registry
        with r.cond:
            job = r.get_job(job_id)
            if after_commit is not None:
                check_target(job.target, job.relpath)
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
        return job

    def _publish(self, job: Job[Checkpoint], manifest: bytes, node: str,
                 prepare_for: str = "", files: Mapping[str, bytes] | None = None) -> str:
        """The second half of commit_job (with prepare_for: of prepare_job,
        returning the prepared part's name), without the lock."""
        r = self.registry
        published = False
        prepared, replaced = "", None
        try:
            try:
                with parsing(len(manifest)):
                    check_job_manifest(job, manifest, node)
            except ValueError as exc:  # refused: the job stays open for a good manifest
                raise invalid(f"job {job.id}: {exc}") from None
            try:
                assert job.staging.fds is not None
                # (Never a part's name: parts write data-* files only.)
                for name, data in (files or {}).items():
                    job.staging.write_file(name, data)
                os.unlink(MARKER_NAME, dir_fd=job.staging.fds.staging)
                if prepare_for:
                    prepared = prepare(job.staging, manifest, prepare_for).name
                    job.staging.close()
                else:
                    replaced = job.staging.commit(manifest, remove_replaced=False)
            except (OSError, CheckpointError) as exc:
                error = exc if isinstance(exc, CheckpointError) else os_error(
                    exc, f"cannot commit {job.relpath}")
                raise RequestError(code_for(error), f"cannot commit {job.relpath}: {exc}"
                                   ) from None
            published = True
        except BaseException as exc:
            with r.cond:
                job.committing = False
                job.touch()
                if not (isinstance(exc, RequestError) and exc.code == "INVALID_ARGUMENT"):
                    r.abort_job(job, f"commit failed: {exc}")
                r.cond.notify_all()
            r.janitor.flush()  # answer once the job's directory is gone
            raise
        finally:
            if published:
                with r.cond:
                    job.committing = False
                    job.finish(JobState.COMMITTED)
                    r.metrics.checkpoints.labels(result="committed").inc()
                    r.cond.notify_all()
        if prepare_for:
            logs.info("prepared-job", job=job.id, path=job.relpath, parts=len(job.parts),
                      prepared=prepared, commit_node=prepare_for)
        else:
            logs.info("committed-job", job=job.id, path=job.relpath, parts=len(job.parts))
        if replaced is not None:
            # The checkpoint it replaced: removed after the reply, which must not
            # wait for a large tree to be deleted (on a crash, startup does it).
            threading.Thread(target=job.staging.remove_replaced, name="fpd-remove-replaced",
                             daemon=True).start()
        return prepared

    def resolve_prepared(self, path: RequestPath, name: str, publish: bool) -> None:
        """Publish the prepared part `name` of the checkpoint at `path` (its job
        committed), or discard it (it did not): by names in the open parent,
        the target claimed meanwhile, as Delete does. The daemon never decides
        which; the job's ranks do (fastpersist/distributed/settling.py)."""
        try:
            parent_fd = self.root.open_dir(path.parts[:-1])
        except FileNotFoundError:
            raise RequestError("NOT_FOUND", f"no prepared part {shown(name)} of {path.text}: "
                                            "its directory does not exist") from None
        try:
            target = path.under(self.root.path)
            try:
                prepared = check_prepared_name(target, name, parent_fd)
            except LookupError as exc:
                raise RequestError("NOT_FOUND", str(exc)) from None
            except ValueError as exc:
                raise invalid(str(exc)) from None
            r = self.registry
            with r.cond:
                r.check_target_free(target, path.text, None)
                r.claims[target] += 1
            try:
                replaced = None
                if publish:
                    replaced = publish_prepared(prepared, target, remove_replaced=False,
                                                dir_fd=parent_fd)
                else:
                    discard_prepared(prepared, dir_fd=parent_fd)
            except CheckpointError as exc:
                raise RequestError(code_for(exc), str(exc)) from None
            finally:
                with r.cond:
                    r.claims[target] -= 1
                    if not r.claims[target]:
                        del r.claims[target]
            logs.info("published-prepared" if publish else "discarded-prepared",
                      path=path.text, prepared=name)
            if replaced is not None:
                _remove_later(replaced, parent_fd)
            if publish:
                self.after_commits.published(path.text)
        finally:
            os.close(parent_fd)

    def abort_job(self, job_id: str, reason: str = "aborted by the client") -> None:
        r = self.registry
        with r.cond:
            job = r.get_job(job_id)
            if job.state == JobState.COMMITTED or job.committing:
                raise RequestError("FAILED_PRECONDITION",
                                   f"job {shown(job.id)} is committed or being committed; "
                                   "delete the checkpoint instead")
            r.abort_job(job, reason)
        r.janitor.flush()  # answer once the job's directory is gone


def _remove_later(replaced: Path, parent_fd: int) -> None:
    """A checkpoint a publish replaced (a hidden leftover in parent_fd):
    removed after the reply, which must not wait for a large tree to be
    deleted (on a crash, startup does it)."""
    fd = os.dup(parent_fd)

    def remove() -> None:
        try:
            with contextlib.suppress(OSError):
                dirs.remove_tree(replaced.name, fd)
        finally:
            os.close(fd)

    threading.Thread(target=remove, name="fpd-remove-replaced", daemon=True).start()
