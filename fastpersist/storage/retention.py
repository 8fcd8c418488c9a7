"""A Checkpointer's work after each commit: the `latest` pointer and retention.

One implementation, applied in the Checkpointer's root (the directory of its
step-N checkpoints) by whoever committed the checkpoint: the Checkpointer's
writer thread in-process, or fastpersistd, which owns everything under its
--root and applies it before it reports the checkpoint COMMITTED (so it
happens even if the trainer is gone by then).

    point latest   ROOT/latest names the checkpoint just committed: a temporary
                   with a leftover name, fsynced, renamed over `latest`, the
                   directory fsynced. It is not moved back: when it names a
                   higher step committed since this checkpoint began (a newer
                   save of the same run that finished first), it stays.
    retention      among the committed step-N checkpoints up to this one's
                   step, keep the newest keep_last and every multiple of
                   keep_every; delete the others, by the names listed, each
                   renamed to a hidden `del` leftover first (atomic, the
                   directory fsynced) and then removed. Retention runs only
                   after a newer checkpoint is durable, and a step higher than
                   the one just committed is never deleted (nor counted): it
                   may be the only copy of something newer. Nor is a
                   checkpoint its owner protects (`protected`: one whose
                   upload to the object-store tier has not finished, the
                   only copy of it); a later pass deletes it.

Everything is done relative to the root's directory descriptor, with the
primitives of dirs.py and commit.py (write_durably, delete_checkpoint), and
nothing in it is followed through a symbolic link: the daemon does this as
root, in directories that others may be able to write.

Torch-free: the daemon imports this module.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import stat
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from ..errors import CheckpointError, PostCommitError
from ..format.manifest import MANIFEST_NAME, Manifest
from . import dirs
from .commit import delete_checkpoint, leftover_name, write_durably

LATEST = "latest"
STEP_DIR = re.compile(r"^step-(\d+)$")
MAX_POINTER_BYTES = 4096
# Manifests are read to tell a committed checkpoint from a broken one; one
# larger than this (millions of tensors) is taken as committed unread: parsing
# it would take more memory than the daemon may use (as for its List).
MAX_MANIFEST_BYTES = 64 << 20
# `latest` names a higher step "committed since this checkpoint began" when that
# step's manifest is at most this much older than the beginning: file times are
# a clock tick coarser than time.time().
CLOCK_SLACK_SECONDS = 1.0


@dataclass(frozen=True)
class AfterCommit:
    """What a Checkpointer does in its root after each commit."""

    point_latest: bool = True
    keep_last: int | None = None  # None: keep everything
    keep_every: int | None = None  # also keep the steps that are multiples of this
    upload: bool = True  # to the object-store tier, if any (False: tier_every passes it)


def step_of(name: str) -> int | None:
    """The step of a checkpoint named step-N, or None."""
    m = STEP_DIR.match(name)
    return int(m[1]) if m else None


def to_delete(entries: list[tuple[int, str]], newest: str, policy: AfterCommit,
              committed: Callable[[str], bool],
              protected: Callable[[str], bool] | None = None) -> list[str]:
    """The names retention deletes, from the (step, name) of the step-N
    checkpoints in the root, once `newest` is committed. committed(name) says
    whether a checkpoint's manifest is valid: only those count among the newest
    keep_last; it is asked about as few as needed, newest first.
    protected(name): never deleted (a pending upload's only copy)."""
    newest_step = step_of(newest)
    if policy.keep_last is None or newest_step is None:
        return []
    older = sorted(((s, n) for s, n in entries if s <= newest_step and n != newest),
                   reverse=True)
    recent = {newest_step}
    for step, name in older:
        if len(recent) >= policy.keep_last:
            break
        if step not in recent and committed(name):
            recent.add(step)
    every = policy.keep_every
    return [name for step, name in older
            if step not in recent and not (every and step % every == 0)
            and not (protected and protected(name))]


# -- reading, relative to a directory descriptor (dirs.py) ---------------------------


@contextlib.contextmanager
def _entry(name: str, dir_fd: int) -> Iterator[int]:
    fd = dirs.open_dir(name, dir_fd)
    try:
        yield fd
    finally:
        os.close(fd)


def _manifest_stat(name: str, dir_fd: int) -> os.stat_result | None:
    """The stat of checkpoint `name`'s manifest, if it is a regular file."""
    try:
        with _entry(name, dir_fd) as fd:
            st = os.stat(MANIFEST_NAME, dir_fd=fd, follow_symlinks=False)
    except OSError:
        return None
    return st if stat.S_ISREG(st.st_mode) else None


def is_committed(name: str, dir_fd: int) -> bool:
    """Whether `name` holds a checkpoint whose manifest reads and validates."""
    try:
        with _entry(name, dir_fd) as fd:
            identity = _identity(os.stat(MANIFEST_NAME, dir_fd=fd, follow_symlinks=False))
            if _validated.seen(identity):
                return True
            data = dirs.read_regular(MANIFEST_NAME, fd, MAX_MANIFEST_BYTES)
        Manifest.from_json(data, name)
    except OSError as exc:
        return exc.errno == errno.EFBIG  # too large to read here: taken as committed
    except (CheckpointError, ValueError, TypeError, KeyError, RecursionError):
        return False
    _validated.add(identity)
    return True


def _identity(st: os.stat_result) -> tuple[int, ...]:
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def _known_committed(name: str, dir_fd: int) -> None:
    """`name` was just committed by the caller, who wrote its manifest: no
    need to parse it when a later commit's retention asks."""
    st = _manifest_stat(name, dir_fd)
    if st is not None:
        _validated.add(_identity(st))


class _Seen:
    """Manifests that validated, by the file's identity and change times.

    Retention asks about the same checkpoint at every commit after it, and a
    manifest of many tensors is slow to parse (5 ms for 600 tensors, about a
    second for 100,000). A manifest written again or replaced has another
    identity (its ctime moves on any change) and is read again. Bounded: the
    oldest entries go first."""

    def __init__(self, limit: int) -> None:
        self._limit = limit
        self._keys: dict[tuple[int, ...], None] = {}  # insertion-ordered
        self._lock = threading.Lock()

    def seen(self, key: tuple[int, ...]) -> bool:
        with self._lock:
            return key in self._keys

    def add(self, key: tuple[int, ...]) -> None:
        with self._lock:
            self._keys[key] = None
            while len(self._keys) > self._limit:
                del self._keys[next(iter(self._keys))]


_validated = _Seen(1024)


def checkpoints(dir_fd: int) -> list[tuple[int, str]]:
    """(step, name) of every step-N directory holding a manifest file."""
    found = []
    with os.scandir(dir_fd) as entries:
        for e in entries:
            step = step_of(e.name)
            if step is not None and e.is_dir(follow_symlinks=False):
                found.append((step, e.name))
    return [(s, n) for s, n in found if _manifest_stat(n, dir_fd) is not None]


def read_pointer(dir_fd: int) -> str | None:
    """The name `latest` holds, or None (no pointer, or not a small file)."""
    try:
        return dirs.read_regular(LATEST, dir_fd, MAX_POINTER_BYTES).decode().strip()
    except (OSError, UnicodeDecodeError):
        return None


# -- writing ---------------------------------------------------------------------------


def point_latest(dir_fd: int, name: str) -> None:
    """Make `latest` name `name`, atomically and durably."""
    tmp = leftover_name(LATEST, "tmp")  # gc knows the name
    try:
        write_durably(tmp, (name + "\n").encode(), dir_fd=dir_fd)
        os.replace(tmp, LATEST, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp, dir_fd=dir_fd)
        raise
    os.fsync(dir_fd)


def _pointer_is_newer(dir_fd: int, newest: str, since: float | None) -> bool:
    """Whether `latest` names a higher step than `newest`, committed since
    `since` (when `newest` began): then it stays."""
    if since is None:
        return False
    current = read_pointer(dir_fd)
    step, mine = (None, None) if current is None else (step_of(current), step_of(newest))
    if current is None or step is None or mine is None or step <= mine:
        return False
    st = _manifest_stat(current, dir_fd)
    return (st is not None and st.st_mtime >= since - CLOCK_SLACK_SECONDS
            and is_committed(current, dir_fd))


@dataclass(frozen=True)
class Applied:
    """What apply() did."""

    pointed: bool  # `latest` now names the checkpoint
    deleted: tuple[str, ...]  # by retention


def apply(dir_fd: int, where: Path, newest: str, policy: AfterCommit,
          since: float | None = None,
          protected: Callable[[str], bool] | None = None) -> Applied:
    """Apply `policy` in the open directory `dir_fd` (named `where` in errors)
    once its checkpoint `newest` is committed. since: when `newest` began
    (time.time()), where saves of one root may commit out of order (the
    daemon); None where they commit in order. protected(name): names that
    retention must keep for now (to_delete). Raises PostCommitError."""
    what = f"moving {where / LATEST} to {newest}"
    pointed, deleted = False, []
    _known_committed(newest, dir_fd)  # the next commit's retention asks about it
    try:
        if policy.point_latest and not _pointer_is_newer(dir_fd, newest, since):
            point_latest(dir_fd, newest)
            pointed = True
        what = f"retention in {where}"
        for name in to_delete(checkpoints(dir_fd), newest, policy,
                              lambda n: is_committed(n, dir_fd), protected):
            what = f"deleting {where / name} (retention)"
            try:
                # Renamed to a `del` leftover first (durably), then removed:
                # no crash leaves it half-deleted under its name.
                delete_checkpoint(where / name, dir_fd=dir_fd)
            except OSError as exc:
                if exc.errno != errno.ENOENT:
                    raise
                continue  # deleted by somebody else meanwhile
            deleted.append(name)
    except OSError as exc:
        raise PostCommitError(f"checkpoint {where / newest} is committed, but {what} failed: "
                              f"{exc.strerror or exc}") from exc
    return Applied(pointed, tuple(deleted))


def apply_at(root: Path, newest: str, policy: AfterCommit, since: float | None = None, *,
             follow: bool = True, protected: Callable[[str], bool] | None = None) -> Applied:
    """apply() in the directory `root`. follow=False: refuse a root that is a
    symbolic link (the daemon's, where the path was checked at Begin)."""
    try:
        fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
                     | (0 if follow else os.O_NOFOLLOW))
    except OSError as exc:
        raise PostCommitError(f"checkpoint {root / newest} is committed, but its directory "
                              f"cannot be opened: {exc.strerror or exc}") from exc
    try:
        return apply(fd, root, newest, policy, since, protected)
    finally:
        os.close(fd)
