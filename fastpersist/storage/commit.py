"""Atomic commit: a checkpoint appears under its name only once all of it is durable.

    1. write everything into a hidden staging directory beside the target
       (`.NAME.fp-tmp-PID-RAND@HOST`), data files fsynced by the engine
    2. write the manifest last, fsync it, fsync the staging directory
    3. publish: rename the staging directory to NAME, or, when NAME already
       holds a checkpoint, swap the two atomically (renameat2 RENAME_EXCHANGE)
       so the old one stays intact until the new one is in place
    4. fsync the parent directory, then delete the old checkpoint

A crash before 3 leaves a staging directory and the old checkpoint; a crash
after 3 leaves the new checkpoint and, under the staging name, the old one.
Either way `fpctl gc` recognises the leftovers by name and removes them.

In-process saves name everything by path. The daemon, which writes into a
root that others may write too, gives a Staging its directories as open
descriptors instead (DirFds, from daemon/rootfs.py): the same steps then run
relative to them (dirs.py), so that nothing swapped into the path after Begin
(a symbolic link to elsewhere) is followed, written or published.

A node-local distributed checkpoint's part stops after 2, hidden, until its
job's outcome is known (prepared.py).
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import stat
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import (
    CheckpointError,
    CheckpointExistsError,
    CheckpointIOError,
    CheckpointPermissionError,
    DiskFullError,
)
from ..format.manifest import MANIFEST_NAME
from . import dirs
from .dirs import fsync_dir as fsync_dir

# Leftovers are named and collected in leftovers.py; these names are commit's API too.
from .leftovers import Leftover as Leftover
from .leftovers import collect as collect
from .leftovers import find_leftovers as find_leftovers
from .leftovers import leftover_name as leftover_name
from .leftovers import leftover_of as leftover_of
from .leftovers import parse_leftover as parse_leftover
from .leftovers import restores as restores
from .leftovers import walk_leftovers as walk_leftovers


def os_error(exc: OSError, what: str) -> CheckpointError:
    """The CheckpointError subclass for an OSError met while doing `what`."""
    msg = f"{what}: {exc.strerror or exc}"
    if exc.filename:
        msg += f" ({os.fsdecode(exc.filename)})"
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return DiskFullError(exc.errno, f"{what}: no space left on the device ({exc.strerror})")
    if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return CheckpointPermissionError(exc.errno, msg)
    return CheckpointIOError(exc.errno or errno.EIO, msg)


def fsync_file(path: str | Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_durably(path: str | Path, data: bytes, *, dir_fd: int | None = None) -> None:
    """Write a small file and fsync it. With dir_fd, `path` is a new file's
    name in that directory (never written through a link or an existing file)."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC
    flags |= os.O_TRUNC if dir_fd is None else os.O_EXCL | os.O_NOFOLLOW
    fd = os.open(path, flags, 0o644, dir_fd=dir_fd)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
    finally:
        os.close(fd)


def _exchange(a: str | Path, b: str | Path, *, dir_fd: int | None = None) -> None:
    """Swap a and b atomically (paths, or names in dir_fd)."""
    try:
        from .. import _engine
    except ImportError:
        _exchange_ctypes(a, b, dir_fd)
        return
    _engine.rename_exchange(str(a), str(b), dir_fd=_engine.AT_FDCWD if dir_fd is None else dir_fd)


def _exchange_ctypes(a: str | Path, b: str | Path, dir_fd: int | None) -> None:
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    at, rename_exchange = (-100 if dir_fd is None else dir_fd), 2  # -100: AT_FDCWD
    if libc.renameat2(at, os.fsencode(a), at, os.fsencode(b), rename_exchange) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), str(a))


def _make_parents(directory: Path, created: list[Path]) -> None:
    """mkdir -p, fsyncing each new directory's parent so the path itself is
    durable; appends the directories it made to `created`."""
    missing = []
    d = directory
    while not d.exists():
        missing.append(d)
        d = d.parent
    for d in reversed(missing):
        try:
            d.mkdir()
        except FileExistsError:
            continue
        created.append(d)
        fsync_dir(d.parent)


def _remove_created(created: list[Path]) -> None:
    """Undo _make_parents after a failed save, deepest first; a directory that
    is no longer empty (another save uses it) stops the walk."""
    for d in reversed(created):
        try:
            d.rmdir()
        except OSError:
            return


