"""A save's future, and what happens to failures nobody looked at.

The caller's side of SaveFuture is result(), exception(), done(),
wait_snapshot() and the timings. The save pipeline (pipeline.py) drives its
life cycle through the methods under "the pipeline's side", in this order:

    add_waiter(w)*      something wait_snapshot() must also wait for (a
                        staged file's device copies, a daemon's hand-over)
    snapshot_taken()    every copy is queued: wait_snapshot() may return
    persisting()        the writer took the save
    succeed() | fail(e) the outcome: result() returns or raises

A failed save whose result() nobody called is raised at the next save or at
close: take_unobserved_failure / raise_failure_of. observe() marks a failure
as reported already (the caller got it raised at once).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any, Protocol

from ..errors import CheckpointAbortedError, CheckpointError
from ..tier.url import TierURL

# Put on a saver's queues: no more items (the end of a save's files, or of the
# writer thread's jobs).
STOP = object()


class Waiter(Protocol):
    def wait_copied(self) -> None: ...


class SaveFuture:
    """The result of async_save. `result()` returns once the checkpoint is durable."""

    def __init__(self, path: Path | TierURL) -> None:  # a URL: saved to a store
        self.path = path
        self._future: Future[None] = Future()
        self._snapshot_done = threading.Event()
        self._waiters: list[Waiter] = []
        self._observed = False
        self._started = time.perf_counter()
        self._persist_started: float | None = None
        self.snapshot_seconds: float | None = None
        self.persist_seconds: float | None = None

    # -- the caller's side --------------------------------------------------

    def done(self) -> bool:
        return self._future.done()

    def result(self, timeout: float | None = None) -> None:
        """Block until the checkpoint is durable; re-raise a background failure."""
        self._observed = True
        self._future.result(timeout)

    def exception(self, timeout: float | None = None) -> BaseException | None:
        self._observed = True
        return self._future.exception(timeout)

    def wait_snapshot(self, timeout: float | None = None) -> None:
        """Block until every tensor is copied into staging memory; after this
        the caller may mutate the state (e.g. optimizer.step())."""
        if not self._snapshot_done.wait(timeout):
            raise TimeoutError(f"snapshot of {self.path} not finished after {timeout} s")
        for waiter in list(self._waiters):
            waiter.wait_copied()

    def add_done_callback(self, fn: Callable[[SaveFuture], Any]) -> None:
        self._future.add_done_callback(lambda _: fn(self))

    def __repr__(self) -> str:
        status = "done" if self.done() else "pending"
        return f"<SaveFuture {self.path} {status}>"

    # -- the pipeline's side ------------------------------------------------

    def add_waiter(self, waiter: Waiter) -> None:
        self._waiters.append(waiter)

    def snapshot_taken(self) -> None:
        self._snapshot_done.set()

    def snapshot_finished(self) -> None:
        """The caller's part is over (what snapshot_seconds measures)."""
        self.snapshot_seconds = time.perf_counter() - self._started

    def persisting(self) -> None:
        self._persist_started = time.perf_counter()

    def succeed(self) -> None:
        self._stop_clock()
        self._waiters = []  # every copy is done; do not pin the buffers' views
        self._future.set_result(None)

    def fail(self, exc: BaseException) -> None:
        self._stop_clock()
        self._future.set_exception(exc)

    def observe(self) -> None:
        """Its failure has been (or is being) raised to the caller: not again."""
        self._observed = True

    @property
    def observed(self) -> bool:
        return self._observed

    def outcome(self) -> BaseException | None:
        """Wait for the save to end; its failure, if any, without marking it
        observed (an unobserved failure is still raised at the next save)."""
        return self._future.exception()

    def _stop_clock(self) -> None:
        if self._persist_started is not None:
            self.persist_seconds = time.perf_counter() - self._persist_started


def take_unobserved_failure(futures: list[SaveFuture]
                            ) -> tuple[list[SaveFuture], SaveFuture | None]:
    """The saves still running, and the first finished one that failed without
    anybody looking (marked as looked at now, so it is reported once)."""
    failed = [f for f in futures if f.done() and not f.observed and f.outcome() is not None]
    for f in failed:
        f.observe()
    return [f for f in futures if not f.done()], failed[0] if failed else None


def observe_aborts(futures: list[SaveFuture]) -> None:
    """close(abort=True): an aborted save's CheckpointAbortedError is what the
    caller asked for, not a failure to raise at close."""
    for f in futures:
        if isinstance(f.outcome(), CheckpointAbortedError):
            f.observe()


def raise_failure_of(failed: SaveFuture | None) -> None:
    """Raise an unobserved failure (take_unobserved_failure) in the caller's thread."""
    if failed is not None:
        exc = failed.outcome()
        raise CheckpointError(
            f"an earlier async save to {failed.path} failed and nobody called its "
            f"result(): {exc}"
        ) from exc
