"""The daemon's checkpoints and jobs in flight, and the one lock that guards them.

Every method here is called with `cond` held (the callers in service.py,
job_service.py and writer.py take it), changes state in memory only, and
does work bounded by the number of checkpoints the daemon holds (itself
bounded: budgets.MAX_IN_FLIGHT in flight, MAX_FINISHED finished). What must
touch the disk or unmap memory once a checkpoint ends (removing its staging
directory, a job's directory) goes to the janitor, a thread of its own, so
that one slow disk never stalls the requests of every client.

Torch-free: this runs in the daemon.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

from ..errors import CheckpointError
from . import logs
from .budgets import Budgets, Ledger
from .checkpoints import KEEP_FINISHED_SECONDS, Checkpoint, State
from .jobs import Job, JobState
from .metrics import Metrics
from .requests import RequestError, shown, split_job

# Finished checkpoints kept for late Waits (by their status alone), at most.
MAX_FINISHED = 10_000  # about 0.8 KiB each (checkpoints.Checkpoint.drop_details)


class Janitor:
    """Runs clean-ups (file-system work, unmapping) one after the other on its
    own thread; a failure is logged and counted, and the next one runs."""

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics
        self._stopped = False
        self._lock = threading.Lock()
        self._queue: queue.Queue[tuple[str, Callable[[], None]] | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="fpd-janitor", daemon=True)
        self._thread.start()

    def submit(self, what: str, fn: Callable[[], None]) -> None:
        with self._lock:
            if not self._stopped:
                self._queue.put((what, fn))
                return
        self._clean(what, fn)  # shutting down: a request that came late does its own

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            self._clean(*item)

    def _clean(self, what: str, fn: Callable[[], None]) -> None:
        try:
            fn()
        except Exception as exc:
            self.metrics.housekeeping_failures.inc()
            logs.error("cleanup-failed", what=what, error=repr(exc))

    def flush(self, timeout: float = 30.0) -> None:
        """Wait (at most `timeout`) until what was submitted so far is done:
        an Abort answers once its directory is gone. Never with the lock held."""
        if self._stopped:
            return
        done = threading.Event()
        self._queue.put(("flush", done.set))
        done.wait(timeout)

    def stop(self) -> None:
        """Run what is queued, then stop."""
        with self._lock:
            self._stopped = True
            self._queue.put(None)
        self._thread.join()

    def alive(self) -> bool:
        return self._thread.is_alive()


class Registry:
    def __init__(self, budgets: Budgets, metrics: Metrics) -> None:
        self.budgets = budgets
        self.metrics = metrics
        self.cond = threading.Condition()
        self.ledger = Ledger(budgets)
        self.janitor = Janitor(metrics)
        self.checkpoints: dict[str, Checkpoint] = {}
        self.jobs: dict[str, Job[Checkpoint]] = {}
        # Targets a request works on without a checkpoint to show for it yet
        # (a BeginJob making its directory, a Delete): others keep off them.
        self.claims: Counter[Path] = Counter()
        self.served: dict[str, int] = {}  # client -> tick of its last file (fairness)
        self.tick = 0
        self.pruned_at = 0.0
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
            raise RequestError("NOT_FOUND", f"no job {shown(name)} (unknown, long finished, "
                                            "or not with that secret)")
        return job

    def in_flight(self) -> list[Checkpoint]:
        return [c for c in self.checkpoints.values() if not c.terminal]

    def busy_at(self, target: Path) -> bool:
        """Whether a checkpoint, job or claim of `target` is in flight (Delete waits)."""
        return self.claims[target] > 0 or any(
            c.target == target for c in self.checkpoints.values() if not c.terminal) or any(
            j.target == target and j.open and j.owner for j in self.jobs.values())

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
        if any(clash(p) for p, n in self.claims.items() if n):
            raise RequestError("FAILED_PRECONDITION", f"{relpath}, or a path inside it or "
                                                      "around it, is being created or deleted")

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

    def add(self, ck: Checkpoint) -> None:
        self.checkpoints[ck.id] = ck
        self.ledger.add(ck.client, ck.reserved)
        self.update_gauges()

    def discard(self, ck: Checkpoint) -> None:
        """Forget a checkpoint whose Begin failed (its client never got its id)."""
        if self.checkpoints.pop(ck.id, None) is not None and not ck.terminal:
            self.ledger.remove(ck.client, ck.reserved)
        if ck.job is not None and ck in ck.job.parts:
            ck.job.parts.remove(ck)
        self.update_gauges()
        self.cond.notify_all()

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
        self.ledger.remove(ck.client, ck.reserved)
        for pending in ck.pending:
            ck.mapped_bytes -= pending.nbytes
            self.ledger.unmap(pending.nbytes)
            self.janitor.submit("unmap", pending.data.close)
        ck.pending.clear()
        if state != State.COMMITTED:
            for stream in ck.streams.values():
                stream.cancel()  # it removes its file and lets go of the directory
        ck.drop_details()
        if state != State.COMMITTED and ck.job is not None:
            # The job cannot be committed without this part; its directory goes
            # with the job (remove_job, here or when the worker is done).
            self.abort_job(ck.job, f"the part of rank {ck.rank} is {state.name.lower()}: "
                                   f"{error}")
        elif state != State.COMMITTED and not ck.in_use:
            self.clean_up(ck)
        if ck.job is None:  # a job is counted once, when it ends
            self.metrics.checkpoints.labels(result=state.name.lower()).inc()
        if state == State.ABORTED:
            logs.info("aborted", checkpoint=ck.id, path=ck.relpath, reason=error)
        self.update_gauges()
        self.cond.notify_all()

    def clean_up(self, ck: Checkpoint) -> None:
        """Have the janitor remove a failed checkpoint's staging directory."""
        if not ck.cleaned and ck.staging is not None:
            ck.cleaned = True
            self.janitor.submit(f"remove the staging of {ck.relpath}", ck.clean_up)

    def release(self, ck: Checkpoint) -> None:
        """A worker or a stream is done with `ck`: if it failed meanwhile, its
        directory goes once nothing else writes into it."""
        if ck.job is not None:
            self.remove_job(ck.job)  # if the job was aborted meanwhile
        elif ck.terminal and ck.state != State.COMMITTED and not ck.in_use:
            self.clean_up(ck)

    def abort_job(self, job: Job[Checkpoint], reason: str) -> None:
        """A job being committed is left to its commit."""
        if not job.open or job.committing:
            return
        job.finish(JobState.ABORTED, reason)
        for part in job.parts:
            if not part.terminal:
                self.finish(part, State.ABORTED, f"job aborted: {reason}",
                            "CheckpointAbortedError")
        self.remove_job(job)
        self.metrics.checkpoints.labels(result="aborted").inc()
        logs.info("aborted-job", job=job.id, path=job.relpath, reason=reason)

    def remove_job(self, job: Job[Checkpoint]) -> None:
        """An aborted job's directory, once no worker of ours writes into it."""
        if job.take_removal():
            self.janitor.submit(f"remove the job {job.id}", job.remove)

    def update_gauges(self) -> None:
        self.metrics.in_flight.set(self.ledger.in_flight())
        self.metrics.staging_reserved.set(self.ledger.reserved())

    def prune(self) -> None:
        """Forget finished checkpoints after KEEP_FINISHED_SECONDS (the oldest
        first beyond MAX_FINISHED), their jobs, and idle clients' fairness.
        At most once a second: it sorts what it keeps."""
        now = time.monotonic()
        if now - self.pruned_at < 1.0:
            return
        self.pruned_at = now
        finished = sorted((c.finished_at, i) for i, c in self.checkpoints.items()
                          if c.finished_at is not None and not c.in_use)
        excess = len(finished) - MAX_FINISHED
        for n, (at, ident) in enumerate(finished):
            if n < excess or now - at > KEEP_FINISHED_SECONDS:
                del self.checkpoints[ident]
        for ident in [i for i, j in self.jobs.items()
                      if j.finished_at is not None and now - j.finished_at > KEEP_FINISHED_SECONDS
                      and all(p.id not in self.checkpoints for p in j.parts)]:
            job = self.jobs.pop(ident)
            if not job.owner:
                self.janitor.submit(f"forget the job {ident}", job.close)
        active = {c.client for c in self.checkpoints.values() if not c.terminal}
        self.served = {c: t for c, t in self.served.items() if c in active}
