"""storage/dirs.sweep_unlocked: what the memory tier and the replica store sweep at start."""

from __future__ import annotations

import fcntl
import os
import re
from pathlib import Path

import pytest

from fastpersist.daemon.memory import COPY_NAME
from fastpersist.daemon.replicas import REPLICA_NAME
from fastpersist.storage import dirs


def test_removes_unlocked_matching_directories_only(tmp_path: Path) -> None:
    pattern = re.compile(r"^own-[0-9a-f]+$")
    for name in ("own-1", "own-2", "own-3", "other-1"):
        (tmp_path / name / "sub").mkdir(parents=True)
        (tmp_path / name / "sub" / "f").write_bytes(b"x")
    (tmp_path / "own-4").write_bytes(b"a file, not a directory")
    (tmp_path / "own-5").symlink_to(tmp_path / "other-1")
    held = os.open(tmp_path / "own-2", os.O_RDONLY | os.O_DIRECTORY)  # a live daemon's
    fcntl.flock(held, fcntl.LOCK_EX)
    fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        assert dirs.sweep_unlocked(fd, pattern) == ["own-1", "own-3"]
    finally:
        os.close(fd)
        os.close(held)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["other-1", "own-2", "own-4", "own-5"]
    assert (tmp_path / "other-1" / "sub" / "f").read_bytes() == b"x"  # not through the link


def test_the_memory_tier_and_the_replica_store_share_it(tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    from fastpersist.daemon import memory, replicas

    # One sweep for both: each module's names, nothing of the other's.
    copy, replica = "fastpersistd-copy-ab12", "fastpersistd-replica-cd34"
    assert COPY_NAME.match(copy) and REPLICA_NAME.match(replica)
    for name in (copy, replica):
        (tmp_path / name).mkdir()
    calls: list[str] = []
    real = dirs.sweep_unlocked

    def spy(dir_fd: int, pattern: re.Pattern[str]) -> list[str]:
        calls.append(pattern.pattern)
        return real(dir_fd, pattern)

    monkeypatch.setattr(dirs, "sweep_unlocked", spy)
    fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        assert memory.MemoryTier.sweep(_Shm(fd)) == [copy]  # type: ignore[arg-type]
        assert replicas.ReplicaStore.sweep(_Shm(fd)) == [replica]  # type: ignore[arg-type]
    finally:
        os.close(fd)
    assert calls == [COPY_NAME.pattern, REPLICA_NAME.pattern]


class _Shm:
    def __init__(self, fd: int) -> None:
        self.shm_fd = fd
