"""A save's future, and what happens to failures nobody looked at.

Every saver (in-process, through the daemon, distributed) returns a
SaveFuture and reports a failed save whose result() nobody called at the
next save or at close: take_unobserved_failure / raise_failure_of.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import CheckpointAbortedError, CheckpointError

if TYPE_CHECKING:
    from .snapshot import StagedFile

# Put on a saver's queues: no more items (the end of a save's files, or of the
# writer thread's jobs).
STOP = object()


class SaveFuture:
    """The result of async_save. `result()` returns once the checkpoint is durable."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._future: Future[None] = Future()
        self._snapshot_done = threading.Event()
        self._staged: list[StagedFile] = []
        self._observed = False
        self._started = time.perf_counter()
        self._persist_started: float | None = None
        self.snapshot_seconds: float | None = None
        self.persist_seconds: float | None = None

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
        for staged in self._staged:
            staged.wait_copied()

    def add_done_callback(self, fn: Callable[[SaveFuture], Any]) -> None:
        self._future.add_done_callback(lambda _: fn(self))

    def __repr__(self) -> str:
        status = "done" if self.done() else "pending"
        return f"<SaveFuture {self.path} {status}>"


def take_unobserved_failure(futures: list[SaveFuture]
                            ) -> tuple[list[SaveFuture], SaveFuture | None]:
    """The saves still running, and the first finished one that failed without
    anybody looking (marked as looked at now, so it is reported once)."""
    failed = [f for f in futures if f.done() and not f._observed
              and f._future.exception() is not None]
    for f in failed:
        f._observed = True
    return [f for f in futures if not f.done()], failed[0] if failed else None


def observe_aborts(futures: list[SaveFuture]) -> None:
    """close(abort=True): an aborted save's CheckpointAbortedError is what the
    caller asked for, not a failure to raise at close."""
    for f in futures:
        if isinstance(f._future.exception(), CheckpointAbortedError):
            f._observed = True


def raise_failure_of(failed: SaveFuture | None) -> None:
    """Raise an unobserved failure (take_unobserved_failure) in the caller's thread."""
    if failed is not None:
        exc = failed._future.exception()
        raise CheckpointError(
            f"an earlier async save to {failed.path} failed and nobody called its "
            f"result(): {exc}"
        ) from exc
