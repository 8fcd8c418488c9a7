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
those daemons join the job by its id, the staging directory's name, which
they find next to the checkpoint's path. Only the daemon that made the
directory (BeginJob) commits, aborts or removes it, and only it holds the
path against other saves; a joining daemon forgets the job once its parts
are written and --idle-timeout has passed.

A job is dropped (its directory removed) by AbortJob, when one of its parts
fails or loses its client, and when nothing touched it for --idle-timeout
after its parts finished: the ranks died before committing it. The daemon
never commits a job on its own; the manifest is the ranks' together.

Torch-free: this runs in the daemon.
"""

from __future__ import annotations

import enum
import json
import os
import stat
import time
from pathlib import Path
from typing import TYPE_CHECKING

from ..commit import Staging, parse_leftover
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


class JobState(enum.Enum):
    OPEN = "open"
    COMMITTED = "committed"
    ABORTED = "aborted"
    RELEASED = "released"  # begun by another daemon; this one's parts are done


class Job:
    def __init__(self, target: Path, relpath: str, staging: Staging, owner: bool) -> None:
        self.id = staging.path.name
        self.target = target
        self.relpath = relpath
        self.staging = staging
        self.owner = owner  # this daemon made the directory (BeginJob)
        self.parts: list[Checkpoint] = []
        self.state = JobState.OPEN
        self.committing = False  # CommitJob is checking and publishing it (unlocked)
        self.error = ""
        self.last_activity = time.monotonic()
        self.finished_at: float | None = None
        self.removed = False

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
        """Remove an aborted job's directory once no worker writes into it."""
        if (self.state == JobState.ABORTED and self.owner and not self.removed
                and not any(p.busy for p in self.parts)):
            self.removed = True
            self.staging.abort()

    def idle_since(self, now: float) -> float | None:
        """Seconds nothing happened to an open job whose parts all finished."""
        if not self.open or self.committing or any(not p.terminal for p in self.parts):
            return None
        return now - self.last_activity


def job_staging(target: Path, job_id: str) -> Staging:
    """The staging directory of a job that another daemon began: `job_id` must
    name an unfinished save of `target` next to it, a real directory."""
    if "/" in job_id or job_id in ("", ".", ".."):
        raise ValueError(f"job id {job_id!r} is not a directory name")
    path = target.parent / job_id
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        raise LookupError(f"job {job_id} of {target.name} does not exist (any more)") from None
    leftover = parse_leftover(path) if stat.S_ISDIR(st.st_mode) else None
    if leftover is None or leftover.kind != "tmp" or leftover.target_name != target.name:
        raise ValueError(f"job id {job_id!r} is not a staging directory of {target.name}")
    return Staging(target=target, path=path)


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
    if manifest.globals is None or manifest.schema_version != DISTRIBUTED_SCHEMA_VERSION:
        raise ValueError("the manifest is not a distributed checkpoint's (no globals)")
    here = {f.name: f for f in manifest.files if not node or f.node == node}
    if node and any(f.node is None for f in manifest.files):
        raise ValueError(f"node {node!r} given, but the manifest has files without a node")
    found: dict[str, int] = {}
    for entry in os.scandir(job.staging.path):
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
