"""Distributed checkpoints in the daemon: jobs, their parts, and the job commit.

A job is one distributed checkpoint's staging directory. Its parts are
ordinary daemon checkpoints (checkpoints.Checkpoint) with `job` set: each
rank's files, written into the job's directory under part_file_name(rank, i)
and, when durable, reported back with their records instead of committed.
The ranks gather the records, rank 0 builds the job manifest, and the first
rank of the storage domain hands it over with CommitJob: the daemon checks it
against the files it finds in the directory, writes it last and renames the
directory into place (commit.Staging.commit, as for any checkpoint).

On shared storage the ranks of other nodes write through their own daemons:
those daemons join the job by its id, "DIRECTORY:SECRET" (the staging
directory next to the checkpoint's path, whose marker file holds the
secret's hash). Only the daemon that made the
directory (BeginJob) commits, aborts or removes it, and only it holds the
path against other saves; a joining daemon forgets the job once its parts
are written and --idle-timeout has passed.

Node-local checkpoints are committed by rank 0's node for all: the other
nodes' first ranks call CommitJob with prepare_for, and their part is made
durable under a hidden `prep` name (commit.Staging.prepare) instead of
published; ResolvePrepared publishes or discards it once the ranks know
whether rank 0's node committed (resolve_prepared below). The daemon never
decides a prepared part itself, and never removes one on its own.

A job is dropped (its directory removed) by AbortJob, when one of its parts
fails or loses its client, and when nothing touched it (no request, no file
written into the directory, by this daemon or another) for --idle-timeout
after its parts here finished: the ranks died before committing it. The daemon
never commits a job on its own; the manifest is the ranks' together.

Torch-free: this runs in the daemon.
"""

from __future__ import annotations

import contextlib
import enum
import hashlib
import hmac
import json
import os
import secrets
import stat
import time
from pathlib import Path
from typing import TYPE_CHECKING

from ..commit import (
    Staging,
    discard_prepared,
    leftover_name,
    parse_leftover,
    publish_prepared,
)
from ..errors import ManifestError
from ..format.manifest import (
    DISTRIBUTED_SCHEMA_VERSION,
    MANIFEST_NAME,
    FileRecord,
    Manifest,
    TensorRecord,
    records_to_json,
)

if TYPE_CHECKING:
    from .checkpoints import Checkpoint

MAX_MANIFEST_BYTES = 64 << 20  # the daemon's gRPC message limit


MARKER_NAME = ".fastpersist-job"  # in a job's directory: the hash of its secret


class JobState(enum.Enum):
    OPEN = "open"
    COMMITTED = "committed"
    ABORTED = "aborted"


