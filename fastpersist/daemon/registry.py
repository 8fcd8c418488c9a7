"""The daemon's checkpoints and jobs in flight, and the one lock that guards them.

Every method here is called with `cond` held (the callers in service.py and
writer.py take it) and changes state in memory only.

Torch-free: this runs in the daemon.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

from ..errors import CheckpointError
from . import logs
from .budgets import Budgets, reserved
from .checkpoints import KEEP_FINISHED_SECONDS, Checkpoint, State
from .jobs import Job, JobState
from .metrics import Metrics
from .requests import RequestError, shown, split_job


class Registry:
    def __init__(self, budgets: Budgets, metrics: Metrics) -> None:
        self.budgets = budgets
        self.metrics = metrics
        self.cond = threading.Condition()
        self.checkpoints: dict[str, Checkpoint] = {}
        self.jobs: dict[str, Job[Checkpoint]] = {}
        self.served: dict[str, int] = {}  # client -> tick of its last file (fairness)
        self.tick = 0
        self.stopping = False
        self.draining = False

    # -- lookups -------------------------------------------------------------

    def get(self, ident: str) -> Checkpoint:
        ck = self.checkpoints.get(ident)
        if ck is None:
            raise RequestError("NOT_FOUND", f"no checkpoint {shown(ident)} (unknown or long "
                                            "finished)")
        return ck

    def get_job(self, job_id: str) -> Job[Checkpoint]:
        """The job with this id (DIRECTORY:SECRET); NOT_FOUND without the right secret."""
        name, secret = split_job(job_id)
        job = self.jobs.get(name)
        if job is None or not job.holds(secret):
            raise RequestError("NOT_FOUND", f"no job {name!r} (unknown, long finished, or "
                                            "not with that secret)")
        return job

    def in_flight(self) -> list[Checkpoint]:
        return [c for c in self.checkpoints.values() if not c.terminal]

    def reserved(self, client: str | None = None) -> int:
        return reserved(self.checkpoints.values(), client)

    def busy_at(self, target: Path) -> bool:
        """Whether a checkpoint or job of `target` is in flight (Delete waits)."""
        return any(c.target == target for c in self.checkpoints.values()
                   if not c.terminal) or any(j.target == target and j.open and j.owner
                                             for j in self.jobs.values())

    def check_target_free(self, target: Path, relpath: str, job: Job[Checkpoint] | None) -> None:
        """No other save of, inside or around `target` in flight (but the parts
        of one job share it). In memory: a path inside a committed checkpoint is
        refused by rootfs.Root.make_parent, on disk."""
        def clash(other: Path) -> bool:
            return other == target or other in target.parents or target in other.parents

        for c in self.checkpoints.values():
            if not c.terminal and clash(c.target) and (job is None or c.job is not job):
                raise RequestError(
                    "FAILED_PRECONDITION",
                    f"a checkpoint of {c.relpath} is in flight; {relpath} may not be it, "
                    "inside it or around it")
        # A job another daemon began is that daemon's to guard (and to finish:
        # this one never learns when it is committed).
        for j in self.jobs.values():
            if j.open and j.owner and clash(j.target) and j is not job:
                raise RequestError(
                    "FAILED_PRECONDITION",
                    f"a distributed checkpoint of {j.relpath} is in flight; {relpath} may not "
                    "be it, inside it or around it")

    # -- checks ----------------------------------------------------------------

    def require_receiving(self, ck: Checkpoint, what: str) -> None:
        if ck.state != State.RECEIVING:
            raise RequestError("FAILED_PRECONDITION",
                               f"cannot {what} checkpoint {ck.id}: it is {ck.state.name.lower()}")

    def require_open(self, job: Job[Checkpoint]) -> None:
        if not job.open or job.committing:
            state = "being committed" if job.open else job.state.value
            raise RequestError("FAILED_PRECONDITION", f"job {job.id} is {state}" + (
                f": {job.error}" if job.error else ""))

    # -- transitions --------------------------------------------------------------

    def fail(self, ck: Checkpoint, exc: BaseException) -> None:
        code = type(exc).__name__ if isinstance(exc, CheckpointError) else "CheckpointError"
        logs.error("failed", checkpoint=ck.id, path=ck.relpath, error=str(exc), code=code)
        self.finish(ck, State.FAILED, str(exc), code)

    def finish(self, ck: Checkpoint, state: State, error: str, code: str) -> None:
        if ck.terminal:
            return
        ck.state = state
        ck.error = error
        ck.error_code = code
        ck.finished_at = time.monotonic()
        for job in ck.pending:
            ck.mapped_bytes -= job.nbytes
            job.data.close()
        ck.pending.clear()
        if state != State.COMMITTED and ck.job is not None:
            # The job cannot be committed without this part; its directory goes
            # with the job (Job.remove_if_idle, here or when the worker is done).
            self.abort_job(ck.job, f"the part of rank {ck.rank} is {state.name.lower()}: "
                                   f"{error}")
        elif state != State.COMMITTED and not ck.busy:
            ck.clean_up()
        if ck.job is None:  # a job is counted once, when it ends
            self.metrics.checkpoints.labels(result=state.name.lower()).inc()
        if state == State.ABORTED:
            logs.info("aborted", checkpoint=ck.id, path=ck.relpath, reason=error)
        self.update_gauges()
        self.cond.notify_all()

    def abort_job(self, job: Job[Checkpoint], reason: str) -> None:
        """A job being committed is left to its commit."""
        if not job.open or job.committing:
            return
        job.finish(JobState.ABORTED, reason)
        for part in job.parts:
            if not part.terminal:
                self.finish(part, State.ABORTED, f"job aborted: {reason}",
                            "CheckpointAbortedError")
        job.remove_if_idle()
        self.metrics.checkpoints.labels(result="aborted").inc()
        logs.info("aborted-job", job=job.id, path=job.relpath, reason=reason)

    def update_gauges(self) -> None:
        self.metrics.in_flight.set(sum(1 for c in self.checkpoints.values() if not c.terminal))
        self.metrics.staging_reserved.set(self.reserved())

    def prune(self) -> None:
        now = time.monotonic()
        for ident in [i for i, c in self.checkpoints.items()
                      if c.finished_at is not None and not c.busy
                      and now - c.finished_at > KEEP_FINISHED_SECONDS]:
            del self.checkpoints[ident]
        for ident in [i for i, j in self.jobs.items()
                      if j.finished_at is not None and now - j.finished_at > KEEP_FINISHED_SECONDS
                      and all(p.id not in self.checkpoints for p in j.parts)]:
            self.jobs.pop(ident).close()