def through_link(target: Path) -> Path:
    """Where a save of `target` goes. A target whose last component is a
    symbolic link to a directory (a `latest`-style link) is saved through it,
    as torch's FileSystemWriter does: the checkpoint replaces the directory
    the link names, atomically there, and the link goes on naming it. Any
    other target, a dangling link included, is itself (_check_replaceable
    refuses a link that is not followed)."""
    if not target.is_symlink():
        return target
    real = Path(os.path.realpath(target))
    return real if real.is_dir() and not real.is_symlink() else target


def _check_replaceable(target: Path, dir_fd: int | None = None) -> None:
    """Refuse to replace anything but a checkpoint or an empty directory (with
    dir_fd: the entry target.name in that directory)."""
    where = target if dir_fd is None else target.name
    try:
        st = os.stat(where, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return
    if not stat.S_ISDIR(st.st_mode):  # a symlink included
        raise CheckpointExistsError(
            errno.EEXIST, f"{target} exists and is not a checkpoint directory; not replacing it"
        )
    fd = os.open(where, dirs.DIR_FLAGS, dir_fd=dir_fd)
    try:
        if not dirs.lexists(MANIFEST_NAME, fd) and os.listdir(fd):
            raise CheckpointExistsError(
                errno.EEXIST,
                f"{target} exists and is not a fastpersist checkpoint (no {MANIFEST_NAME}); "
                "not replacing it",
            )
    finally:
        os.close(fd)


@dataclass
class DirFds:
    """A staging directory held open, and the directory it lies in (the
    target's parent): a daemon's Staging works relative to these."""

    parent: int
    staging: int

    def close(self) -> None:
        for fd in (self.staging, self.parent):
            with contextlib.suppress(OSError):
                os.close(fd)


@dataclass
class Staging:
    """A staging directory for one save of `target`."""

    target: Path
    path: Path
    created: list[Path] = field(default_factory=list)  # parents this save made
    # The daemon's: the directories as descriptors (see the module's docstring);
    # `path` then only names them in messages. None: by path (in-process).
    fds: DirFds | None = None

    @classmethod
    def create(cls, target: Path) -> Staging:
        """Make the staging directory, after checking (before any data is
        written) that the target may be replaced. A target that is a link
        to a directory is saved through it (through_link)."""
        target = through_link(target)
        parent = target.parent
        created: list[Path] = []
        try:
            _check_replaceable(target)
            _make_parents(parent, created)
            if not parent.is_dir():
                raise CheckpointIOError(errno.ENOTDIR, f"{parent} is not a directory")
            path = parent / leftover_name(target.name, "tmp")
            path.mkdir()
        except CheckpointError:
            _remove_created(created)
            raise
        except OSError as exc:
            _remove_created(created)
            raise os_error(exc, f"cannot create a checkpoint in {parent}") from exc
        return cls(target=target, path=path, created=created)

    @classmethod
    def create_at(cls, parent_fd: int, target: Path) -> Staging:
        """create() in the open directory `parent_fd` (target's parent), which
        the Staging owns from here on (closed on failure too)."""
        name = leftover_name(target.name, "tmp")
        try:
            _check_replaceable(target, parent_fd)
            os.mkdir(name, 0o777, dir_fd=parent_fd)
            try:
                fd = dirs.open_dir(name, parent_fd)
            except OSError:
                os.rmdir(name, dir_fd=parent_fd)
                raise
        except BaseException as exc:
            os.close(parent_fd)
            if isinstance(exc, OSError) and not isinstance(exc, CheckpointError):
                raise os_error(exc, f"cannot create a checkpoint in {target.parent}") from exc
            raise
        return cls(target=target, path=target.parent / name, fds=DirFds(parent_fd, fd))

    def commit(self, manifest: bytes, *, remove_replaced: bool = True) -> Path | None:
        """Steps 2-4 above. On return the checkpoint is durable under its name.
        A checkpoint it replaced is removed, or with remove_replaced=False left
        for the caller (remove_replaced()) under the returned (hidden,
        leftover) path."""
        try:
            self.write_file(MANIFEST_NAME, manifest)
            self.fsync()
        except OSError as exc:
            raise os_error(exc, f"cannot commit checkpoint {self.target}") from exc
        return self.publish(remove_replaced=remove_replaced)

    def write_file(self, name: str, data: bytes) -> None:
        """A small new file in the staging directory, durable (not its name)."""
        if self.fds is None:
            write_durably(self.path / name, data)
        else:
            write_durably(name, data, dir_fd=self.fds.staging)

    def fsync(self) -> None:
        """Make the staging directory's entries durable."""
        if self.fds is None:
            fsync_dir(self.path)
        else:
            os.fsync(self.fds.staging)

    def publish(self, *, remove_replaced: bool = True) -> Path | None:
        """Steps 3-4 above, for a staging directory whose manifest is durable
        (commit(), or a prepared part: prepared.py)."""
        try:
            replaced = self._publish()
            if self.fds is None:
                fsync_dir(self.target.parent)
            else:
                os.fsync(self.fds.parent)
        except CheckpointError:
            raise  # already specific (CheckpointExistsError from _publish)
        except OSError as exc:
            raise os_error(exc, f"cannot commit checkpoint {self.target}") from exc
        if not replaced:
            self.close()
            return None
        # The old checkpoint now lives at self.path; gc would find it if we died here.
        if not remove_replaced:
            return self.path
        self.remove_replaced()
        return None

    def remove_replaced(self) -> None:
        """Remove the checkpoint a commit replaced (now under the staging name)."""
        if self.fds is None:
            shutil.rmtree(self.path, ignore_errors=True)
            return
        with contextlib.suppress(OSError):
            dirs.remove_tree(self.path.name, self.fds.parent)
        self.close()

    def _publish(self) -> bool:
        """Move the staging directory to the target; True if it replaced one."""
        target = self.target
        if self.fds is not None and not dirs.is_entry(self.path.name, self.fds.parent,
                                                       self.fds.staging):
            # Someone moved it and put something else (a link) under its name:
            # publishing that would make it the checkpoint.
            raise CheckpointIOError(errno.ESTALE, f"the staging directory of {target} was "
                                                  "moved or replaced while it was written")
        at = None if self.fds is None else self.fds.parent
        src, dst = (self.path, target) if at is None else (self.path.name, target.name)
        if not dirs.lexists(dst, at):
            try:
                os.rename(src, dst, src_dir_fd=at, dst_dir_fd=at)
                return False
            except OSError as exc:
                if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                    raise  # a save that raced us to the name is handled below
        _check_replaceable(target, at)  # again: it may have appeared while we wrote
        try:
            if at is None:
                _exchange(src, dst)
            else:
                _exchange(src, dst, dir_fd=at)
        except OSError as exc:
            if exc.errno not in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP):
                raise
            # No RENAME_EXCHANGE on this filesystem: move the old one aside first.
            # A crash between the renames leaves it under a `.fp-old` name that
            # gc puts back.
            aside = target.parent / leftover_name(target.name, "old")
            os.rename(dst, aside if at is None else aside.name, src_dir_fd=at, dst_dir_fd=at)
            os.rename(src, dst, src_dir_fd=at, dst_dir_fd=at)
            self.path = aside
        return True

    def abort(self) -> None:
        if self.fds is None:
            shutil.rmtree(self.path, ignore_errors=True)
            _remove_created(self.created)
            return
        with contextlib.suppress(OSError):
            if dirs.is_entry(self.path.name, self.fds.parent, self.fds.staging):
                dirs.remove_tree(self.path.name, self.fds.parent)
            else:  # moved away by someone: empty it where it is, touch nothing else
                dirs.empty_dir(self.fds.staging)
        self.close()

    def close(self) -> None:
        """Release the descriptors (a daemon's Staging); the directory stays."""
        if self.fds is not None:
            self.fds.close()
            self.fds = None


def delete_checkpoint(path: Path, *, dir_fd: int | None = None) -> None:
    """Delete a checkpoint so that no crash leaves a half-deleted one under its
    name: rename it to a hidden `del` leftover (atomic, durable), then remove
    that. gc finishes the removal if we die in between. With dir_fd (the open
    parent), path.name in it."""
    remove_aside(path, path.name, f"cannot delete checkpoint {path}", dir_fd=dir_fd)


def remove_aside(path: Path, name: str, what: str, *, dir_fd: int | None = None) -> None:
    """Rename `path` to a `del` leftover of `name` (durably), then remove
    that; OSError of the rename as a CheckpointError saying `what`."""
    aside = path.parent / leftover_name(name, "del")
    try:
        if dir_fd is None:
            os.rename(path, aside)
            fsync_dir(path.parent)
        else:
            os.rename(path.name, aside.name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
            os.fsync(dir_fd)
    except OSError as exc:
        raise os_error(exc, what) from exc
    if dir_fd is None:
        shutil.rmtree(aside, ignore_errors=True)
    else:
        with contextlib.suppress(OSError):
            dirs.remove_tree(aside.name, dir_fd)
