"""Leftovers of saves that did not finish: their names, and collecting them.

A save works in a hidden directory beside its target (commit.py), named
`.NAME.fp-KIND-PID-RAND@HOST` (NAME shortened, see shortened(), where the
whole would pass the 255 bytes a file name may have): "tmp" an unfinished
(or replaced) save, "old" a checkpoint moved aside by a replace, "del" a checkpoint being deleted,
"prep" a prepared part of a node-local distributed checkpoint (prepared.py).
A leftover whose process is gone is collected: removed, or, for the only copy
of a checkpoint left by an interrupted replace, put back under its name. A
prepared part is never collected: it is in doubt until its job's nodes
decide it together (fastpersist.distributed.settle).

Torch-free: the daemon imports this module.
"""

from __future__ import annotations

import hashlib
import os
import re
import secrets
import shutil
import socket
import stat
from dataclasses import dataclass
from pathlib import Path

from ..format.manifest import MANIFEST_NAME
from . import dirs
from .dirs import fsync_dir

IN_DOUBT_HELP = ("a node-local distributed checkpoint's part, published only if its job "
                 "committed: fastpersist.distributed.settle decides it")

_LEFTOVER = re.compile(
    r"^\.(?P<name>.+)\.fp-(?P<kind>tmp|old|del|prep)-(?P<pid>\d+)-[0-9a-f]+@(?P<host>.+)$"
)


MAX_NAME_BYTES = 255  # of one path component, on every Linux filesystem we write
# A shortened NAME: this many bytes of it, "~", and 16 hex digits of its SHA-256.
# With the rest of a leftover's name (at most 91 bytes: a 7-digit pid, a
# 64-byte host name) it fits in MAX_NAME_BYTES.
_KEPT_BYTES = 128
# Kinds whose NAME is never shortened: gc puts an "old" copy back under NAME,
# and settle publishes a "prep" part under it, so they must carry it whole (a
# target whose leftover name would not fit is refused: ENAMETOOLONG).
_WHOLE_NAME_KINDS = ("old", "prep")


def shortened(name: str) -> str:
    """The stand-in for a name too long to carry in a leftover's name: a
    prefix (for people) and a hash (for Leftover.is_for)."""
    raw = os.fsencode(name)
    kept = raw[:_KEPT_BYTES].decode("utf-8", "ignore") if len(raw) > _KEPT_BYTES else name
    return f"{kept}~{hashlib.sha256(raw).hexdigest()[:16]}"


def process_token() -> str:
    """PID-RAND@HOST: who made a leftover (a new RAND each call)."""
    return f"{os.getpid()}-{secrets.token_hex(4)}@{socket.gethostname()}"


def leftover_name(name: str, kind: str, token: str | None = None) -> str:
    """The hidden name of a temporary for `name`: a staging directory or temp
    file ("tmp"), an old copy moved aside ("old"), a checkpoint being deleted
    ("del"). Every temporary fastpersist makes is named so, and nothing else:
    `fpctl gc` and the daemon recognise them by this one pattern (_LEFTOVER).
    token: PID-RAND@HOST (process_token(); given where several processes
    must name the same directory, as a DCP save's ranks do)."""
    suffix = f".fp-{kind}-{token or process_token()}"
    whole = f".{name}{suffix}"
    if len(os.fsencode(whole)) <= MAX_NAME_BYTES or kind in _WHOLE_NAME_KINDS:
        return whole
    return f".{shortened(name)}{suffix}"


@dataclass(frozen=True)
class Leftover:
    path: Path
    target_name: str
    # "tmp": an unfinished (or replaced) save, or a temporary file (the `latest`
    # pointer's, fpctl restore's, the daemon's O_DIRECT probe); "old": moved
    # aside by a replace; "del": a checkpoint being deleted (retention);
    # "prep": a prepared part of a node-local distributed checkpoint, in doubt
    kind: str
    pid: int
    host: str
    is_dir: bool = True

    def is_for(self, name: str) -> bool:
        """Whether this is a leftover of a save (or delete) of `name`, whose
        name it carries whole or shortened (leftover_name)."""
        return self.target_name == name or self.target_name == shortened(name)

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


