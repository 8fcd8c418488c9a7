"""The process's save pipelines: the shared ones that fastpersist.save and
async_save use (one per destination), and the at-exit finish of every
pipeline's saves in flight."""

from __future__ import annotations

import atexit
import contextlib
import threading
import weakref
from collections.abc import Callable
from typing import Any, Protocol, TypeVar


class Pipeline(Protocol):
    """What the registry needs of a SavePipeline (pipeline.py registers
    itself here: this module does not import it)."""

    @property
    def closed(self) -> bool: ...

    def stop_thread(self) -> None: ...

    def close_sink(self) -> None: ...

    def close(self, *, abort: bool = False) -> None: ...

    def in_flight(self) -> list[Any]: ...

    @property
    def hands_over(self) -> bool: ...

    def saving_on(self, thread: int) -> bool: ...


P = TypeVar("P", bound=Pipeline)

# The writer threads are daemons, so a process that returns from async_save and
# exits would kill a save halfway. At exit, finish what is in flight and stop
# the writer threads (a daemon thread still running Python while the
# interpreter finalizes is killed by a forced unwind, which aborts the process
# if it passes through C++ frames: torch's tensor destructors), then let the
# staging go: shared-memory segments are files that would outlive the process.
_live: weakref.WeakSet[Pipeline] = weakref.WeakSet()


def register(pipeline: Pipeline) -> None:
    """Finish `pipeline`'s saves at exit (held weakly: a pipeline nobody
    holds has been closed or has nothing in flight)."""
    _live.add(pipeline)


def live() -> list[Pipeline]:
    """Every pipeline of the process still held (preemption.py hands their
    saves off)."""
    return list(_live)


@atexit.register
def _finish_in_flight_saves() -> None:
    for pipeline in list(_live):
        with contextlib.suppress(Exception):
            pipeline.stop_thread()
            pipeline.close_sink()


_shared: dict[Any, Any] = {}
_shared_lock = threading.Lock()


def shared(key: Any, make: Callable[[], P]) -> P:
    """The process-wide pipeline for `key` (fastpersist.save and async_save use
    one per destination kind), made by make() on first use or after a close."""
    with _shared_lock:
        pipeline: P | None = _shared.get(key)
        if pipeline is None or pipeline.closed:
            pipeline = _shared[key] = make()
        return pipeline


def close_shared(*, abort: bool = False) -> None:
    """Close every process-wide pipeline (tests: their segments go with them)."""
    with _shared_lock:
        pipelines: list[Pipeline] = list(_shared.values())
        _shared.clear()
    for pipeline in pipelines:
        with contextlib.suppress(Exception):
            pipeline.close(abort=abort)


__all__ = ["close_shared", "live", "register", "shared"]
