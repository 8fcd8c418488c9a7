"""Confining request paths to the daemon's --root.

A request names a checkpoint by a path relative to the root. The daemon runs
with write access to the whole root, for every client, so a path must not
reach outside it (".." or an absolute path) nor through a symbolic link (which
could point anywhere), and must not name the hidden staging and leftover
directories that commit.py makes (names starting with ".").
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

MAX_PATH_BYTES = 1024
MAX_COMPONENT_BYTES = 255


class PathError(ValueError):
    """The request's path is not acceptable; the message says why."""


def confine(root: Path, relative: str, *, allow_root: bool = False) -> Path:
    """The absolute path for `relative` under `root`, after checking it.

    Components that exist must be real directories (or, for the last one, a
    directory or nothing): a symbolic link anywhere on the way is refused.
    """
    if "\x00" in relative:
        raise PathError("path contains a NUL byte")
    if len(relative.encode("utf-8", "surrogateescape")) > MAX_PATH_BYTES:
        raise PathError(f"path is longer than {MAX_PATH_BYTES} bytes")
    if relative.startswith("/"):
        raise PathError(f"path {relative!r} is absolute; give it relative to the daemon's root")
    parts = [p for p in relative.split("/") if p]
    if not parts:
        if allow_root:
            return root
        raise PathError("path is empty")
    for part in parts:
        if part in (".", ".."):
            raise PathError(f"path {relative!r} has a {part!r} component")
        if part.startswith("."):
            raise PathError(f"path {relative!r} names a hidden entry ({part!r})")
        if len(part.encode("utf-8", "surrogateescape")) > MAX_COMPONENT_BYTES:
            raise PathError(f"path component {part[:40]!r}... is too long")
    path = root
    for part in parts:
        path = path / part
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            break  # the rest will be created under a checked directory
        if stat.S_ISLNK(st.st_mode):
            raise PathError(f"{path.relative_to(root)} is a symbolic link; refused")
        if not stat.S_ISDIR(st.st_mode):
            raise PathError(f"{path.relative_to(root)} exists and is not a directory")
    return root.joinpath(*parts)
