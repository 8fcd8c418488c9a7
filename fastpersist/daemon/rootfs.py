"""The daemon's --root, held open: every request path is resolved beneath it.

The daemon may run as root and writes into a root that others may be able to
write too. A path checked and then used as a string can be redirected in
between (a directory swapped for a symbolic link to anywhere), so no request
path is ever used as a string. The root is opened once; a request's
components (paths.py) are opened one by one from it, each with O_NOFOLLOW
(or all at once with openat2 RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS where the
kernel has it), and everything after that (creating, writing, renaming,
listing, deleting) names entries directly in an open directory. Whatever is
swapped in later is not followed: the daemon works on the directories it
opened, which lie beneath the root when it opened them.

Torch-free: this runs in the daemon.
"""

from __future__ import annotations

import contextlib
import errno
import os
import socket
import stat
from collections.abc import Iterator, Sequence
from pathlib import Path

from ..errors import ManifestError
from ..format.bounds import MAX_MANIFEST_BYTES as READ_LIMIT
from ..format.manifest import MANIFEST_NAME, Manifest
from ..storage import dirs
from ..storage.leftovers import collect, leftover_name, leftover_of
from . import logs
from .paths import PathError, RequestPath

# A manifest the daemon reads (List) is at most this large: a bigger one would
# take more memory to parse than the daemon may use. A committed checkpoint
# whose manifest is larger (the format reads up to 1 GiB) is listed as
# committed all the same, its size and time left out, and a note says why.
MAX_MANIFEST_BYTES = 64 << 20
UNREAD_NOTE = (f"{MANIFEST_NAME} is over the {MAX_MANIFEST_BYTES >> 20} MiB this daemon reads "
               "for a listing: its size and creation time are not shown (`fpctl inspect` "
               "shows them)")
# (name, state, bytes, created, note) of a checkpoint in a listing.
Entry = tuple[str, str, int, float, str]
_RESOLVE = ("RESOLVE_BENEATH", "RESOLVE_NO_SYMLINKS", "RESOLVE_NO_MAGICLINKS")


def _openat2_resolve(root_fd: int) -> int | None:
    """openat2's resolve flags if it works here (kernel >= 5.6, not filtered
    by seccomp, the C extension built); None: open component by component."""
    try:
        from .. import _engine

        resolve = 0
        for flag in _RESOLVE:
            resolve |= getattr(_engine, flag)
        os.close(_engine.openat2(root_fd, ".", dirs.DIR_FLAGS, 0, resolve))
        return resolve
    except (ImportError, AttributeError, OSError):
        return None


