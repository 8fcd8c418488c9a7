"""Loaded tensors and staging buffers live in private memory, not shmem (anonmem.py).

Python's mmap.mmap(-1, n) is MAP_SHARED anonymous memory, which the kernel
lists as "/dev/zero (deleted)" with an "s" in its permissions: faulting it in
cost half of a cold load's CPU, and a forked child (a DataLoader worker)
would share its writes with the parent.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

import fastpersist
from fastpersist.anonmem import HUGE_PAGE, anonymous
from fastpersist.saving import staging


def mapping_of(address: int) -> tuple[str, str]:
    """(permissions, path) of the mapping of this process that holds `address`."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            start, end = (int(x, 16) for x in fields[0].split("-"))
            if start <= address < end:
                return fields[1], fields[5].strip() if len(fields) > 5 else ""
    raise AssertionError(f"no mapping holds {address:#x}")


def assert_private_anonymous(t: torch.Tensor) -> None:
    perms, path = mapping_of(t.data_ptr())
    assert perms.endswith("p"), (perms, path)  # private, not shared
    assert "/dev/zero" not in path and "shmem" not in path, path


def test_large_loaded_tensors_are_private_anonymous_memory(tmp_path: Path) -> None:
    state = {"big": torch.randn(3 << 20), "odd": torch.randn(1 << 18).to(torch.bfloat16)}
    fastpersist.save(state, tmp_path / "c")
    loaded = fastpersist.load(tmp_path / "c")
    for name in state:
        assert torch.equal(loaded[name], state[name])
        assert_private_anonymous(loaded[name])


def test_staging_buffers_are_private_anonymous_memory() -> None:
    buffer = staging._allocate(HUGE_PAGE * 2, pinned=False)
    assert buffer.data_ptr() % 4096 == 0
    assert_private_anonymous(buffer)


def test_a_forked_child_does_not_write_into_the_parent() -> None:
    m = anonymous(HUGE_PAGE)
    m[:4] = b"same"
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        m[:4] = b"diff"
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert m[:4] == b"same"
