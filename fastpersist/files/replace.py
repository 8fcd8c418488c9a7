"""One file, replaced atomically: written to a hidden temporary beside it,
fsynced, renamed over it, the directory fsynced. A crash at any moment
leaves the old file or the new one under the name, never part of one; the
temporary carries leftovers.py's name, so `fpctl gc` removes it.
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Callable
from pathlib import Path

from ..errors import CheckpointExistsError
from ..storage.commit import fsync_dir, fsync_file, leftover_name, os_error
from .kinds import Kind, describe, kind_of, read_prefix


def check_replaceable(target: Path, kind: Kind) -> None:
    """Refuse to replace anything but an empty file or one of `kind`'s family
    (a torch file for a torch file): as with checkpoint directories, a save
    never destroys what it did not write."""
    try:
        st = os.lstat(target)
    except FileNotFoundError:
        return
    if stat.S_ISDIR(st.st_mode):  # (save() keeps directory saves for existing directories)
        raise CheckpointExistsError(errno.EISDIR, f"{target} is a directory")
    if not stat.S_ISREG(st.st_mode):
        raise CheckpointExistsError(errno.EEXIST, f"{target} exists and is not a regular file, "
                                                  "so it will not be replaced")
    if st.st_size == 0:
        return
    prefix = read_prefix(target)
    found = kind_of(prefix)
    if found is None or found.is_torch != kind.is_torch:
        what = f"it is {found.value}" if found is not None else describe(prefix)
        raise CheckpointExistsError(
            errno.EEXIST, f"{target} exists and is not a checkpoint or {kind.value} ({what}), "
            "so it will not be replaced; remove it or choose another name")


def replace_atomically(target: Path, kind: Kind, write: Callable[[Path], None]) -> None:
    """write(temporary) then publish it as `target` (missing parents are
    created, and removed again if the save fails). Durable on return."""
    check_replaceable(target, kind)
    created = _make_parents(target.parent)
    tmp = target.with_name(leftover_name(target.name, "tmp"))
    try:
        try:
            write(tmp)
            fsync_file(tmp)
            os.replace(tmp, target)
            fsync_dir(target.parent)
        except OSError as exc:
            raise os_error(exc, f"cannot write {target}") from exc
    except BaseException:
        tmp.unlink(missing_ok=True)
        for d in reversed(created):
            try:
                d.rmdir()
            except OSError:
                break
        raise


def _make_parents(directory: Path) -> list[Path]:
    missing = []
    while not directory.exists():
        missing.append(directory)
        directory = directory.parent
    created = []
    try:
        for d in reversed(missing):
            d.mkdir()
            created.append(d)
            fsync_dir(d.parent)
    except OSError as exc:
        raise os_error(exc, f"cannot create {d}") from exc
    return created