class Root:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        self._resolve = _openat2_resolve(self.fd)

    @property
    def uses_openat2(self) -> bool:
        return self._resolve is not None

    def close(self) -> None:
        os.close(self.fd)

    def alive(self) -> bool:
        """Whether the root is still a directory in the file system (not removed)."""
        try:
            st = os.fstat(self.fd)
        except OSError:
            return False
        return st.st_nlink > 0

    # -- resolving -------------------------------------------------------------

    def open_dir(self, parts: Sequence[str]) -> int:
        """The existing directory `parts` beneath the root, opened (the caller
        closes it). PathError for a symlink or a non-directory on the way,
        FileNotFoundError when a component is missing."""
        try:
            if not parts:
                return os.dup(self.fd)
            if self._resolve is not None:
                from .. import _engine

                return _engine.openat2(self.fd, "/".join(parts), dirs.DIR_FLAGS, 0,
                                       self._resolve)
            fd = os.dup(self.fd)
            try:
                for name in parts:
                    fd, old = dirs.open_dir(name, fd), fd
                    os.close(old)
            except BaseException:
                os.close(fd)
                raise
            return fd
        except OSError as exc:
            raise _path_error(exc, parts) from None

    def make_parent(self, parts: Sequence[str]) -> tuple[int, list[tuple[str, ...]]]:
        """The directory that holds `parts[-1]`, opened, its missing components
        made on the way (each new one made durable in its parent). Returns the
        descriptor and the directories made (for remove_created). PathError
        for a symlink or a file on the way, or a path inside a checkpoint."""
        fd = os.dup(self.fd)
        created: list[tuple[str, ...]] = []
        try:
            for i, name in enumerate(parts):
                if i == len(parts) - 1:
                    if stat.S_ISLNK(_lstat_mode(name, fd)):
                        raise PathError(f"{'/'.join(parts)} is a symbolic link; refused")
                    break
                try:
                    child = dirs.open_dir(name, fd)
                except FileNotFoundError:
                    try:
                        os.mkdir(name, 0o777, dir_fd=fd)
                        created.append(tuple(parts[:i + 1]))
                        os.fsync(fd)
                    except FileExistsError:
                        pass  # another request made it meanwhile
                    child = dirs.open_dir(name, fd)
                except OSError as exc:
                    raise _path_error(exc, parts[:i + 1]) from None
                os.close(fd)
                fd = child
                if dirs.lexists(MANIFEST_NAME, fd):
                    raise PathError(f"{'/'.join(parts)} lies inside the checkpoint "
                                    f"{'/'.join(parts[:i + 1])}")
        except BaseException:
            os.close(fd)
            self.remove_created(created)
            raise
        return fd, created

    def remove_created(self, created: Sequence[tuple[str, ...]]) -> None:
        """Undo make_parent after a failed save, deepest first; a directory
        that is not empty any more (another save uses it) stops the walk."""
        for parts in reversed(created):
            try:
                fd = self.open_dir(parts[:-1])
            except (OSError, PathError):
                return
            try:
                os.rmdir(parts[-1], dir_fd=fd)
            except OSError:
                return
            finally:
                os.close(fd)

    # -- what the requests do on disk ------------------------------------------------

    def checkpoint_dir(self, parent_fd: int, name: str) -> int:
        """The committed checkpoint `name` in `parent_fd`, opened; NOT_FOUND-worthy
        FileNotFoundError unless it is a directory holding a regular manifest."""
        if stat.S_ISLNK(_lstat_mode(name, parent_fd)):
            raise PathError(f"{name} is a symbolic link; refused")
        try:
            fd = dirs.open_dir(name, parent_fd)
        except OSError as exc:
            raise FileNotFoundError(errno.ENOENT, "not a checkpoint", name) from exc
        try:
            st = os.stat(MANIFEST_NAME, dir_fd=fd, follow_symlinks=False)
            if not stat.S_ISREG(st.st_mode):
                raise FileNotFoundError(errno.ENOENT, "not a checkpoint", name)
        except BaseException:
            os.close(fd)
            raise
        return fd

    def probe_direct_io(self) -> bool:
        """Whether the root's file system accepts O_DIRECT (tmpfs does not). The
        probe file has a leftover name: a daemon killed here leaves nothing that
        the next one (or `fpctl gc`) does not remove."""
        name = leftover_name("fastpersistd-probe", "tmp")
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        os.close(os.open(name, flags, 0o600, dir_fd=self.fd))
        try:
            fd = os.open(name, os.O_WRONLY | os.O_NOFOLLOW | getattr(os, "O_DIRECT", 0),
                         dir_fd=self.fd)
            os.close(fd)
            return True
        except OSError:
            return False
        finally:
            with contextlib.suppress(OSError):
                os.unlink(name, dir_fd=self.fd)

    def clean_up_leftovers(self) -> None:
        """Remove what a killed daemon (or a crashed in-process save) left: staging
        directories of saves that never committed, temporary files, old copies
        of interrupted replaces (put back where they are the only copy). Same
        rules as `fpctl gc`; our own PID counts as dead: a container restarts
        with the same PID. Walks by descriptors, never into a link; whatever
        else lies in the root (other files, FIFOs, sockets, unreadable
        directories) is left alone."""
        host = socket.gethostname()
        for dirpath, dirnames, filenames, dir_fd in os.fwalk(".", dir_fd=self.fd):
            if MANIFEST_NAME in filenames:
                dirnames[:] = []  # a checkpoint: nothing of ours inside
                continue
            files = [n for n in filenames if stat.S_ISREG(_lstat_mode(n, dir_fd))]
            for name, is_dir in [(n, True) for n in list(dirnames)] + [(n, False) for n in files]:
                leftover = leftover_of(Path(dirpath) / name, is_dir=is_dir)
                if leftover is None:
                    continue
                if is_dir:
                    dirnames.remove(name)
                if leftover.host != host:
                    continue
                if leftover.pid != os.getpid() and leftover.owner_alive:
                    continue
                try:
                    logs.info("cleanup", action=collect(leftover, dir_fd=dir_fd),
                              directory=dirpath)
                except OSError as exc:
                    logs.warning("cleanup-failed", path=str(leftover.path), error=str(exc))


