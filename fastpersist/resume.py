"""Which checkpoint a training run resumes from, and which ones it passed over.

A Checkpointer's latest() answers "the newest durable checkpoint". A newer
step that cannot be used (its manifest unreadable, a data file missing or
cut short) is never the answer, but it is never passed over silently either:
a loop that quietly resumes from an older step repeats hours of work. Each
one passed over is logged (logger `fastpersist.checkpointer`) and recorded as
a Skipped; in strict mode it raises instead.

Judging a checkpoint here reads its manifest and stats its data files; no
tensor byte is read (a checksum mismatch shows at load: load_latest() falls
back past it in the same way).
"""

from __future__ import annotations

import logging
import os
import warnings
from collections.abc import Callable, Container
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .errors import (
    CheckpointError,
    CheckpointExistsError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
)
from .format.manifest import MANIFEST_NAME
from .storage.retention import LATEST, step_of
from .tensors.committed import damage, read_manifest

if TYPE_CHECKING:
    from .tier.client import S3
    from .tier.url import TierURL

log = logging.getLogger("fastpersist.checkpointer")


@dataclass(frozen=True)
class Skipped:
    """A checkpoint that latest() or load_latest() passed over, and why."""

    path: Path | str  # a local directory, or an s3:// URL
    reason: str


def problem(path: Path) -> str | None:
    """Why the checkpoint at `path` cannot be resumed from (None: it looks whole)."""
    try:
        manifest = read_manifest(path)
    except CheckpointError as exc:
        return str(exc)
    return damage(path, manifest)


class Judge:
    """Asks problem() of each candidate, newest first, and records (or, strict,
    raises) each one that has one. One Judge per latest()/load_latest() call."""

    def __init__(self, strict: bool) -> None:
        self.strict = strict
        self.skipped: list[Skipped] = []
        self._judged: dict[Path, bool] = {}  # each one judged (and reported) once

    def usable(self, path: Path) -> bool:
        if path not in self._judged:
            reason = problem(path)
            if reason is not None:
                self.skip(path, reason)
            self._judged[path] = reason is None
        return self._judged[path]

    def skip(self, path: Path | str, reason: str,
             cause: BaseException | None = None) -> None:
        reason = reason.removeprefix(f"{path}: ")  # errors name the checkpoint first
        if self.strict:
            raise CorruptCheckpointError(
                f"{path} is the newest checkpoint, and it cannot be used: {reason} (strict=True; "
                "pass strict=False to fall back to an older checkpoint with a warning)"
            ) from cause
        log.warning("skipping checkpoint %s, which cannot be used: %s; resuming from an older "
                    "one", path, reason)
        self.skipped.append(Skipped(path, reason))


def step_dirs(root: Path) -> list[tuple[int, Path]]:
    """(step, directory) of every step-N entry under root, committed or not,
    by ascending step: names only, no manifest is read."""
    if not root.is_dir():
        return []
    return sorted((step, entry) for entry in root.iterdir()
                  if (step := step_of(entry.name)) is not None)


def _committed_at(path: Path) -> int | None:
    """When the checkpoint at path was committed (its manifest is written
    last); None if it has no manifest to tell."""
    try:
        return os.stat(path / MANIFEST_NAME).st_mtime_ns
    except OSError:
        return None


def newest_local(root: Path, usable: Callable[[Path], bool],
                 exclude: Container[object] = ()) -> Path | None:
    """The newest durable checkpoint under root that `usable` accepts, or None.

    ROOT/latest is trusted (an operator may point it back at an older step
    to roll back), except where a higher step was committed after the
    pointer was written: its pointer update failed (PostCommitError), or
    an older daemon committed it after the trainer that would have moved
    the pointer had died; it is the newest state there is. Judges only the
    checkpoints it needs: newest first, stopping at the answer. `exclude`:
    checkpoints already found unusable by a load."""
    dirs = [(s, e) for s, e in step_dirs(root) if e not in exclude]
    pointer = root / LATEST
    try:
        name = pointer.read_text().strip()
        pointed_at = os.stat(pointer).st_mtime_ns
    except OSError:
        name, pointed_at = "", 0
    # Entries are returned as found: a checkpoint saved by hand as step-7 is
    # step-7, not path_for(7).
    named = next(((s, e) for s, e in dirs if e.name == name), None)
    if named is not None:
        # Newer steps first: one committed after the pointer was written wins.
        for step, entry in reversed(dirs):
            if step <= named[0]:
                break
            # A step committed before the pointer was written was rolled back
            # from: not an answer, nor a loss. One without a manifest is judged.
            committed_at = _committed_at(entry)
            if (committed_at is None or committed_at > pointed_at) and usable(entry):
                return entry
        if usable(named[1]):
            return named[1]
    # No pointer, it names something gone or unusable: the highest usable step.
    return next((e for s, e in reversed(dirs)
                 if (named is None or e != named[1]) and usable(e)), None)


