"""Directory operations relative to open directory descriptors, never through a link.

A path is looked up again by the kernel each time it is used: between a check
and a use, a directory on it may be swapped for a symbolic link to anywhere.
Code that must not be redirected (the daemon, which runs with write access to
all of its root) holds directories open and names only entries directly in
them, with O_NOFOLLOW. These helpers do that for opening, removing and
reading; commit.py and the daemon share them.

Torch-free: the daemon imports this module.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import re
import stat
from pathlib import Path

DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def fsync_dir(path: str | Path) -> None:
    """fsync a directory (by path), so that the entries made in it are durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def open_dir(name: str, dir_fd: int) -> int:
    """The directory `name` in `dir_fd`, opened; OSError (ELOOP for a symlink,
    ENOTDIR for anything else that is not a directory) otherwise."""
    return os.open(name, DIR_FLAGS, dir_fd=dir_fd)


def lexists(name: str | Path, dir_fd: int | None) -> bool:
    """Whether `name` (in `dir_fd`, or a path) exists, a link counting as itself."""
    try:
        os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return False
    return True


def same_file(a: os.stat_result, b: os.stat_result) -> bool:
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def is_entry(name: str, dir_fd: int, fd: int) -> bool:
    """Whether `name` in `dir_fd` is (still) the file open as `fd`."""
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return False
    return same_file(st, os.fstat(fd))


def read_regular(name: str, dir_fd: int, limit: int) -> bytes:
    """The content of the regular file `name` in `dir_fd`, at most `limit` bytes.

    Opened with O_NONBLOCK and checked before reading, so that a FIFO or a
    device planted under the name neither blocks nor is read, and a symlink is
    refused (O_NOFOLLOW). OSError: EINVAL for something that is not a regular
    file, EFBIG for a file over the limit.
    """
    fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
                 dir_fd=dir_fd)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise OSError(errno.EINVAL, "not a regular file", name)
        if st.st_size > limit:
            raise OSError(errno.EFBIG, f"larger than {limit} bytes", name)
        chunks = []
        left = limit + 1
        while left > 0:
            chunk = os.read(fd, min(left, 1 << 20))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        data = b"".join(chunks)
        if len(data) > limit:
            raise OSError(errno.EFBIG, f"larger than {limit} bytes", name)
        return data
    finally:
        os.close(fd)


def empty_dir(fd: int) -> None:
    """Remove everything inside the open directory `fd`, depth first, never
    following a symlink (a link is removed, not what it points to). Raises
    the first OSError."""
    stack = [os.dup(fd)]
    try:
        while stack:
            sub = None
            with os.scandir(stack[-1]) as entries:
                for entry in entries:
                    if not entry.is_dir(follow_symlinks=False):
                        with contextlib.suppress(FileNotFoundError):
                            os.unlink(entry.name, dir_fd=stack[-1])
                        continue
                    try:
                        os.rmdir(entry.name, dir_fd=stack[-1])
                        continue
                    except OSError as exc:
                        if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                            raise
                    sub = open_dir(entry.name, stack[-1])
                    break
            if sub is not None:
                stack.append(sub)  # descend; the parent's next pass removes it
            else:
                os.close(stack.pop())
    finally:
        for f in stack:
            os.close(f)


def remove_tree(name: str, dir_fd: int) -> None:
    """rm -rf of `name` in `dir_fd`, never following a symlink: a link (or any
    other non-directory) under the name is unlinked itself."""
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return
    if not stat.S_ISDIR(st.st_mode):
        os.unlink(name, dir_fd=dir_fd)
        return
    fd = open_dir(name, dir_fd)
    try:
        empty_dir(fd)
    finally:
        os.close(fd)
    with contextlib.suppress(FileNotFoundError):
        os.rmdir(name, dir_fd=dir_fd)


def sweep_unlocked(dir_fd: int, pattern: re.Pattern[str]) -> list[str]:
    """Remove the directories in `dir_fd` named by `pattern` that nobody holds
    an flock on (their owner, a daemon that flocks them for its life, died);
    the names removed. A daemon's copies and replicas in --shm-dir are swept
    so at its start: another live daemon's, sharing the directory, are kept."""
    with os.scandir(dir_fd) as entries:
        names = sorted(e.name for e in entries
                       if pattern.match(e.name) and e.is_dir(follow_symlinks=False))
    removed = []
    for name in names:
        try:
            fd = open_dir(name, dir_fd)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            if is_entry(name, dir_fd, fd):
                remove_tree(name, dir_fd)
                removed.append(name)
        except OSError:
            continue  # its daemon is alive, or it is not ours to remove
        finally:
            os.close(fd)
    return removed
