"""Prepared parts: a node-local distributed checkpoint, committed by one node.

A node-local distributed checkpoint lies in pieces on every node's disk, yet
must appear on all of them or on none. Rank 0's node commits it for all
(commit.py, steps 2-4); every other node first *prepares* its part: step 2
(manifest durable) plus a marker naming the committing node, and the
directory renamed to a hidden `.NAME.fp-prep-...` name (leftovers.py), that
rename durable. Once rank 0's node has published, the others publish their
prepared part (steps 3-4); if it is known never to publish, they discard it.

Until then the part is in doubt: neither gc nor the daemon removes it, and
only the job's nodes together can decide it
(fastpersist/distributed/settling.py).

In-process saves name everything by path; the daemon passes the open
directory of the checkpoint's parent (dir_fd) and never follows a link.

Torch-free: the daemon imports this module.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import stat
from dataclasses import dataclass
from pathlib import Path

from ..format.manifest import MANIFEST_NAME
from . import dirs
from .commit import DirFds, Staging, os_error, remove_aside
from .dirs import fsync_dir
from .leftovers import Leftover, leftover_name, leftover_of

# In a prepared part: which node's publish commits its job, and the job's
# manifest digest (the job's name: every node's part holds the same manifest).
PREPARED_MARKER = ".fastpersist-prepared"
MAX_MARKER_BYTES = 4096
MAX_MANIFEST_BYTES = 1 << 30  # read whole: a manifest is far smaller


def manifest_digest(manifest: bytes) -> str:
    """Names a job: every node's directory of it holds the same manifest."""
    return hashlib.sha256(manifest).hexdigest()


def prepare(staging: Staging, manifest: bytes, commit_node: str) -> Path:
    """Step 2 for a node-local distributed checkpoint's part: manifest and
    marker durable, the directory renamed to a `prep` name and that rename
    durable. Returns the new path (staging.path follows it)."""
    marker = json.dumps({"commit_node": commit_node,
                         "manifest_sha256": manifest_digest(manifest)}).encode()
    prepared = staging.path.parent / leftover_name(staging.target.name, "prep")
    try:
        staging.write_file(MANIFEST_NAME, manifest)
        staging.write_file(PREPARED_MARKER, marker)
        staging.fsync()
        if staging.fds is None:
            os.rename(staging.path, prepared)
            staging.path = prepared  # (an abort from here removes it under this name)
            fsync_dir(prepared.parent)
        else:
            if not dirs.is_entry(staging.path.name, staging.fds.parent, staging.fds.staging):
                raise OSError(f"the staging directory of {staging.target} was moved or "
                              "replaced while it was written")
            os.rename(staging.path.name, prepared.name, src_dir_fd=staging.fds.parent,
                      dst_dir_fd=staging.fds.parent)
            staging.path = prepared
            os.fsync(staging.fds.parent)
    except OSError as exc:
        raise os_error(exc, f"cannot prepare checkpoint {staging.target}") from exc
    return prepared


def _staging_of(prepared: Path, target: Path, dir_fd: int | None) -> Staging:
    """A Staging for publishing a prepared part; with dir_fd, one holding its
    own descriptors (dir_fd stays the caller's)."""
    if dir_fd is None:
        return Staging(target=target, path=prepared)
    fd = dirs.open_dir(prepared.name, dir_fd)
    return Staging(target=target, path=prepared, fds=DirFds(os.dup(dir_fd), fd))


def publish_prepared(prepared: Path, target: Path, *, remove_replaced: bool = True,
                     dir_fd: int | None = None) -> Path | None:
    """Steps 3-4 for a prepared part whose job committed: it is a checkpoint
    under its name on return (Staging.commit for remove_replaced; a replaced
    checkpoint left for the caller is removed with dirs.remove_tree in dir_fd,
    or shutil.rmtree, by the caller)."""
    try:
        staging = _staging_of(prepared, target, dir_fd)
    except OSError as exc:
        raise os_error(exc, f"cannot publish {prepared}") from exc
    fds = staging.fds
    marker_fd = None if fds is None else os.dup(fds.staging)
    try:
        replaced = staging.publish(remove_replaced=remove_replaced)
        # Its job is no longer in doubt. (Left behind by a crash, it is ignored.)
        with contextlib.suppress(FileNotFoundError):
            if marker_fd is None:
                (target / PREPARED_MARKER).unlink()
            else:
                os.unlink(PREPARED_MARKER, dir_fd=marker_fd)
    finally:
        if marker_fd is not None:
            os.close(marker_fd)
        staging.close()
    return replaced


def discard_prepared(prepared: Path, *, dir_fd: int | None = None) -> None:
    """Remove a prepared part whose job did not commit. Renamed aside first:
    a part half removed must never look prepared (settle would publish it)."""
    leftover = leftover_of(prepared)
    remove_aside(prepared, leftover.target_name if leftover else prepared.name,
                 f"cannot remove {prepared}", dir_fd=dir_fd)


def check_prepared_name(target: Path, name: str, dir_fd: int) -> Path:
    """The prepared part `name` of `target` in dir_fd (target's open parent):
    a `prep` directory of that name, never a link. ValueError if it is not
    one; LookupError if there is none."""
    if "/" in name or name in ("", ".", ".."):
        raise ValueError(f"{name!r} is not a prepared part's name")
    path = target.parent / name
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        raise LookupError(f"no prepared part {name} of {target.name}") from None
    leftover = leftover_of(path) if stat.S_ISDIR(st.st_mode) else None
    if leftover is None or leftover.kind != "prep" or not leftover.is_for(target.name):
        raise ValueError(f"{name!r} is not a prepared part of {target.name}")
    return path


@dataclass(frozen=True)
class PreparedPart:
    """What a prepared part says of itself (prepare)."""

    path: Path
    target_name: str
    commit_node: str  # the node whose publish of target_name commits the job
    digest: str  # manifest_digest of the job manifest


def read_prepared(leftover: Leftover) -> PreparedPart | None:
    """The prepared part at a `prep` leftover; None if it is not one, or its
    marker or manifest cannot be read (then nothing can decide it)."""
    if leftover.kind != "prep" or not leftover.is_dir:
        return None
    try:
        fd = os.open(leftover.path, dirs.DIR_FLAGS)
    except OSError:
        return None
    try:
        marker = json.loads(dirs.read_regular(PREPARED_MARKER, fd, MAX_MARKER_BYTES))
        digest = manifest_digest(dirs.read_regular(MANIFEST_NAME, fd, MAX_MANIFEST_BYTES))
        node = marker["commit_node"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    finally:
        os.close(fd)
    if not isinstance(node, str) or marker.get("manifest_sha256") != digest:
        return None
    return PreparedPart(leftover.path, leftover.target_name, node, digest)
