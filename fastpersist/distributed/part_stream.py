"""A rank's staged files, handed from the thread that copies them to the one
that writes them as each copy ends (a blocking save through fastpersistd),
so that the daemon writes one file while the next is copied."""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator

from ..saving.snapshot import StagedFile


class PartStream:
    """Iterating yields the files in order as they are put, blocking for each,
    and raises the copier's error where the copy stopped. `count` and
    `reserve_bytes` (the daemon's Open needs both) are known before the first
    copy: the buffers are taken up front."""

    def __init__(self, count: int, reserve_bytes: int) -> None:
        self.count = count
        self.reserve_bytes = reserve_bytes
        self.staged: list[StagedFile] = []  # every file copied, sent or not
        self._queue: queue.SimpleQueue[StagedFile | BaseException] = queue.SimpleQueue()
        self._closed = threading.Event()

    # -- the copier's side
    def put(self, staged: StagedFile) -> None:
        self.staged.append(staged)
        if staged.tensors:
            self._queue.put(staged)

    def fail(self, exc: BaseException) -> None:
        self._queue.put(exc)

    def close(self) -> None:
        """The copier is done (either way): nothing more will be put."""
        self._closed.set()

    # -- the writer's side
    def __iter__(self) -> Iterator[StagedFile]:
        for _ in range(self.count):
            item = self._queue.get()
            if isinstance(item, BaseException):
                raise item
            yield item

    def all_staged(self) -> list[StagedFile]:
        """Every file the copier staged, once it is done: the buffers to give back."""
        self._closed.wait()
        return list(self.staged)
