"""One rank's files on their way to its storage (storage.py's write): all
copied before the write begins (an async save, whose writes must not compete
with the caller's copy), or handed over one by one as the caller copies them
(a blocking save through a daemon, which then writes each file while the next
is copied: the copy costs no time of its own)."""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator

from ..saving.snapshot import StagedFile

_END = object()


class PartFiles:
    """The files of a rank's part, in order: `count` of them, whose staging
    buffers hold `reserve` bytes (what a daemon is asked to take), known
    before the first is copied.

    The caller put()s each file once copied, then close()s, or fail()s with
    the error that stopped its copy; the writer iterates, and the iteration
    raises that error where it stops. Every file put is in taken() for the
    buffers' return, which waits for the caller's close or fail: a writer
    that stops early must not give the buffers back while the caller may
    still be putting more."""

    def __init__(self, count: int, reserve: int) -> None:
        self.count = count
        self.reserve = reserve
        self._queue: queue.SimpleQueue[object] = queue.SimpleQueue()
        self._taken: list[StagedFile] = []
        self._lock = threading.Lock()
        self._ended = False  # the writer has seen the close or the failure
        self.failed = False  # the caller's copy failed (fail())

    @classmethod
    def copied(cls, files: list[StagedFile]) -> PartFiles:
        """Files already copied (or, unstaged, written from the live tensors);
        files without tensors are left out."""
        files = [f for f in files if f.entries]
        part = cls(len(files), sum(f.buffer.numel() for f in files if f.buffer is not None))
        for f in files:
            part.put(f)
        part.close()
        return part

    def put(self, staged: StagedFile) -> None:
        with self._lock:
            self._taken.append(staged)
        self._queue.put(staged)

    def close(self) -> None:
        self._queue.put(_END)

    def fail(self, exc: BaseException) -> None:
        self.failed = True
        self._queue.put(exc)

    def __iter__(self) -> Iterator[StagedFile]:
        while not self._ended:
            item = self._next()
            if isinstance(item, BaseException):
                raise item
            if item is not None:
                yield item

    def _next(self) -> StagedFile | BaseException | None:
        """The next file, the caller's failure, or None at the close."""
        item = self._queue.get()
        if item is _END:
            self._ended = True
            return None
        if isinstance(item, BaseException):
            self._ended = True
            return item
        assert isinstance(item, StagedFile)
        return item

    def taken(self) -> list[StagedFile]:
        """Every file put, once the caller has closed or failed."""
        while not self._ended:
            self._next()
        with self._lock:
            return list(self._taken)


__all__ = ["PartFiles"]
