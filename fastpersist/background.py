"""Background work yields the CPU to training: a lower priority for fastpersist's own threads.

An async save's persist (the in-process Saver's writer thread and the engine
threads it starts), uploads to the object-store tier (the uploader thread and
its part threads) and the codec's threads run while the trainer computes, and
on a machine with few cores they take the trainer's CPU. They run at
FASTPERSIST_BACKGROUND_NICE (default 10; 0 leaves them alone): Linux's nice
is per thread, and a thread started by a niced thread inherits its value, so
the threads these start (engine workers, thread pools) are niced too. Work
that is mostly waiting for the disk or the network loses little to it; the
trainer's threads win the cores when both want them.
"""

from __future__ import annotations

import contextlib
import os
import threading

from .knobs import current as current_knobs


def lower_this_thread() -> None:
    """Nice the calling thread (and the threads it starts from now on) by
    FASTPERSIST_BACKGROUND_NICE. Best effort: where the platform has no
    per-thread priority, nothing changes."""
    nice = current_knobs().background_nice
    if not nice or not hasattr(os, "setpriority"):
        return
    tid = threading.get_native_id()
    with contextlib.suppress(OSError):
        current = os.getpriority(os.PRIO_PROCESS, tid)
        if current < nice:  # never raises a thread's priority (nor needs the right to)
            os.setpriority(os.PRIO_PROCESS, tid, nice)