def leftover_of(path: Path, *, is_dir: bool = True) -> Leftover | None:
    """The leftover an entry of this name and type would be (its name alone,
    no I/O): a directory of any kind, or a regular file of kind "tmp"."""
    m = _LEFTOVER.match(path.name)
    if not m or not (is_dir or m["kind"] == "tmp"):
        return None
    return Leftover(path, m["name"], m["kind"], int(m["pid"]), m["host"], is_dir)


def parse_leftover(path: Path) -> Leftover | None:
    """The leftover at `path`, or None if it is not one: a directory of any
    kind, or a regular file of kind "tmp" (never a symbolic link)."""
    try:
        mode = os.lstat(path).st_mode
    except OSError:
        return None
    if not (stat.S_ISDIR(mode) or stat.S_ISREG(mode)):
        return None
    return leftover_of(path, is_dir=stat.S_ISDIR(mode))


def find_leftovers(root: Path) -> list[Leftover]:
    """The leftovers directly in `root`, by name."""
    found = []
    for entry in sorted(root.iterdir()):
        leftover = parse_leftover(entry)
        if leftover is not None:
            found.append(leftover)
    return found


def walk_leftovers(root: Path) -> list[Leftover]:
    """The leftovers anywhere under `root` (a Checkpointer root, a daemon's
    --root with runs in subdirectories), not looking inside checkpoints or
    leftovers, nor following symbolic links."""
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        if MANIFEST_NAME in filenames:
            dirnames[:] = []  # a checkpoint: nothing of ours inside
            continue
        here = Path(dirpath)
        for name in sorted(dirnames + filenames):
            leftover = parse_leftover(here / name)
            if leftover is None:
                continue
            found.append(leftover)
            if name in dirnames:
                dirnames.remove(name)
    return found


def restores(leftover: Leftover, *, dir_fd: int | None = None) -> bool:
    """Whether gc puts this leftover back instead of removing it: the old copy
    of an interrupted replace, when it is the only copy left. With dir_fd
    (the open parent), entries in it, and never through a link."""
    if dir_fd is None:
        target = leftover.path.parent / leftover.target_name
        return (
            leftover.kind == "old"
            and not os.path.lexists(target)
            and (leftover.path / MANIFEST_NAME).exists()
        )
    if leftover.kind != "old" or dirs.lexists(leftover.target_name, dir_fd):
        return False
    fd = dirs.open_dir(leftover.path.name, dir_fd)
    try:
        return stat.S_ISREG(os.stat(MANIFEST_NAME, dir_fd=fd, follow_symlinks=False).st_mode)
    except FileNotFoundError:
        return False
    finally:
        os.close(fd)


def collect(leftover: Leftover, *, dir_fd: int | None = None) -> str:
    """Clean one leftover whose owner is gone; returns what was done. With
    dir_fd (the open parent), entries in it, and never through a link."""
    target = leftover.path.parent / leftover.target_name
    if leftover.kind == "prep":
        # Its job may have committed: only the job's nodes together can tell.
        return f"kept {leftover.path.name}: in doubt ({IN_DOUBT_HELP})"
    if restores(leftover, dir_fd=dir_fd):
        if dir_fd is None:
            os.rename(leftover.path, target)
            fsync_dir(target.parent)
        else:
            os.rename(leftover.path.name, target.name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
            os.fsync(dir_fd)
        return f"restored {target} from {leftover.path.name}"
    if dir_fd is None:
        if leftover.is_dir:
            shutil.rmtree(leftover.path)
        else:
            os.unlink(leftover.path)
    else:
        dirs.remove_tree(leftover.path.name, dir_fd)  # (unlinks a file)
    return f"removed {leftover.path.name}"