def list_entries(fd: int) -> Iterator[Entry]:
    """(name, state, bytes, created) of the checkpoints in the open directory:
    its directories holding a manifest. A manifest that is not a regular file
    (a link to elsewhere, a FIFO) or not a valid one is reported corrupt, by
    the reason alone, never with its content."""
    with os.scandir(fd) as it:
        names = sorted(e.name for e in it
                       if not e.name.startswith(".") and e.is_dir(follow_symlinks=False))
    for name in names:
        try:
            sub = dirs.open_dir(name, fd)
        except OSError:
            continue  # gone, or swapped for something else since the scan
        try:
            if not dirs.lexists(MANIFEST_NAME, sub):
                continue
            data = dirs.read_regular(MANIFEST_NAME, sub, MAX_MANIFEST_BYTES)
            m = Manifest.from_json(data, name)
        except OSError as exc:
            if exc.errno == errno.EFBIG:  # committed (retention.is_committed agrees), not read
                yield name, "committed", 0, 0.0, UNREAD_NOTE
            else:
                yield name, f"corrupt: cannot read {MANIFEST_NAME} ({_reason(exc)})", 0, 0.0, ""
            continue
        except (ManifestError, ValueError, TypeError, KeyError, RecursionError):
            yield name, f"corrupt: {MANIFEST_NAME} is not a valid manifest", 0, 0.0, ""
            continue
        finally:
            os.close(sub)
        yield name, "committed", m.total_bytes, m.created_unix, ""


def _lstat_mode(name: str, dir_fd: int) -> int:
    try:
        return os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode
    except FileNotFoundError:
        return 0


def _reason(exc: OSError) -> str:
    if exc.errno == errno.ELOOP:
        return "it is a symbolic link"
    return str(exc.strerror or exc.errno)


def _path_error(exc: OSError, parts: Sequence[str]) -> OSError | PathError:
    """The PathError for a symlink or non-directory on a request's path; the
    OSError itself otherwise (a missing component: FileNotFoundError)."""
    shown = "/".join(parts)
    if len(shown) > 200:
        shown = shown[:200] + "..."
    if exc.errno in (errno.ELOOP, errno.EXDEV):
        return PathError(f"{shown}: a symbolic link on the path; refused")
    if exc.errno == errno.ENOTDIR:
        return PathError(f"{shown}: something on the path is not a directory")
    return exc


def manifest_at(root: Root, path: RequestPath) -> bytes | None:
    """The manifest of the committed checkpoint at `path` now, None if none."""
    try:
        parent = root.open_dir(path.parts[:-1])
    except (OSError, PathError):
        return None
    try:
        fd = root.checkpoint_dir(parent, path.parts[-1])
    except (OSError, PathError):
        return None
    finally:
        os.close(parent)
    try:
        return dirs.read_regular(MANIFEST_NAME, fd, READ_LIMIT)
    except OSError:
        return None
    finally:
        os.close(fd)
