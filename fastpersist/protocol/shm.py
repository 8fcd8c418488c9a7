"""Shared-memory segments between a trainer process and fastpersistd.

A segment is a file in the shared-memory directory (/dev/shm, a tmpfs) named
`fastpersist-<pid>-<random>`. The client creates and maps it, copies a data
file's bytes into it and sends the daemon its name; the daemon maps the same
pages read-only and writes them to disk with O_DIRECT from the mapping (no copy).

Layout: the first page is the segment's tag page, its data starts at the next
page (Segment.data_offset). Before it names a segment in a SubmitShm, the
client writes into the tag page a hash of the checkpoint's id (seal). The
daemon, which may read every file, maps a segment only if it is a regular
file with one link whose tag page names the checkpoint submitted to: the
segment is 0640, so only its owner can write the tag, and the id is a secret
of the client that began the checkpoint. Another client of the socket's group
can neither hand in someone else's segment nor a hard link to a file it may
not read; and the hash, unlike the id, tells a reader of the segment nothing.
(gRPC's Python server does not expose the Unix socket's peer credentials, so
the daemon cannot check the owner's uid against the caller's.)

Ownership: the client holds a shared flock on the segment for as long as it
lives. The kernel drops the lock when the process dies, however it dies, so a
segment whose lock the daemon can take exclusively belongs to nobody and is
reclaimed (unlinked). This works across PID namespaces (a trainer pod and the
daemon's pod), where a PID check would not. Whatever else lies in the
directory (it is world-writable: directories, FIFOs, sockets, links, other
users' files) is left alone.

Torch-free: the daemon imports this module.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import mmap
import os
import re
import secrets
import stat
import time
from dataclasses import dataclass
from pathlib import Path

from .. import knobs
from ..storage import dirs

PREFIX = "fastpersist-"
# What a request may name: a plain file name of ours, never a path.
NAME = re.compile(r"^fastpersist-[A-Za-z0-9_.-]{1,128}$")
PAGE = mmap.PAGESIZE
_TAG_MAGIC = b"fastpersist-seg1"
# The daemon's memory tier (daemon/memory.py): a directory of its own per
# checkpoint it keeps, holding the data files as they are on disk. Not a
# segment name (the prefix differs), so reclaim_orphans never touches one.
COPY_PREFIX = "fastpersistd-copy-"
COPY_NAME = re.compile(r"^fastpersistd-copy-[0-9a-f]{1,64}$")


def tag_for(checkpoint_id: str) -> bytes:
    """What a segment's tag page holds while it carries checkpoint_id's data."""
    return _TAG_MAGIC + hashlib.sha256(b"fastpersist segment\0" + checkpoint_id.encode()
                                       ).digest()


def shm_dir() -> Path:
    return Path(knobs.shm_dir())


class Segment:
    """A client-side segment: created, mapped read-write and locked (shared).
    `map` is its data (`size` bytes), which lie at data_offset in the file."""

    data_offset = PAGE

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
            os.posix_fallocate(fd, 0, self.data_offset + size)
            self._tag = mmap.mmap(fd, self.data_offset)
            self.map = mmap.mmap(fd, size, offset=self.data_offset) if size else None
        except BaseException:
            os.close(fd)
            os.unlink(self.path)
            raise
        self._fd = fd

    def seal(self, checkpoint_id: str) -> None:
        """Mark the segment's data as checkpoint_id's, before naming it in a
        SubmitShm (the daemon refuses a segment that does not carry it)."""
        tag = tag_for(checkpoint_id)
        self._tag[:len(tag)] = tag

    def close(self) -> None:
        """Unmap, unlink and drop the lock. The caller must have dropped every view."""
        if self._fd < 0:
            return
        with contextlib.suppress(FileNotFoundError):  # reclaimed (not while we hold the lock)
            os.unlink(self.path)
        self._tag.close()
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
        # A view derived from it may outlive the write (one held by the
        # traceback of a failed encode, say): the mapping then goes with the
        # last such view, and the caller's bookkeeping must go on.
        with contextlib.suppress(BufferError):
            self.map.close()


class SegmentError(ValueError):
    """A request named a segment that does not exist, does not fit, or is not
    the requester's to hand in; `code` is the gRPC status code's name."""

    def __init__(self, message: str, code: str = "INVALID_ARGUMENT") -> None:
        super().__init__(message)
        self.code = code


def open_range(dir_fd: int, name: str, offset: int, length: int, tag: bytes) -> Mapping:
    """Map bytes [offset, offset+length) of segment `name` (in the open
    directory dir_fd) read-only, if it is a regular file with one link whose
    tag page holds `tag` (tag_for(the checkpoint's id)).

    `offset` must be page-aligned (it is the start of a data section, which
    O_DIRECT writes straight from) and past the tag page. Raises SegmentError
    with the reason.
    """
    if not NAME.match(name):
        raise SegmentError(f"segment name {name[:80]!r} is not a fastpersist segment name")
    if offset % PAGE:
        raise SegmentError(f"segment offset {offset} is not a multiple of {PAGE}")
    if offset < Segment.data_offset:
        raise SegmentError(f"segment offset {offset} lies in the segment's tag page")
    try:
        # O_NONBLOCK: opening a FIFO someone put there must not block.
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK,
                     dir_fd=dir_fd)
    except OSError as exc:
        raise SegmentError(f"cannot open segment {name}: {exc.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise SegmentError(f"segment {name} is not a regular file")
        if st.st_nlink != 1:
            raise SegmentError(f"segment {name} has {st.st_nlink} links; a segment has one",
                               "PERMISSION_DENIED")
        if offset + length > st.st_size:
            raise SegmentError(
                f"segment {name} holds {st.st_size} bytes; the request needs "
                f"{offset}..{offset + length}"
            )
        if os.pread(fd, len(tag), 0) != tag:
            raise SegmentError(f"segment {name} does not carry this checkpoint's tag: only "
                               "the client that began a checkpoint may hand in its segments",
                               "PERMISSION_DENIED")
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
    Only regular files named as segments are considered; anything else, and
    any file that cannot be opened or locked, is skipped.
    """
    try:
        dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except FileNotFoundError:
        return []
    try:
        with os.scandir(dir_fd) as entries:
            names = sorted(e.name for e in entries
                           if NAME.match(e.name) and e.is_file(follow_symlinks=False))
        return [name for name in names if _reclaim(dir_fd, name)]
    finally:
        os.close(dir_fd)


def _reclaim(dir_fd: int, name: str) -> bool:
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK,
                     dir_fd=dir_fd)
    except OSError:
        return False  # gone, or not ours to open
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return False  # swapped for something else since the scan
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return False  # its owner is alive (EWOULDBLOCK), or it cannot be locked
        # A client between its O_CREAT and its flock would look dead here;
        # skip files younger than a few seconds.
        if os.fstat(fd).st_mtime > time.time() - 5:
            return False
        if not dirs.is_entry(name, dir_fd, fd):
            return False  # the name is another file's by now
        os.unlink(name, dir_fd=dir_fd)
        return True
    except OSError:
        # /dev/shm is sticky: a daemon that is not root cannot unlink other
        # users' files (EPERM). A --shm-dir of the daemon's group avoids it.
        return False
    finally:
        os.close(fd)
