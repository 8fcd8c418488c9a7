"""Pausing Python's cyclic garbage collector around work that makes many objects.

A save or load of a state of many small tensors builds and parses JSON of
hundreds of thousands of small containers, and keeps a Python object per
tensor; none of it forms cycles. The collector's passes over all of them,
triggered by the allocations, were about half the time of such a save or
load. A distributed plan and job manifest at thousands of ranks are the same
(a 16,384-rank plan: 0.56-0.63 s paused, 0.59-0.85 s not, the slow runs
being those with a full pass; every manifest check goes through it too).
Objects are still freed by reference counting while it is paused; only
cycles wait, for the collector's next pass after the block.
"""

from __future__ import annotations

import contextlib
import gc
import threading
from collections.abc import Iterator

_lock = threading.Lock()
_depth = 0  # blocks inside paused(), over all threads
_resume = False  # whether the collector was enabled when the first block began


@contextlib.contextmanager
def paused() -> Iterator[None]:
    """The collector paused (process-wide) for the block; blocks may nest and
    run on several threads at once: it resumes when the last one ends, if it
    was enabled when the first one began."""
    global _depth, _resume
    with _lock:
        if _depth == 0:
            _resume = gc.isenabled()
            gc.disable()
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0 and _resume:
                gc.enable()
