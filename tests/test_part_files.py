"""PartFiles: a rank's staged files handed from the copying caller to the
writer one by one (distributed/part_files.py). The jobs that use it run in
test_distributed_daemon.py (a copy failing mid-part among them)."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from fastpersist.distributed.part_files import PartFiles
from fastpersist.saving.snapshot import StagedFile
from fastpersist.tensors.plan import StoredTensor


def staged(name: str, nbytes: int = 8) -> StagedFile:
    t = torch.zeros(nbytes, dtype=torch.uint8)
    return StagedFile([StoredTensor(name, "U8", (nbytes,), t, nbytes)],
                      torch.empty(nbytes, dtype=torch.uint8))


def test_files_copied_beforehand_are_read_in_order_without_the_empty_ones() -> None:
    files = [staged("a", 8), StagedFile([], torch.empty(0, dtype=torch.uint8)), staged("b", 16)]
    part = PartFiles.copied(files)
    assert (part.count, part.reserve) == (2, 24)
    assert [f.entries[0].name for f in part] == ["a", "b"]
    assert part.taken() == [files[0], files[2]]


def test_the_writer_reads_each_file_as_the_caller_puts_it() -> None:
    part = PartFiles(3, 24)
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
    part = PartFiles(3, 24)
    first = staged("a")
    part.put(first)
    part.fail(OSError(14, "Bad address"))
    read = []
    with pytest.raises(OSError, match="Bad address"):
        for f in part:
            read.append(f)
    assert read == [first] and part.failed
    assert part.taken() == [first]


def test_buffers_go_back_only_after_the_caller_stopped_putting() -> None:
    """A writer that failed early (the daemon refused the part) must not give
    the buffers back while the caller is still copying: taken() waits for the
    caller's close and then names every file put, read or not."""
    part = PartFiles(3, 24)
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
    assert part.taken() == files
    thread.join(5)
