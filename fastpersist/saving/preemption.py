"""Preemption: on SIGTERM, hand every save in flight to what outlives this
process, then exit within a grace time.

A preempted trainer (a Kubernetes pod, a Slurm job, a spot instance) gets
SIGTERM and, a grace period later, SIGKILL. What it saved must not be lost
in between, and it must not overrun the grace and be killed mid-way:

- A save through fastpersistd is safe once the daemon owns it (Commit's
  reply): the daemon finishes the disk write after the trainer is gone.
  async_save returns only after that, so only a save the signal interrupts
  is in danger, and the handler lets that save finish its snapshot and hand
  it over first (the handler runs on the thread that was saving: it cannot
  wait for that save, so it marks the exit as due, and the save performs it
  as it returns).
- A save written in this process is safe once it is durable: hand_off waits
  for it, up to the deadline.
- A distributed job's save needs every rank to commit: hand_off waits for it
  like an in-process one (a rank that exits first fails it on every rank).

Then the process exits at once (os._exit): Python's own shutdown would wait,
without a deadline, for every pipeline's saves to be durable (registry.py).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

from . import registry
from .futures import SaveFuture

DEFAULT_GRACE = 5.0
# Taken off the grace for the exit itself (flushing, the kernel's teardown of a
# large address space), so that the process is gone before the grace ends.
_EXIT_MARGIN = 0.25


@dataclass
class HandOff:
    """What hand_off found: the saves safe from this process's death (handed
    to the daemon, or durable), and those that were not by the deadline."""

    safe: list[Path] = field(default_factory=list)
    unsafe: list[Path] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.unsafe


def hand_off(timeout: float | None = None,
             pipelines: Iterable[registry.Pipeline] | None = None) -> HandOff:
    """Wait, at most `timeout` seconds in all, until every save in flight
    in this process (every pipeline's: async_save's, each Checkpointer's) is
    safe from the process's death: owned by fastpersistd, or durable. Call
    it before a planned exit; exit_on_preemption calls it on SIGTERM. It
    raises nothing: a failed save counts as unsafe (its error stays for
    result() or the next save)."""
    start = time.monotonic()
    deadline = None if timeout is None else start + max(0.0, timeout)
    report = HandOff()
    for pipeline in list(pipelines) if pipelines is not None else registry.live():
        for future in pipeline.in_flight():
            safe = _wait_safe(future, pipeline.hands_over, deadline)
            (report.safe if safe else report.unsafe).append(future.path)
    report.seconds = time.monotonic() - start
    return report


def _left(deadline: float | None) -> float | None:
    return None if deadline is None else max(0.0, deadline - time.monotonic())


def _wait_safe(future: SaveFuture, hands_over: bool, deadline: float | None) -> bool:
    """Whether `future`'s save is safe by the deadline. Waited for on a thread
    of its own: a device copy's event and a daemon's Commit reply have no
    timeout, and the caller must keep to the deadline whatever they do."""
    done = threading.Event()
    safe: list[bool] = []

    def wait() -> None:
        try:
            # The snapshot copied, and taken over by the daemon (Commit's reply).
            future.wait_snapshot()
            safe.append(hands_over or future.outcome() is None)
        except BaseException:
            safe.append(False)
        finally:
            done.set()

    threading.Thread(target=wait, name="fastpersist-hand-off", daemon=True).start()
    return done.wait(_left(deadline)) and safe == [True]


# -- on a signal ------------------------------------------------------------------

_due: tuple[float, int] | None = None  # (deadline, exit status) of an exit to run
_installed: dict[int, Any] = {}  # signal -> the handler it replaced
_lock = threading.Lock()


def exit_on_preemption(grace: float = DEFAULT_GRACE,
                       signals: Iterable[int] = (signal.SIGTERM,),
                       exit_code: int | None = None) -> None:
    """On each of `signals`: hand the saves in flight off (hand_off, see the
    module docstring) and exit, all within `grace` seconds of the signal.
    The exit status is exit_code, by default 128 + the signal's number (as a
    process killed by it). A save the signal interrupts finishes its snapshot
    first, and is handed off too. Call it from the main thread (Python runs
    signal handlers there)."""
    if grace <= 0:
        raise ValueError(f"grace must be positive, not {grace}")
    for signum in signals:
        previous = signal.signal(signum, _handler(grace, exit_code))
        _installed.setdefault(signum, previous)


def restore_signal_handlers() -> None:
    """Undo exit_on_preemption (the handlers it replaced come back)."""
    global _due
    for signum, previous in list(_installed.items()):
        signal.signal(signum, previous)
        del _installed[signum]
    _due = None


def _handler(grace: float, exit_code: int | None) -> Any:
    def on_signal(signum: int, frame: FrameType | None) -> None:
        global _due
        deadline = time.monotonic() + grace - _EXIT_MARGIN
        code = 128 + signum if exit_code is None else exit_code
        me = threading.get_ident()
        if any(p.saving_on(me) for p in registry.live()):
            # This thread is inside save(): the save exits as it returns.
            with _lock:
                _due = _due or (deadline, code)
            return
        _exit(deadline, code, signal.Signals(signum).name)

    return on_signal


def after_save() -> None:
    """Called as each save() returns, on its thread: the exit a signal made
    due while it ran, if any (its snapshot is taken and handed on now)."""
    if _due is not None:
        deadline, code = _due
        _exit(deadline, code, "a signal during a save")


def _exit(deadline: float, code: int, why: str) -> None:
    report = hand_off(max(0.0, deadline - time.monotonic()))
    unsafe = (f"; NOT safe by the deadline: {', '.join(map(str, report.unsafe))}"
              if report.unsafe else "")
    print(f"fastpersist: {why}: {len(report.safe)} save(s) in flight handed off in "
          f"{report.seconds:.2f} s{unsafe}; exiting with status {code}",
          file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(code)


__all__ = ["DEFAULT_GRACE", "HandOff", "after_save", "exit_on_preemption", "hand_off",
           "restore_signal_handlers"]
