"""A save's data files on their way from the caller's copy to the writer.

The caller put()s each file once it is copied into staging (or, unstaged,
put_and_wait()s it: the writer writes it from the live tensors while the
caller waits), then close()s, or fail()s with the error that stopped its
copy. The writer iterates; the iteration raises that error where it stops.
Every file put comes out of drain() for its buffer's return, as it is put,
until the caller's close or fail: a writer that stops early gives each buffer
back as the caller puts it, since the caller may still be copying more. `count` files whose
staging buffers hold at most `reserve` bytes at once (what a daemon is asked to take) are
known before the first is copied; `windowed`: they do not all fit the budget at
once, so the caller waits for the writer to give each buffer back once its file
is written.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator

from .snapshot import StagedFile

_END = object()


class StagedFiles:
    def __init__(self, count: int, reserve: int, windowed: bool = False) -> None:
        self.count = count
        self.reserve = reserve
        self.windowed = windowed
        self._queue: queue.SimpleQueue[object] = queue.SimpleQueue()
        self._taken: list[StagedFile] = []
        self._waiting: list[threading.Event] = []  # the callers of put_and_wait
        self._lock = threading.Lock()
        self._ended = False  # the writer has seen the close or the failure
        self.failed = False  # the caller's copy failed (fail())

    @classmethod
    def copied(cls, files: list[StagedFile]) -> StagedFiles:
        """Files already copied (or, unstaged, to be written from the live
        tensors); files without tensors are left out."""
        files = [f for f in files if f.entries]
        out = cls(len(files), sum(f.buffer.numel() for f in files if f.buffer is not None))
        for f in files:
            out.put(f)
        out.close()
        return out

    def put(self, staged: StagedFile) -> None:
        with self._lock:
            self._taken.append(staged)
        self._queue.put(staged)

    def put_and_wait(self, staged: StagedFile) -> None:
        """Put a file the writer reads from the live tensors; return once the
        writer is done with it (it asked for the next file, or stopped)."""
        written = threading.Event()
        with self._lock:
            self._taken.append(staged)
            self._waiting.append(written)
        self._queue.put((staged, written))
        written.wait()

    def close(self) -> None:
        self._queue.put(_END)

    def fail(self, exc: BaseException) -> None:
        self.failed = True
        self._queue.put(exc)

    def __iter__(self) -> Iterator[StagedFile]:
        written: threading.Event | None = None
        while not self._ended:
            if written is not None:  # asked for the next: done with the one before
                written.set()
                written = None
            item = self._next()
            if isinstance(item, BaseException):
                raise item
            if isinstance(item, tuple):
                item, written = item
            if isinstance(item, StagedFile):
                yield item
        if written is not None:
            written.set()

    def _next(self) -> object:
        """The next item, the caller's failure, or None at the close."""
        item = self._queue.get()
        if item is _END:
            self._ended = True
            return None
        if isinstance(item, BaseException):
            self._ended = True
        return item

    def drain(self) -> Iterator[StagedFile]:
        """Every file put, each as soon as it is put, until the caller closes
        or fails (the writer has stopped: whoever waits for theirs is let go).
        One by one, not after the last: a snapshot larger than its staging
        budget waits for the buffers of its earlier files to come back before
        it can copy (and put, or fail) the next."""
        self._release_waiting()
        given = 0
        while True:
            with self._lock:
                new = self._taken[given:]
                given = len(self._taken)
            yield from new
            if self._ended:
                break
            item = self._next()
            if isinstance(item, tuple):
                item[1].set()
        self._release_waiting()

    def _release_waiting(self) -> None:
        with self._lock:
            for event in self._waiting:
                event.set()


__all__ = ["StagedFiles"]