def _digest(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def split_job_id(job_id: str) -> tuple[str, str]:
    """(directory name, secret) of a job id "DIRECTORY:SECRET"."""
    name, sep, secret = job_id.rpartition(":")
    if not sep or not secret or not name or "/" in name or name in (".", ".."):
        raise ValueError("a job id is DIRECTORY:SECRET, as BeginJob returned it")
    return name, secret


class Job:
    """One distributed checkpoint's staging directory, as this daemon sees it.

    The id clients get is "DIRECTORY:SECRET": the directory is visible to
    anyone who can list the parent, the secret only to the ranks of the job
    (BeginJob returns it); every call on the job needs both. The directory
    holds a marker with the secret's hash, so that a daemon on another node can
    check a part's id before it joins, and refuses directories that are not
    jobs (other saves' staging)."""

    def __init__(self, target: Path, relpath: str, staging: Staging, owner: bool,
                 secret_digest: str) -> None:
        self.id = staging.path.name  # the directory: safe to log, unlike the secret
        self.target = target
        self.relpath = relpath
        self.staging = staging
        self.owner = owner  # this daemon made the directory (BeginJob)
        self.secret_digest = secret_digest
        self.parts: list[Checkpoint] = []
        self.state = JobState.OPEN
        self.committing = False  # CommitJob is checking and publishing it (unlocked)
        self.error = ""
        self.last_activity = time.monotonic()
        self.finished_at: float | None = None
        self.removed = False

    @classmethod
    def begin(cls, target: Path, relpath: str) -> tuple[Job, str]:
        """Make the directory and its marker; (job, the id to give the client)."""
        staging = Staging.create(target)
        secret = secrets.token_hex(16)
        try:
            (staging.path / MARKER_NAME).write_text(_digest(secret))
        except OSError:
            staging.abort()
            raise
        return cls(target, relpath, staging, True, _digest(secret)), f"{staging.path.name}:{secret}"

    @classmethod
    def join(cls, target: Path, relpath: str, name: str, secret: str) -> Job:
        """A job another daemon began: `name` (split_job_id) must be a job's
        directory next to `target`, and `secret` its secret. LookupError: no such job."""
        path = target.parent / name
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            raise LookupError(f"job {name} of {target.name} does not exist (any more)") from None
        leftover = parse_leftover(path) if stat.S_ISDIR(st.st_mode) else None
        if leftover is None or leftover.kind != "tmp" or leftover.target_name != target.name:
            raise ValueError(f"job {name!r} is not a staging directory of {target.name}")
        try:
            digest = (path / MARKER_NAME).read_text()
        except OSError:
            raise ValueError(f"{name} is not a distributed checkpoint's directory") from None
        if not hmac.compare_digest(digest, _digest(secret)):
            raise LookupError(f"job {name} of {target.name} does not exist (wrong secret)")
        return cls(target, relpath, Staging(target=target, path=path), False, digest)

    def holds(self, secret: str) -> bool:
        return hmac.compare_digest(self.secret_digest, _digest(secret))

    @property
    def open(self) -> bool:
        return self.state == JobState.OPEN

    def touch(self) -> None:
        self.last_activity = time.monotonic()

    def finish(self, state: JobState, error: str = "") -> None:
        if self.open:
            self.state = state
            self.error = error
            self.finished_at = time.monotonic()

    def remove_if_idle(self) -> None:
        """Remove an aborted job's directory once no worker of ours writes into
        it. It is renamed aside first, so that other nodes' daemons still
        writing parts fail to create files instead of recreating it."""
        if (self.state != JobState.ABORTED or not self.owner or self.removed
                or any(p.busy for p in self.parts)):
            return
        self.removed = True
        aside = self.staging.path.parent / leftover_name(self.target.name, "del")
        with contextlib.suppress(OSError):
            os.rename(self.staging.path, aside)
            self.staging.path = aside
        self.staging.abort()

    def idle_seconds(self, now: float) -> float | None:
        """How long nothing happened to an open job whose parts here finished:
        no request, and (parts of other nodes' daemons) no file in its
        directory written. None while something is going on."""
        if not self.open or self.committing or any(not p.terminal for p in self.parts):
            return None
        idle = now - self.last_activity
        try:
            newest = max([e.stat(follow_symlinks=False).st_mtime
                          for e in os.scandir(self.staging.path)]
                         + [os.stat(self.staging.path).st_mtime])
        except OSError:
            return idle  # the directory is gone: nothing more will happen
        return min(idle, time.time() - newest)


def part_json(files: list[FileRecord], tensors: list[TensorRecord]) -> str:
    """A part's records, as the manifest writes them (read by storage.ThroughDaemon)."""
    return json.dumps(records_to_json(files, tensors))


def check_job_manifest(job: Job, data: bytes, node: str) -> None:
    """The manifest a client hands over must describe what is in the directory:
    every file it places here exists with its size, nothing else is there, and
    the files this daemon wrote carry the records it computed. Raises
    ValueError naming the first difference."""
    if len(data) > MAX_MANIFEST_BYTES:
        raise ValueError(f"the manifest is over {MAX_MANIFEST_BYTES} bytes")
    try:
        manifest = Manifest.from_json(data, f"job manifest of {job.relpath}")
    except ManifestError as exc:
        raise ValueError(str(exc)) from None
    except RecursionError:
        raise ValueError("the manifest is nested too deeply") from None
    if manifest.globals is None or manifest.schema_version != DISTRIBUTED_SCHEMA_VERSION:
        raise ValueError("the manifest is not a distributed checkpoint's (no globals)")
    here = {f.name: f for f in manifest.files if not node or f.node == node}
    if node and any(f.node is None for f in manifest.files):
        raise ValueError(f"node {node!r} given, but the manifest has files without a node")
    found: dict[str, int] = {}
    for entry in os.scandir(job.staging.path):
        if entry.name == MARKER_NAME:
            continue
        if entry.name == MANIFEST_NAME or not entry.is_file(follow_symlinks=False):
            raise ValueError(f"the job's directory holds {entry.name!r}, which no part wrote")
        found[entry.name] = entry.stat(follow_symlinks=False).st_size
    missing = sorted(set(here) - set(found))
    extra = sorted(set(found) - set(here))
    if missing or extra:
        raise ValueError(f"the manifest and the job's directory disagree: files "
                         f"{missing[:5]} are missing, {extra[:5]} are not in the manifest")
    for name, record in here.items():
        if found[name] != record.size:
            raise ValueError(f"{name} is {found[name]} bytes; the manifest says {record.size}")
    written = {t.name: t for p in job.parts for t in p.tensor_records.values()}
    for t in manifest.tensors:
        mine = written.get(t.name)
        if mine is not None and (mine.file, mine.offset, mine.length, mine.crc32c) != (
                t.file, t.offset, t.length, t.crc32c):
            raise ValueError(f"tensor {t.name!r}: the manifest's record differs from the one "
                             "this daemon wrote")


def prepared_part(target: Path, name: str) -> Path:
    """The prepared part `name` of `target` (next to it, a `prep` directory of
    that name: never a symlink). ValueError if it is not one; LookupError if
    there is none."""
    if "/" in name or name in ("", ".", ".."):
        raise ValueError(f"{name!r} is not a prepared part's name")
    path = target.parent / name
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        raise LookupError(f"no prepared part {name} of {target.name}") from None
    leftover = parse_leftover(path) if stat.S_ISDIR(st.st_mode) else None
    if leftover is None or leftover.kind != "prep" or leftover.target_name != target.name:
        raise ValueError(f"{name!r} is not a prepared part of {target.name}")
    return path


def resolve_prepared(target: Path, prepared: Path, publish: bool) -> Path | None:
    """Publish a prepared part (its job committed), or discard it; returns a
    checkpoint the publish replaced, for the caller to remove."""
    if publish:
        return publish_prepared(prepared, target, remove_replaced=False)
    discard_prepared(prepared)
    return None
