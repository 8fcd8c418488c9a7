"""StagedFiles: a rank's staged files handed from the copying caller to the
writer one by one (saving/files.py). The jobs that use it run in
test_distributed_daemon.py (a copy failing mid-part among them)."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from fastpersist.saving.files import StagedFiles
from fastpersist.saving.snapshot import StagedFile
from fastpersist.tensors.plan import StoredTensor


def staged(name: str, nbytes: int = 8) -> StagedFile:
    t = torch.zeros(nbytes, dtype=torch.uint8)
    return StagedFile([StoredTensor(name, "U8", (nbytes,), t, nbytes)],
                      torch.empty(nbytes, dtype=torch.uint8))


def test_files_copied_beforehand_are_read_in_order_without_the_empty_ones() -> None:
    files = [staged("a", 8), StagedFile([], torch.empty(0, dtype=torch.uint8)), staged("b", 16)]
    part = StagedFiles.copied(files)
    assert (part.count, part.reserve) == (2, 24)
    assert [f.entries[0].name for f in part] == ["a", "b"]
    assert list(part.drain()) == [files[0], files[2]]


def test_the_writer_reads_each_file_as_the_caller_puts_it() -> None:
    part = StagedFiles(3, 24)
    seen: list[tuple[str, float]] = []

    def writer() -> None:
        for f in part:
            seen.append((f.entries[0].name, time.monotonic()))

    thread = threading.Thread(target=writer)
    thread.start()
    put_at = []
    for name in "abc":
        put_at.append(time.monotonic())
        part.put(staged(name))
        time.sleep(0.05)
    part.close()
    thread.join(5)
    assert [name for name, _ in seen] == ["a", "b", "c"]
    # Each was read before the next was put: the writes overlap the copies.
    assert all(at < put_at[i + 1] for i, (_, at) in enumerate(seen[:2]))


def test_a_failed_copy_is_raised_where_the_files_stop() -> None:
    part = StagedFiles(3, 24)
    first = staged("a")
    part.put(first)
    part.fail(OSError(14, "Bad address"))
    read = []
    with pytest.raises(OSError, match="Bad address"):
        for f in part:
            read.append(f)
    assert read == [first] and part.failed
    assert list(part.drain()) == [first]


def test_buffers_go_back_as_put_until_the_caller_stops_putting() -> None:
    """A writer that failed early (the daemon refused the part, the disk was
    full) gives back every file the caller puts, read or not, and its drain
    ends only at the caller's close: the caller may still be copying."""
    part = StagedFiles(3, 24)
    files = [staged(n) for n in "abc"]
    part.put(files[0])
    for _ in part:
        break  # the writer stops after the first file

    def caller() -> None:
        time.sleep(0.1)
        part.put(files[1])
        part.put(files[2])
        part.close()

    thread = threading.Thread(target=caller)
    thread.start()
    assert list(part.drain()) == files
    thread.join(5)


def test_a_caller_over_its_budget_gets_each_buffer_back_before_its_next_copy() -> None:
    """Under a staging budget the caller copies the next file only once an
    earlier buffer came back. A writer that stopped early must hand each file's
    buffer back as it is put, not after the caller's last (which would never
    come): the deadlock of an async save that hit a full disk."""
    part = StagedFiles(3, 24)
    files = [staged(n) for n in "abc"]
    returned: list[StagedFile] = []
    room = threading.Semaphore(1)  # a budget of one buffer

    def caller() -> None:
        for f in files:
            if not room.acquire(timeout=5):  # (ends the drain: the test fails, not hangs)
                part.fail(TimeoutError("the buffer never came back"))
                return
            part.put(f)
        part.close()

    thread = threading.Thread(target=caller)
    thread.start()
    for f in part.drain():  # the writer failed before reading any
        returned.append(f)
        room.release()
    thread.join(10)
    assert returned == files and not thread.is_alive()
