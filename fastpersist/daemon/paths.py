"""Request paths: what a request may name under the daemon's --root.

A request names a checkpoint by a path relative to the root. The daemon runs
with write access to the whole root, for every client, so a path must not
reach outside it (".." or an absolute path), must not name the hidden staging
and leftover directories that commit.py makes (names starting with "."), and
its last name must leave room for those directories' longer names.

Every component must also pass the one name rule (storage/names.py: no
backslash, control character or non-UTF-8 byte): a checkpoint the daemon
accepts must be one its tier can upload, and that is decided here, at Begin,
since after the commit nothing may fail.

This module checks a path's text only. The daemon never uses it as a path:
rootfs.py resolves its components one by one beneath the root's descriptor,
refusing symbolic links, so that a check and a use cannot be told apart by a
directory swapped in between.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from ..storage.leftovers import leftover_name
from ..storage.names import component_problem

MAX_PATH_BYTES = 1024
MAX_COMPONENT_BYTES = 255
# A checkpoint's staging (and leftover) directory is `.NAME.fp-KIND-PID-RAND@HOST`:
# NAME must leave room for the rest within the file system's 255 bytes (a PID
# has at most 7 digits: Linux's pid_max is at most 2**22).
MAX_NAME_BYTES = (MAX_COMPONENT_BYTES - len(leftover_name("", "tmp").encode())
                  + len(str(os.getpid())) - 7)


class PathError(ValueError):
    """The request's path is not acceptable; the message says why."""


@dataclass(frozen=True)
class RequestPath:
    parts: tuple[str, ...]  # components under the root; () is the root itself

    @property
    def text(self) -> str:
        return "/".join(self.parts)

    def under(self, root: Path) -> Path:
        """The absolute path, for messages and for comparing paths in memory."""
        return root.joinpath(*self.parts)


def _shown(relative: str) -> str:
    return repr(relative if len(relative) <= 80 else relative[:80] + "...")


def parse(relative: str, *, allow_root: bool = False, checkpoint: bool = True) -> RequestPath:
    """Check `relative` (its text only) and split it into components. A
    checkpoint's path (not a directory's to list) leaves room for its staging
    directory's name."""
    if "\x00" in relative:
        raise PathError("path contains a NUL byte")
    if len(relative.encode("utf-8", "surrogateescape")) > MAX_PATH_BYTES:
        raise PathError(f"path is longer than {MAX_PATH_BYTES} bytes")
    if relative.startswith("/"):
        raise PathError(f"path {_shown(relative)} is absolute; give it relative to the "
                        "daemon's root")
    parts = tuple(p for p in relative.split("/") if p)
    if not parts:
        if allow_root:
            return RequestPath(())
        raise PathError("path is empty")
    for part in parts:
        if part in (".", ".."):
            raise PathError(f"path {_shown(relative)} has a {part!r} component")
        if part.startswith("."):
            raise PathError(f"path {_shown(relative)} names a hidden entry ({_shown(part)})")
        problem = component_problem(part)
        if problem is not None:
            raise PathError(f"path {_shown(relative)} has {problem} in {_shown(part)}: "
                            "not a name every place a checkpoint goes (the object-store "
                            "tier's keys) can hold")
        if len(part.encode("utf-8", "surrogateescape")) > MAX_COMPONENT_BYTES:
            raise PathError(f"path component {_shown(part)} is longer than "
                            f"{MAX_COMPONENT_BYTES} bytes")
    if checkpoint and len(parts[-1].encode("utf-8", "surrogateescape")) > MAX_NAME_BYTES:
        raise PathError(f"a checkpoint's name may have at most {MAX_NAME_BYTES} bytes (its "
                        f"staging directory's name is longer): {_shown(parts[-1])}")
    return RequestPath(parts)
