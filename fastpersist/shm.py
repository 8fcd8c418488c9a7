"""Shared-memory segments between a trainer process and fastpersistd.

A segment is a file in the shared-memory directory (/dev/shm, a tmpfs) named
`fastpersist-<pid>-<random>`. The client creates and maps it, copies a data
file's bytes into it and sends the daemon its name; the daemon maps the same
pages read-only and writes them to disk with O_DIRECT from the mapping (no copy).

Ownership: the client holds a shared flock on the segment for as long as it
lives. The kernel drops the lock when the process dies, however it dies, so a
segment whose lock the daemon can take exclusively belongs to nobody and is
reclaimed (unlinked). This works across PID namespaces (a trainer pod and the
daemon's pod), where a PID check would not.

Torch-free: the daemon imports this module.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import mmap
import os
import re
import secrets
import stat
import time
from dataclasses import dataclass
from pathlib import Path

DEFAULT_DIR = "/dev/shm"
PREFIX = "fastpersist-"
# What a request may name: a plain file name of ours, never a path.
NAME = re.compile(r"^fastpersist-[A-Za-z0-9_.-]{1,128}$")


def shm_dir() -> Path:
    return Path(os.environ.get("FASTPERSIST_SHM_DIR", DEFAULT_DIR))


class Segment:
    """A client-side segment: created, mapped read-write and locked (shared)."""

    def __init__(self, directory: Path, size: int, group: int | None = None) -> None:
        self.name = f"{PREFIX}{os.getpid()}-{secrets.token_hex(8)}"
        self.path = directory / self.name
        self.size = size
        # 0640: the daemon reads it through the group (the socket's group, which
        # a client that may use the daemon belongs to); others cannot.
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o640)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)
            if group is not None:
                # Not in that group: then only a daemon running as root can read it.
                with contextlib.suppress(OSError):
                    os.fchown(fd, -1, group)
            os.fchmod(fd, 0o640)  # the umask may have taken bits away
            # tmpfs allocates on touch; fallocate reserves now, so a full /dev/shm
            # fails here with ENOSPC instead of a SIGBUS in the middle of a copy.
            if size:
                os.posix_fallocate(fd, 0, size)
            self.map = mmap.mmap(fd, size) if size else None
        except BaseException:
            os.close(fd)
            os.unlink(self.path)
            raise
        self._fd = fd

    def close(self) -> None:
        """Unmap, unlink and drop the lock. The caller must have dropped every view."""
        if self._fd < 0:
            return
        with contextlib.suppress(FileNotFoundError):  # reclaimed (not while we hold the lock)
            os.unlink(self.path)
        if self.map is not None:
            # Views still exported: the pages go when the last view does.
            with contextlib.suppress(BufferError):
                self.map.close()
        os.close(self._fd)
        self._fd = -1


@dataclass
class Mapping:
    """A daemon-side read-only mapping of (part of) a client's segment."""

    map: mmap.mmap
    view: memoryview  # the requested range

    def close(self) -> None:
        self.view.release()
        self.map.close()


class SegmentError(ValueError):
    """A request named a segment that does not exist or does not fit."""


def open_range(directory: Path, name: str, offset: int, length: int) -> Mapping:
    """Map bytes [offset, offset+length) of segment `name` read-only.

    `offset` must be page-aligned (it is the start of a data section, which
    O_DIRECT writes straight from). Raises SegmentError with the reason.
    """
    if not NAME.match(name):
        raise SegmentError(f"segment name {name!r} is not a fastpersist segment name")
    if offset % mmap.PAGESIZE:
        raise SegmentError(f"segment offset {offset} is not a multiple of {mmap.PAGESIZE}")
    try:
        # O_NONBLOCK: opening a FIFO someone put there must not block.
        fd = os.open(directory / name,
                     os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError as exc:
        raise SegmentError(f"cannot open segment {name}: {exc.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise SegmentError(f"segment {name} is not a regular file")
        if offset + length > st.st_size:
            raise SegmentError(
                f"segment {name} holds {st.st_size} bytes; the request needs "
                f"{offset}..{offset + length}"
            )
        if length == 0:
            m = mmap.mmap(-1, 1)
            return Mapping(m, memoryview(m)[:0])
        m = mmap.mmap(fd, length, mmap.MAP_SHARED, mmap.PROT_READ, offset=offset)
        return Mapping(m, memoryview(m))
    finally:
        os.close(fd)


def reclaim_orphans(directory: Path) -> list[str]:
    """Unlink the segments no live process holds; returns their names.

    Mappings the daemon still has stay valid after the unlink (the pages live
    until the last mapping goes), so this is safe while writes are running.
    """
    reclaimed = []
    try:
        names = sorted(os.listdir(directory))
    except FileNotFoundError:
        return []
    for name in names:
        if not NAME.match(name):
            continue
        path = directory / name
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
        except OSError:
            continue  # gone, or not ours to open
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as exc:
                if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                    continue  # its owner is alive
                raise
            # A client between its O_CREAT and its flock would look dead here;
            # skip files younger than a few seconds.
            if os.fstat(fd).st_mtime > time.time() - 5:
                continue
            try:
                os.unlink(path)
                reclaimed.append(name)
            except FileNotFoundError:
                pass
            except PermissionError:
                # /dev/shm is sticky: a daemon that is not root cannot unlink
                # other users' files. A --shm-dir of the daemon's group avoids it.
                continue
        finally:
            os.close(fd)
    return reclaimed

