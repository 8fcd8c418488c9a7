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

A job is dropped (its directory removed) by AbortJob, when one of its parts
fails or loses its client, and when nothing touched it (no request, no file
written into the directory, by this daemon or another) for --idle-timeout
after its parts here finished: the ranks died before committing it. The daemon
never commits a job on its own; the manifest is the ranks' together.

Node-local checkpoints are committed by rank 0's node for all: the other
nodes' first ranks call CommitJob with prepare_for, and their part is made
durable under a hidden `prep` name (prepared.py) instead of published;
ResolvePrepared publishes or discards it once the ranks know whether rank 0's
node committed. The daemon never decides a prepared part itself, and never
removes one on its own.

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
import time
from collections.abc import Callable
from pathlib import Path
from typing import Generic, Protocol, TypeVar

from ..errors import ManifestError
from ..format.bounds import MAX_MANIFEST_BYTES
from ..format.manifest import (
    DISTRIBUTED_SCHEMA_VERSION,
    IMPLIED_CHUNKS_SCHEMA_VERSION,
    MANIFEST_NAME,
    FileRecord,
    Manifest,
    TensorRecord,
    records_to_json,
)
from ..storage import dirs
from ..storage.commit import DirFds, Staging, write_durably
from ..storage.leftovers import leftover_name, leftover_of

MARKER_NAME = ".fastpersist-job"  # in a job's directory: the hash of its secret


class Part(Protocol):
    """What a job needs of its parts (checkpoints.Checkpoint)."""

    tensor_records: dict[str, TensorRecord]

    @property
    def terminal(self) -> bool: ...

    @property
    def in_use(self) -> bool: ...


P = TypeVar("P", bound=Part)


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


class Job(Generic[P]):
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
        self.parts: list[P] = []
        self.state = JobState.OPEN
        self.committing = False  # CommitJob is checking and publishing it (unlocked)
        self.error = ""
        self.last_activity = time.monotonic()
        self.finished_at: float | None = None
        self.removed = False
        # Removes the parent directories its BeginJob made, if they are empty.
        self.remove_parents: Callable[[], None] = lambda: None

    @classmethod
    def begin(cls, staging: Staging, relpath: str) -> tuple[Job[P], str]:
        """Mark a new staging directory (held open: Staging.create_at) as a
        job's; (job, the id to give the client). OSError: the marker failed."""
        assert staging.fds is not None
        secret = secrets.token_hex(16)
        write_durably(MARKER_NAME, _digest(secret).encode(), dir_fd=staging.fds.staging)
        job: Job[P] = cls(staging.target, relpath, staging, True, _digest(secret))
        return job, f"{staging.path.name}:{secret}"

    @classmethod
    def join(cls, parent_fd: int, target: Path, relpath: str, name: str, secret: str
             ) -> Job[P]:
        """A job another daemon began: `name` (split_job_id) must be a job's
        directory in `parent_fd` (the open directory of `target`, which the job
        owns from here on, also on failure), and `secret` its secret.
        LookupError: no such job; ValueError: not a job's directory."""
        try:
            leftover = leftover_of(target.parent / name)
            if leftover is None or leftover.kind != "tmp" or not leftover.is_for(target.name):
                raise ValueError(f"job {name!r} is not a staging directory of {target.name}")
            try:
                fd = dirs.open_dir(name, parent_fd)
            except FileNotFoundError:
                raise LookupError(f"job {name} of {target.name} does not exist (any more)"
                                  ) from None
            except OSError:
                raise ValueError(f"job {name!r} is not a staging directory of {target.name}"
                                 ) from None
            try:
                # A regular file, read without blocking: a FIFO planted as the
                # marker must not hang the request.
                digest = dirs.read_regular(MARKER_NAME, fd, 256).decode("ascii", "replace")
            except OSError:
                os.close(fd)
                raise ValueError(f"{name} is not a distributed checkpoint's directory") from None
        except BaseException:
            os.close(parent_fd)
            raise
        staging = Staging(target=target, path=target.parent / name, fds=DirFds(parent_fd, fd))
        if not hmac.compare_digest(digest, _digest(secret)):
            staging.close()
            raise LookupError(f"job {name} of {target.name} does not exist (wrong secret)")
        return cls(target, relpath, staging, False, digest)

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

    def take_removal(self) -> bool:
        """Whether this aborted job's directory is to be removed now: no worker
        of ours writes into it any more (and nobody took it on already).
        Called with the service lock held; remove() does the work without it."""
        if (self.state != JobState.ABORTED or not self.owner or self.removed
                or any(p.in_use for p in self.parts)):
            return False
        self.removed = True
        return True

    def remove(self) -> None:
        """Remove the directory (take_removal). It is renamed aside first, so
        that other nodes' daemons still writing parts fail to create files
        instead of recreating it."""
        fds = self.staging.fds
        if fds is not None and dirs.is_entry(self.staging.path.name, fds.parent, fds.staging):
            aside = self.staging.path.parent / leftover_name(self.target.name, "del")
            with contextlib.suppress(OSError):
                os.rename(self.staging.path.name, aside.name, src_dir_fd=fds.parent,
                          dst_dir_fd=fds.parent)
                self.staging.path = aside
        self.staging.abort()
        self.remove_parents()

    def close(self) -> None:
        """Forget a job another daemon began (its directory is that daemon's)."""
        if not self.owner:
            self.staging.close()

    def quiet(self) -> bool:
        """An open job whose parts here all finished: only the ranks' CommitJob,
        or other nodes' daemons writing their parts, can move it on."""
        return self.open and not self.committing and all(p.terminal for p in self.parts)

    def newest_write(self) -> float | None:
        """The time (time.time()) of the last change to the job's directory (a
        part another node's daemon writes into it), None if it is gone. Reads
        the directory: called without the service lock."""
        fds = self.staging.fds
        try:
            if fds is None or not dirs.is_entry(self.staging.path.name, fds.parent,
                                                fds.staging):
                return None  # the directory is gone: nothing more will happen
            with os.scandir(fds.staging) as entries:
                return max([e.stat(follow_symlinks=False).st_mtime for e in entries]
                           + [os.fstat(fds.staging).st_mtime])
        except OSError:
            return None

    def idle_seconds(self, now: float, newest_write: float | None) -> float | None:
        """How long nothing happened to a quiet job: no request, and no file in
        its directory written (newest_write). None while it is not quiet."""
        if not self.quiet():
            return None
        idle = now - self.last_activity
        return idle if newest_write is None else min(idle, time.time() - newest_write)


def part_json(files: list[FileRecord], tensors: list[TensorRecord]) -> str:
    """A part's records, as the manifest writes them (read by storage.ThroughDaemon)."""
    return json.dumps(records_to_json(files, tensors))


def check_job_manifest(job: Job[P], data: bytes, node: str) -> None:
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
    # A job's manifest lists its chunks (schema 2) or lets the records' names
    # imply them (schema 3); either way its globals were checked by from_json.
    if manifest.globals is None or manifest.schema_version not in (
            DISTRIBUTED_SCHEMA_VERSION, IMPLIED_CHUNKS_SCHEMA_VERSION):
        raise ValueError("the manifest is not a distributed checkpoint's (no globals)")
    here = {f.name: f for f in manifest.files if not node or f.node == node}
    if node and any(f.node is None for f in manifest.files):
        raise ValueError(f"node {node!r} given, but the manifest has files without a node")
    found: dict[str, int] = {}
    assert job.staging.fds is not None
    with os.scandir(job.staging.fds.staging) as entries:
        listed = list(entries)
    for entry in listed:
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