def newest_stored(s3: S3, url: TierURL, name: str = "",
                  exclude: Container[object] = ()) -> str | None:
    """The URL of the newest step-N checkpoint committed in the store at
    `url` (only `name`, if given), not in `exclude`; None if none."""
    from .tier.remote import entries

    found = [e for e in entries(s3, url)
             if e.committed and e.step is not None and (not name or e.name == name)
             and str(url.child(e.name)) not in exclude]
    if not found:
        return None
    newest = max(found, key=lambda e: (e.step, e.modified))
    return str(url.child(newest.name))


def newest_with_store(root: Path, local: Path | None, exclude: Container[Path | str],
                      mirror: tuple[S3, TierURL] | None, daemon: str) -> Path | str | None:
    """latest() where the root's checkpoints may also be in an object store
    (`mirror`: a Checkpointer's tier; else its daemon's --tier, ROOT/REL at
    PREFIX/REL): the store's newest step when `latest` names a step whose
    directory is gone (a node lost; a step rolled back from is not read
    from the store), or when nothing is usable here; else `local`."""
    pointed = ""
    if local is not None:
        try:
            pointed = (root / LATEST).read_text().strip()
        except OSError:
            return local
        if not pointed or (root / pointed).exists():
            return local
    store = mirror or (_daemon_store(daemon, root) if daemon else None)
    if store is None:
        return local
    try:
        return newest_stored(*store, pointed, exclude) or local
    except CheckpointError as exc:
        if mirror is not None:
            raise
        # The daemon's store, not the Checkpointer's: looked at only for a
        # step lost here, and a store that is down does not stop a start.
        warnings.warn(f"{root}: cannot look for checkpoints in fastpersistd's tier "
                      f"{store[1]}: {exc}", RuntimeWarning, stacklevel=4)
        return local


def newest_anywhere(root: Path, local: Path | None, exclude: Container[Path | str],
                    mirror: tuple[S3, TierURL] | None, daemon: str) -> Path | str | None:
    """newest_with_store, or where nothing is found here or in a store, the
    newest step the daemon's peers hold whole (a node whose disk is gone)."""
    found = newest_with_store(root, local, exclude, mirror, daemon)
    if found is None and daemon:
        from .loading.copies import newest_on_peers

        found = newest_on_peers(daemon, root, exclude)
    return found


def _daemon_store(daemon: str, root: Path) -> tuple[S3, TierURL] | None:
    from .loading.chain import NoCopy
    from .loading.copies import daemon_tier
    from .tier.client import client_for

    try:
        url = daemon_tier(daemon, root)
    except NoCopy:
        return None
    # Only now: making a client looks for credentials (a cloud's metadata
    # service, where none are configured), which a daemon without a tier
    # must not cost a latest().
    return client_for(None), url


def not_found(root: Path | str, skipped: list[Skipped], where: str = ""
              ) -> CheckpointNotFoundError:
    """No checkpoint to resume from; naming the ones that were passed over."""
    why = ""
    if skipped:
        why = "; passed over: " + "; ".join(f"{s.path} ({s.reason})" for s in skipped)
    return CheckpointNotFoundError(f"no usable committed checkpoint under {root}{where}{why}")


def refuse_existing(step: int, existing: Path | str | None, pending: Any,
                    path: Path | str) -> None:
    """CheckpointExistsError if `step` is saved (at `existing`) or its save
    (`pending`, a SaveFuture) is in flight: a step is saved once."""
    if existing is not None or (pending is not None and not pending.done()):
        raise CheckpointExistsError(
            f"step {step} is already saved at {existing or path}"
            f"{'' if existing else ' (its save is in flight)'}; a resumed loop starts at "
            "the step after the one it loaded; pass overwrite=True to replace it")
