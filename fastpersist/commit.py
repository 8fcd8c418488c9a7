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

A node-local distributed checkpoint is committed by one node (rank 0's) for
all: the other nodes stop after 2 (Staging.prepare), with their directory
renamed to a `.NAME.fp-prep-...` name and a marker naming the committing
node, and do 3-4 (publish_prepared) only once that node has published, or
discard the part (discard_prepared) once it is known that it never will.
Until then the part is in doubt: gc leaves it alone, and
fastpersist/distributed/settling.py decides it with the job's other nodes.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import re
import secrets
import shutil
import socket
from dataclasses import dataclass, field
from pathlib import Path

from .errors import (
    CheckpointError,
    CheckpointExistsError,
    CheckpointIOError,
    CheckpointPermissionError,
    DiskFullError,
)
from .format.manifest import MANIFEST_NAME

# In a prepared part (kind "prep"): which node's publish commits its job.
PREPARED_MARKER = ".fastpersist-prepared"
IN_DOUBT_HELP = ("a node-local distributed checkpoint's part, published only if its job "
                 "committed: fastpersist.distributed.settle decides it")

_LEFTOVER = re.compile(
    r"^\.(?P<name>.+)\.fp-(?P<kind>tmp|old|del|prep)-(?P<pid>\d+)-[0-9a-f]+@(?P<host>.+)$"
)


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


def fsync_dir(path: str | Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_file(path: str | Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_durably(path: Path, data: bytes) -> None:
    """Write a small file and fsync it."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
    finally:
        os.close(fd)


def _exchange(a: Path, b: Path) -> None:
    try:
        from . import _engine
    except ImportError:
        _exchange_ctypes(a, b)
        return
    _engine.rename_exchange(str(a), str(b))


def _exchange_ctypes(a: Path, b: Path) -> None:
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    at_fdcwd, rename_exchange = -100, 2
    if libc.renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) != 0:
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


def _check_replaceable(target: Path) -> None:
    """Refuse to replace anything but a checkpoint or an empty directory."""
    if not os.path.lexists(target):
        return
    if target.is_symlink() or not target.is_dir():
        raise CheckpointExistsError(
            errno.EEXIST, f"{target} exists and is not a checkpoint directory; not replacing it"
        )
    if not (target / MANIFEST_NAME).exists() and any(target.iterdir()):
        raise CheckpointExistsError(
            errno.EEXIST,
            f"{target} exists and is not a fastpersist checkpoint (no {MANIFEST_NAME}); "
            "not replacing it",
        )


@dataclass
class Staging:
    """A staging directory for one save of `target`."""

    target: Path
    path: Path
    created: list[Path] = field(default_factory=list)  # parents this save made

    @classmethod
    def create(cls, target: Path) -> Staging:
        """Make the staging directory, after checking (before any data is
        written) that the target may be replaced."""
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

    def commit(self, manifest: bytes, *, remove_replaced: bool = True) -> Path | None:
        """Steps 2-4 above. On return the checkpoint is durable under its name.
        A checkpoint it replaced is removed, or with remove_replaced=False left
        for the caller under the returned (hidden, leftover) path."""
        try:
            write_durably(self.path / MANIFEST_NAME, manifest)
            fsync_dir(self.path)
        except OSError as exc:
            raise os_error(exc, f"cannot commit checkpoint {self.target}") from exc
        return self.publish(remove_replaced=remove_replaced)

    def prepare(self, manifest: bytes, commit_node: str) -> Path:
        """Step 2 for a node-local distributed checkpoint's part (module
        docstring): manifest and marker durable, the directory renamed to a
        `prep` name and that rename durable. Returns the new path."""
        marker = json.dumps({"commit_node": commit_node,
                             "manifest_sha256": manifest_digest(manifest)}).encode()
        prepared = self.path.parent / leftover_name(self.target.name, "prep")
        try:
            write_durably(self.path / MANIFEST_NAME, manifest)
            write_durably(self.path / PREPARED_MARKER, marker)
            fsync_dir(self.path)
            os.rename(self.path, prepared)
            fsync_dir(prepared.parent)
        except OSError as exc:
            raise os_error(exc, f"cannot prepare checkpoint {self.target}") from exc
        self.path = prepared
        return prepared

    def publish(self, *, remove_replaced: bool = True) -> Path | None:
        """Steps 3-4 above, for a directory whose manifest is durable."""
        try:
            replaced = self._publish()
            fsync_dir(self.target.parent)
        except CheckpointError:
            raise  # already specific (CheckpointExistsError from _publish)
        except OSError as exc:
            raise os_error(exc, f"cannot commit checkpoint {self.target}") from exc
        if not replaced:
            return None
        # The old checkpoint now lives at self.path; gc would find it if we died here.
        if not remove_replaced:
            return self.path
        shutil.rmtree(self.path, ignore_errors=True)
        return None

    def _publish(self) -> bool:
        """Move the staging directory to the target; True if it replaced one."""
        target = self.target
        if not os.path.lexists(target):
            try:
                os.rename(self.path, target)
                return False
            except OSError as exc:
                if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                    raise  # a save that raced us to the name is handled below
        _check_replaceable(target)  # again: it may have appeared while we wrote
        try:
            _exchange(self.path, target)
        except OSError as exc:
            if exc.errno not in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP):
                raise
            # No RENAME_EXCHANGE on this filesystem: move the old one aside first.
            # A crash between the renames leaves it under a `.fp-old` name that
            # gc puts back.
            aside = target.parent / leftover_name(target.name, "old")
            os.rename(target, aside)
            os.rename(self.path, target)
            self.path = aside
        return True

    def abort(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)
        _remove_created(self.created)


def delete_checkpoint(path: Path) -> None:
    """Delete a checkpoint so that no crash leaves a half-deleted one under its
    name: rename it to a hidden `del` leftover (atomic, durable), then remove
    that. gc finishes the removal if we die in between."""
    aside = path.parent / leftover_name(path.name, "del")
    try:
        os.rename(path, aside)
        fsync_dir(path.parent)
    except OSError as exc:
        raise os_error(exc, f"cannot delete checkpoint {path}") from exc
    shutil.rmtree(aside, ignore_errors=True)


def manifest_digest(manifest: bytes) -> str:
    """Names a job: every node's directory of it holds the same manifest."""
    return hashlib.sha256(manifest).hexdigest()


def publish_prepared(prepared: Path, target: Path, *, remove_replaced: bool = True
                     ) -> Path | None:
    """Steps 3-4 for a prepared part whose job committed: it is a checkpoint
    under its name on return (Staging.commit for remove_replaced)."""
    replaced = Staging(target=target, path=prepared).publish(remove_replaced=remove_replaced)
    # Its job is no longer in doubt. (Left behind by a crash, it is ignored.)
    with contextlib.suppress(FileNotFoundError):
        (target / PREPARED_MARKER).unlink()
    return replaced


def discard_prepared(prepared: Path) -> None:
    """Remove a prepared part whose job did not commit. Renamed aside first:
    a part half removed must never look prepared (settle would publish it)."""
    m = _LEFTOVER.match(prepared.name)
    aside = prepared.parent / leftover_name(m["name"] if m else prepared.name, "del")
    try:
        os.rename(prepared, aside)
        fsync_dir(prepared.parent)
    except OSError as exc:
        raise os_error(exc, f"cannot remove {prepared}") from exc
    shutil.rmtree(aside, ignore_errors=True)


@dataclass(frozen=True)
class PreparedPart:
    """What a prepared part says of itself (Staging.prepare)."""

    path: Path
    target_name: str
    commit_node: str  # the node whose publish of target_name commits the job
    digest: str  # manifest_digest of the job manifest


def read_prepared(leftover: Leftover) -> PreparedPart | None:
    """The prepared part at a `prep` leftover; None if it is not one, or its
    marker or manifest cannot be read (then nothing can decide it)."""
    if leftover.kind != "prep":
        return None
    try:
        marker = json.loads((leftover.path / PREPARED_MARKER).read_bytes())
        digest = manifest_digest((leftover.path / MANIFEST_NAME).read_bytes())
        node = marker["commit_node"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if not isinstance(node, str) or marker.get("manifest_sha256") != digest:
        return None
    return PreparedPart(leftover.path, leftover.target_name, node, digest)


def leftover_name(name: str, kind: str) -> str:
    return f".{name}.fp-{kind}-{os.getpid()}-{secrets.token_hex(4)}@{socket.gethostname()}"


@dataclass(frozen=True)
class Leftover:
    path: Path
    target_name: str
    # "tmp": an unfinished (or replaced) save; "old": moved aside by a replace;
    # "del": a checkpoint being deleted (retention); "prep": a prepared part of
    # a node-local distributed checkpoint, in doubt (module docstring)
    kind: str
    pid: int
    host: str

    @property
    def owner_alive(self) -> bool:
        """Whether the process that made it may still be writing it."""
        if self.host != socket.gethostname():
            return True  # cannot tell; never touch another machine's save
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True


def parse_leftover(path: Path) -> Leftover | None:
    m = _LEFTOVER.match(path.name)
    if not m or not path.is_dir():
        return None
    return Leftover(path, m["name"], m["kind"], int(m["pid"]), m["host"])


def find_leftovers(root: Path) -> list[Leftover]:
    found = []
    for entry in sorted(root.iterdir()):
        leftover = parse_leftover(entry)
        if leftover is not None:
            found.append(leftover)
    return found


def restores(leftover: Leftover) -> bool:
    """Whether gc puts this leftover back instead of removing it: the old copy
    of an interrupted replace, when it is the only copy left."""
    target = leftover.path.parent / leftover.target_name
    return (
        leftover.kind == "old"
        and not os.path.lexists(target)
        and (leftover.path / MANIFEST_NAME).exists()
    )


def collect(leftover: Leftover) -> str:
    """Clean one leftover whose owner is gone; returns what was done."""
    target = leftover.path.parent / leftover.target_name
    if leftover.kind == "prep":
        # Its job may have committed: only the job's nodes together can tell.
        return f"kept {leftover.path.name}: in doubt ({IN_DOUBT_HELP})"
    if restores(leftover):
        os.rename(leftover.path, target)
        fsync_dir(target.parent)
        return f"restored {target} from {leftover.path.name}"
    shutil.rmtree(leftover.path)
    return f"removed {leftover.path.name}"
