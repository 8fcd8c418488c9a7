"""The daemon's checkpoints: their states, their memory, and their writes.

One Checkpoint per Begin. Its life:

    RECEIVING  files arrive (SubmitShm / SubmitStream) and are written as they
               come, in submission order, by the write workers
    WRITING    Commit received: every file is in the daemon's hands; from here
               on the daemon finishes it whatever the client does
    COMMITTED  manifest written last, renamed into place, fsynced (commit.py)
    FAILED / ABORTED   the staging directory is removed; nothing is visible

Fairness: the workers take the next file from the client served least
recently, one file per checkpoint at a time, so one client with a large
checkpoint cannot starve another. Memory: a checkpoint reserves, at Begin, the
shared memory it will reference; the sum over checkpoints in flight is bounded
by --staging-budget and per client by --client-budget.

Torch-free: this runs in the daemon.
"""

from __future__ import annotations

import enum
import json
import math
import mmap
import os
import secrets
import shutil
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .. import knobs
from .._version import __version__
from ..commit import Staging, os_error
from ..engine import Engine, Segment, get_engine
from ..errors import CheckpointError
from ..format import dtypes, safetensors_file
from ..format.manifest import MANIFEST_NAME, FileRecord, Manifest, TensorRecord
from ..format.names import data_file_name, part_file_name
from ..shm import Mapping
from . import logs
from .jobs import (
    MARKER_NAME,
    Job,
    JobState,
    check_job_manifest,
    part_json,
    prepared_part,
    resolve_prepared,
    split_job_id,
)
from .metrics import Metrics

MAX_FILES = 100_000
MAX_TENSORS = 10_000_000
MAX_IN_FLIGHT_PER_CLIENT = 16
# Terminal checkpoints stay known this long, so a late Wait still gets the result.
KEEP_FINISHED_SECONDS = 600.0


class State(enum.IntEnum):  # the values of CheckpointStatus.State
    RECEIVING = 1
    WRITING = 2
    COMMITTED = 3
    FAILED = 4
    ABORTED = 5


TERMINAL = (State.COMMITTED, State.FAILED, State.ABORTED)


class RequestError(Exception):
    """A request the daemon refuses; `code` is the gRPC status code's name."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


def invalid(message: str) -> RequestError:
    return RequestError("INVALID_ARGUMENT", message)


@dataclass
class PendingFile:
    index: int
    header: bytes
    entries: list[safetensors_file.ParsedEntry]  # by offset in the data section
    data: Mapping  # the data section's bytes: a shared-memory range or a stream buffer
    nbytes: int = field(init=False)  # of the data section (the view is released after use)

    def __post_init__(self) -> None:
        self.nbytes = len(self.data.view)

    @property
    def data_start(self) -> int:
        return len(self.header)


def parse_data_file(index: int, header: bytes, data_length: int, files_total: int
                    ) -> list[safetensors_file.ParsedEntry]:
    """Check a submitted file's header against the data it comes with."""
    if not 0 <= index < files_total:
        raise invalid(f"file index {index} is outside 0..{files_total - 1}")
    try:
        data_start, entries, _ = safetensors_file.parse_header(header)
    except safetensors_file.HeaderError as exc:
        raise invalid(f"data file {index}: {exc}") from None
    if data_start != len(header):
        raise invalid(f"data file {index}: the header is {len(header)} bytes but says "
                      f"{data_start}")
    if data_start % knobs.ALIGNMENT:
        raise invalid(f"data file {index}: the data section starts at {data_start}, not on a "
                      f"{knobs.ALIGNMENT}-byte boundary")
    ordered = sorted(entries.values(), key=lambda e: (e.begin, e.end))
    cursor = 0
    for e in ordered:
        want = math.prod(e.shape) * dtypes.itemsize(e.dtype)
        if e.end - e.begin != want:
            raise invalid(f"data file {index}: tensor {e.name!r} spans {e.end - e.begin} bytes, "
                          f"its shape and dtype need {want}")
        if e.begin != cursor:
            raise invalid(f"data file {index}: tensor {e.name!r} starts at {e.begin}, expected "
                          f"{cursor} (tensors must tile the data section)")
        cursor = e.end
    if cursor != data_length:
        raise invalid(f"data file {index}: the header's tensors cover {cursor} bytes, the data "
                      f"is {data_length}")
    return ordered


class Checkpoint:
    def __init__(self, ident: str, client: str, target: Path, relpath: str,
                 staging: Staging, files_total: int, reserved: int,
                 job: Job | None = None, rank: int = 0) -> None:
        self.id = ident
        self.job = job  # a part of this distributed checkpoint (jobs.py)
        self.rank = rank  # the part's rank: its files are part_file_name(rank, i)
        self.part_json = ""  # the part's records, once its files are durable
        self.client = client
        self.target = target
        self.relpath = relpath
        self.staging = staging
        self.files_total = files_total
        self.reserved = reserved
        self.state = State.RECEIVING
        self.error = ""
        self.error_code = ""
        self.pending: deque[PendingFile] = deque()
        self.submitted: set[int] = set()
        self.names: set[str] = set()  # tensor names over all submitted files
        self.mapped_bytes = 0  # data of submitted files not yet written
        self.file_records: dict[int, FileRecord] = {}
        self.tensor_records: dict[str, TensorRecord] = {}
        self.files_written = 0
        self.bytes_written = 0
        self.bytes_total = 0
        self.handed_over = False  # Commit received
        self.tree: Any = None
        self.tensor_order: list[str] = []
        self.busy = False  # a worker is writing one of its files or committing it
        self.watchers = 0
        self.last_activity = time.monotonic()
        self.first_submit: float | None = None
        self.finished_at: float | None = None
        self.cleaned = False  # staging directory removed (after a failure or abort)

    def clean_up(self) -> None:
        """Remove a failed checkpoint's staging (a part's goes with its job)."""
        if not self.cleaned:
            self.cleaned = True
            self.staging.abort()

    def file_name(self, index: int) -> str:
        return part_file_name(self.rank, index) if self.job else data_file_name(index)

    @property
    def terminal(self) -> bool:
        return self.state in TERMINAL

    def runnable(self) -> bool:
        if self.busy or self.terminal:
            return False
        return bool(self.pending) or (self.handed_over and self.files_written == self.files_total)

    def status(self) -> dict[str, Any]:
        return {
            "checkpoint_id": self.id, "path": self.relpath, "state": int(self.state),
            "bytes_written": self.bytes_written, "bytes_total": self.bytes_total,
            "error": self.error, "files_written": self.files_written,
            "files_total": self.files_total, "error_code": self.error_code,
            "part_json": self.part_json,
        }


@dataclass(frozen=True)
class Budgets:
    staging: int  # bytes, all clients; 0: unlimited
    client: int  # bytes, one client; 0: unlimited


class Service:
    """Everything the gRPC layer calls; thread-safe."""

    def __init__(self, root: Path, shm_dir: Path, budgets: Budgets, metrics: Metrics,
                 write_concurrency: int = 2, idle_timeout: float = 300.0,
                 engine: Engine | None = None) -> None:
        self.root = root
        self.shm_dir = shm_dir
        self.budgets = budgets
        self.metrics = metrics
        self.idle_timeout = idle_timeout
        self.engine = engine or get_engine()
        self._cond = threading.Condition()
        self._checkpoints: dict[str, Checkpoint] = {}
        self._jobs: dict[str, Job] = {}
        self._resolving: set[Path] = set()  # targets a prepared part is published to
        self._served: dict[str, int] = {}  # client -> tick of its last file (fairness)
        self._tick = 0
        self._stopping = False
        self._draining = False
        self._workers = [threading.Thread(target=self._work, name=f"fpd-writer-{i}", daemon=True)
                         for i in range(write_concurrency)]
        for w in self._workers:
            w.start()
        metrics.staging_budget.set(budgets.staging)

    # -- queries -----------------------------------------------------------

    def reserved(self, client: str | None = None) -> int:
        return sum(c.reserved for c in self._checkpoints.values()
                   if not c.terminal and (client is None or c.client == client))

    def in_flight(self) -> list[Checkpoint]:
        with self._cond:
            return [c for c in self._checkpoints.values() if not c.terminal]

    def busy_at(self, target: Path) -> bool:
        """Whether a checkpoint or job of `target` is in flight (Delete waits)."""
        with self._cond:
            return any(c.target == target for c in self._checkpoints.values()
                       if not c.terminal) or any(j.target == target and j.open and j.owner
                                                 for j in self._jobs.values()
                                                 ) or target in self._resolving

    def get_job(self, job_id: str) -> Job:
        """The job with this id (DIRECTORY:SECRET); NOT_FOUND without the right secret."""
        name, secret = _split(job_id)
        job = self._jobs.get(name)
        if job is None or not job.holds(secret):
            raise RequestError("NOT_FOUND", f"no job {name!r} (unknown, long finished, or "
                                            "not with that secret)")
        return job

    def get(self, ident: str) -> Checkpoint:
        ck = self._checkpoints.get(ident)
        if ck is None:
            raise RequestError("NOT_FOUND", f"no checkpoint {ident!r} (unknown or long finished)")
        return ck

    # -- Begin ---------------------------------------------------------------

    def begin(self, target: Path, relpath: str, client: str, staging_bytes: int,
              file_count: int, job_id: str = "", rank: int = 0) -> Checkpoint:
        _check_client(client)
        if not 0 <= file_count <= MAX_FILES:
            raise invalid(f"file_count {file_count} is outside 0..{MAX_FILES}")
        with self._cond:
            if self._draining:
                raise RequestError("UNAVAILABLE", "fastpersistd is shutting down")
            self._prune()
            mine = [c for c in self._checkpoints.values() if not c.terminal and c.client == client]
            if len(mine) >= MAX_IN_FLIGHT_PER_CLIENT:
                raise RequestError("RESOURCE_EXHAUSTED",
                                   f"client {client} has {len(mine)} checkpoints in flight, the "
                                   f"most one client may have")
            job, new_job = self._join_job(target, relpath, job_id) if job_id else (None, False)
            self._check_target_free(target, relpath, job)
            if job is not None and any(p.rank == rank and p.state not in (
                    State.FAILED, State.ABORTED) for p in job.parts):
                raise invalid(f"rank {rank} already has a part in job {job.id}")
            b = self.budgets
            if b.client and self.reserved(client) + staging_bytes > b.client:
                raise RequestError(
                    "RESOURCE_EXHAUSTED",
                    f"client {client} would hold {self.reserved(client) + staging_bytes} bytes "
                    f"of staging, over the daemon's per-client budget of {b.client}")
            if b.staging and self.reserved() + staging_bytes > b.staging:
                raise RequestError(
                    "RESOURCE_EXHAUSTED",
                    f"{staging_bytes} bytes of staging do not fit the daemon's budget: "
                    f"{self.reserved()} of {b.staging} are in use")
            if job is not None:
                staging = job.staging
            else:
                try:
                    staging = Staging.create(target)
                except CheckpointError as exc:
                    raise RequestError(_code_for(exc), str(exc)) from None
            ck = Checkpoint(secrets.token_hex(12), client, target, relpath, staging, file_count,
                            staging_bytes, job, rank)
            if job is not None:
                if new_job:
                    self._jobs[job.id] = job
                job.parts.append(ck)
                job.touch()
            self._checkpoints[ck.id] = ck
            self._update_gauges()
        logs.info("begin", checkpoint=ck.id, client=client, path=relpath, files=file_count,
                  staging_bytes=staging_bytes, **({"job": job.id, "rank": rank} if job else {}))
        return ck

    def _check_target_free(self, target: Path, relpath: str, job: Job | None) -> None:
        """No other save of, inside or around `target` in flight (but the parts
        of one job share it); not inside a checkpoint. Called with the lock held."""
        def clash(other: Path) -> bool:
            return other == target or other in target.parents or target in other.parents

        for c in self._checkpoints.values():
            if not c.terminal and clash(c.target) and (job is None or c.job is not job):
                raise RequestError(
                    "FAILED_PRECONDITION",
                    f"a checkpoint of {c.relpath} is in flight; {relpath} may not be it, "
                    "inside it or around it")
        if target in self._resolving:
            raise RequestError("FAILED_PRECONDITION",
                               f"a prepared part of {relpath} is being published")
        # A job another daemon began is that daemon's to guard (and to finish:
        # this one never learns when it is committed).
        for j in self._jobs.values():
            if j.open and j.owner and clash(j.target) and j is not job:
                raise RequestError(
                    "FAILED_PRECONDITION",
                    f"a distributed checkpoint of {j.relpath} is in flight; {relpath} may not "
                    "be it, inside it or around it")
        inside = next((p for p in target.parents
                       if self.root in p.parents and (p / MANIFEST_NAME).exists()), None)
        if inside is not None:
            raise invalid(f"{relpath} lies inside the checkpoint "
                          f"{inside.relative_to(self.root)}")

    # -- jobs (distributed checkpoints, jobs.py) ---------------------------------

    def begin_job(self, target: Path, relpath: str, client: str) -> str:
        """Make a job's directory; returns its id (DIRECTORY:SECRET)."""
        _check_client(client)
        with self._cond:
            if self._draining:
                raise RequestError("UNAVAILABLE", "fastpersistd is shutting down")
            self._prune()
            self._check_target_free(target, relpath, None)
            try:
                job, job_id = Job.begin(target, relpath)
            except CheckpointError as exc:
                raise RequestError(_code_for(exc), str(exc)) from None
            except OSError as exc:
                raise RequestError("INTERNAL", f"cannot mark the job's directory: {exc}") from None
            self._jobs[job.id] = job
        logs.info("begin-job", job=job.id, client=client, path=relpath)
        return job_id

    def _join_job(self, target: Path, relpath: str, job_id: str) -> tuple[Job, bool]:
        """The job a part belongs to, and whether it is new here: one begun by
        another node's daemon (shared storage) is taken on by its directory
        (registered by the caller once the part is accepted). Lock held."""
        name, secret = _split(job_id)
        job = self._jobs.get(name)
        new = job is None
        if job is None:
            try:
                job = Job.join(target, relpath, name, secret)
            except LookupError as exc:
                raise RequestError("NOT_FOUND", str(exc)) from None
            except (ValueError, OSError) as exc:
                raise invalid(str(exc)) from None
        elif not job.holds(secret):
            raise RequestError("NOT_FOUND", f"no job {name!r} with that secret")
        if job.target != target:
            raise invalid(f"job {job.id} saves {job.relpath}, not {relpath}")
        self._require_open(job)
        return job, new

    def commit_job(self, job_id: str, manifest: bytes, node: str, prepare_for: str = "") -> str:
        """Check the job manifest against the directory, write it, publish;
        with prepare_for, prepare the part instead (jobs.py) and return its
        name. The checks and the I/O run outside the lock, as a worker's commit
        does; meanwhile `committing` keeps parts out and aborts off."""
        with self._cond:
            job = self.get_job(job_id)
            if not job.owner:
                raise RequestError("FAILED_PRECONDITION",
                                   f"job {job.id} was begun by another daemon; commit it there")
            self._require_open(job)
            unfinished = [p.rank for p in job.parts if p.state != State.COMMITTED]
            if unfinished:
                raise RequestError("FAILED_PRECONDITION",
                                   f"the parts of ranks {sorted(unfinished)[:10]} are not "
                                   "durable yet")
            job.committing = True
            job.touch()
        published = False
        try:
            try:
                check_job_manifest(job, manifest, node)
            except ValueError as exc:  # refused: the job stays open for a good manifest
                raise invalid(f"job {job.id}: {exc}") from None
            prepared, replaced = "", None
            try:
                (job.staging.path / MARKER_NAME).unlink()
                if prepare_for:
                    prepared = job.staging.prepare(manifest, prepare_for).name
                else:
                    replaced = job.staging.commit(manifest, remove_replaced=False)
            except (OSError, CheckpointError) as exc:
                code = _code_for(exc) if isinstance(exc, CheckpointError) else "INTERNAL"
                raise RequestError(code, f"cannot commit {job.relpath}: {exc}") from None
            published = True
        except BaseException as exc:
            with self._cond:
                job.committing = False
                job.touch()
                if not (isinstance(exc, RequestError) and exc.code == "INVALID_ARGUMENT"):
                    self._abort_job(job, f"commit failed: {exc}")
                self._cond.notify_all()
            raise
        finally:
            if published:
                with self._cond:
                    job.committing = False
                    job.finish(JobState.COMMITTED)
                    self.metrics.checkpoints.labels(result="committed").inc()
                    self._cond.notify_all()
        logs.info("prepared-job" if prepare_for else "committed-job", job=job.id,
                  path=job.relpath, parts=len(job.parts), **(
                      {"prepared": prepared} if prepare_for else {}))
        _remove_later(replaced)
        return prepared

    def resolve_prepared(self, target: Path, relpath: str, name: str, publish: bool) -> None:
        """Publish or discard a prepared part (jobs.py). The I/O runs outside
        the lock; meanwhile the target counts as in flight."""
        try:
            prepared = prepared_part(target, name)
        except LookupError as exc:
            raise RequestError("NOT_FOUND", str(exc)) from None
        except (ValueError, OSError) as exc:
            raise invalid(str(exc)) from None
        with self._cond:
            self._check_target_free(target, relpath, None)
            self._resolving.add(target)
        try:
            replaced = resolve_prepared(target, prepared, publish)
        except CheckpointError as exc:
            raise RequestError(_code_for(exc), str(exc)) from None
        finally:
            with self._cond:
                self._resolving.discard(target)
        logs.info("published-prepared" if publish else "discarded-prepared", path=relpath,
                  prepared=name)
        _remove_later(replaced)

    def abort_job(self, job_id: str, reason: str = "aborted by the client") -> None:
        with self._cond:
            job = self.get_job(job_id)
            if job.state == JobState.COMMITTED or job.committing:
                raise RequestError("FAILED_PRECONDITION",
                                   f"job {job_id} is committed or being committed; delete the "
                                   "checkpoint instead")
            self._abort_job(job, reason)

    def _require_open(self, job: Job) -> None:
        if not job.open or job.committing:
            state = "being committed" if job.open else job.state.value
            raise RequestError("FAILED_PRECONDITION", f"job {job.id} is {state}" + (
                f": {job.error}" if job.error else ""))

    def _abort_job(self, job: Job, reason: str) -> None:
        """Called with the lock held. A job being committed is left to its commit."""
        if not job.open or job.committing:
            return
        job.finish(JobState.ABORTED, reason)
        for part in job.parts:
            if not part.terminal:
                self._finish(part, State.ABORTED, f"job aborted: {reason}",
                             "CheckpointAbortedError")
        job.remove_if_idle()
        self.metrics.checkpoints.labels(result="aborted").inc()
        logs.info("aborted-job", job=job.id, path=job.relpath, reason=reason)

    # -- Submit ----------------------------------------------------------------

    def check_submit(self, ident: str, index: int, header: bytes, data_length: int
                     ) -> tuple[Checkpoint, list[safetensors_file.ParsedEntry]]:
        """Validate a submission before its data is mapped or received."""
        with self._cond:
            ck = self.get(ident)
            self._require_receiving(ck, "submit a file to")
            entries = parse_data_file(index, header, data_length, ck.files_total)
            if index in ck.submitted:
                raise invalid(f"data file {index} was already submitted")
            dup = next((e.name for e in entries if e.name in ck.names), None)
            if dup is not None:
                raise invalid(f"tensor {dup!r} is already in another data file")
            if ck.mapped_bytes + data_length > ck.reserved:
                raise RequestError(
                    "RESOURCE_EXHAUSTED",
                    f"data file {index} ({data_length} bytes) would exceed the {ck.reserved} "
                    f"bytes of staging reserved at Begin ({ck.mapped_bytes} are still being "
                    "written)")
            return ck, entries

    def submit(self, ck: Checkpoint, index: int, header: bytes,
               entries: list[safetensors_file.ParsedEntry], data: Mapping) -> None:
        with self._cond:
            try:
                self._require_receiving(ck, "submit a file to")
                if index in ck.submitted:
                    raise invalid(f"data file {index} was already submitted")
                dup = next((e.name for e in entries if e.name in ck.names), None)
                if dup is not None:
                    raise invalid(f"tensor {dup!r} is already in another data file")
                if ck.mapped_bytes + len(data.view) > ck.reserved:
                    raise RequestError("RESOURCE_EXHAUSTED",
                                       f"data file {index} would exceed the checkpoint's "
                                       f"reserved staging of {ck.reserved} bytes")
            except RequestError:
                data.close()
                raise
            ck.submitted.add(index)
            ck.names.update(e.name for e in entries)
            ck.mapped_bytes += len(data.view)
            ck.bytes_total += len(header) + len(data.view)
            ck.pending.append(PendingFile(index, header, entries, data))
            ck.last_activity = time.monotonic()
            if ck.first_submit is None:
                ck.first_submit = time.monotonic()
            self._cond.notify_all()

    # -- Commit / Abort --------------------------------------------------------

    def commit(self, ident: str, tree_json: str, tensor_order: list[str]) -> None:
        try:
            # NaN and Infinity are not JSON (the manifest is written strictly).
            tree = json.loads(tree_json, parse_constant=_no_constant)
        except (ValueError, RecursionError) as exc:
            raise invalid(f"tree_json is not valid JSON: {exc}") from None
        with self._cond:
            ck = self.get(ident)
            self._require_receiving(ck, "commit")
            missing = sorted(set(range(ck.files_total)) - ck.submitted)
            if missing:
                raise RequestError("FAILED_PRECONDITION",
                                   f"data files {missing[:10]} were not submitted")
            if len(tensor_order) != len(ck.names) or set(tensor_order) != ck.names:
                raise invalid(f"tensor_order lists {len(tensor_order)} names; the data files "
                              f"hold {len(ck.names)} different ones")
            ck.tree = tree
            ck.tensor_order = list(tensor_order)
            ck.handed_over = True
            ck.state = State.WRITING
            ck.last_activity = time.monotonic()
            if ck.job is not None:
                ck.job.touch()
            self._cond.notify_all()
        logs.info("handed-over", checkpoint=ident, path=ck.relpath)

    def abort(self, ident: str, reason: str = "aborted by the client") -> None:
        with self._cond:
            ck = self.get(ident)
            if ck.state in (State.ABORTED, State.FAILED):
                return  # already gone: aborting again is a no-op
            if ck.handed_over:
                raise RequestError("FAILED_PRECONDITION",
                                   f"checkpoint {ident} was handed over (Commit); it cannot be "
                                   "aborted")
            self._finish(ck, State.ABORTED, reason, "CheckpointAbortedError")

    # -- Wait / Watch ----------------------------------------------------------

    def wait(self, ident: str, min_files: int = 0, *, alive: Callable[[], bool] = lambda: True
             ) -> dict[str, Any]:
        with self._cond:
            ck = self.get(ident)
            while not ck.terminal and not (min_files and ck.files_written >= min_files):
                if not alive():
                    break
                self._cond.wait(1.0)
            return ck.status()

    def watch(self, ident: str, alive: Callable[[], bool]) -> Iterator[dict[str, Any]]:
        """Statuses as they change, ending with a terminal one. While a watch is
        open the client is taken to be alive; see watch_ended."""
        with self._cond:
            ck = self.get(ident)
            ck.watchers += 1
            last: dict[str, Any] | None = None
        try:
            while True:
                with self._cond:
                    status = ck.status()
                    while status == last and alive():
                        self._cond.wait(1.0)
                        status = ck.status()
                if not alive():
                    return
                last = status
                yield status
                if status["state"] in TERMINAL:
                    return
        finally:
            self.watch_ended(ck)

    def watch_ended(self, ck: Checkpoint) -> None:
        with self._cond:
            ck.watchers -= 1
            if ck.watchers == 0 and not ck.handed_over and not ck.terminal:
                logs.warning("client-gone", checkpoint=ck.id, client=ck.client, path=ck.relpath)
                self._finish(ck, State.ABORTED,
                             "the client went away before handing the checkpoint over",
                             "CheckpointAbortedError")

    def reap_idle(self) -> None:
        """Abort checkpoints nobody watches and nobody has touched for idle_timeout."""
        now = time.monotonic()
        with self._cond:
            for ck in list(self._checkpoints.values()):
                if (not ck.terminal and not ck.handed_over and ck.watchers == 0
                        and now - ck.last_activity > self.idle_timeout):
                    logs.warning("idle-abort", checkpoint=ck.id, client=ck.client)
                    self._finish(ck, State.ABORTED,
                                 f"no request for {self.idle_timeout:.0f} s before Commit",
                                 "CheckpointAbortedError")
            for job in list(self._jobs.values()):
                idle = job.idle_seconds(now)
                if idle is not None and idle > self.idle_timeout and not job.owner:
                    # Its parts here are written; the daemon that began it commits it
                    # (a later part of this node takes it on again by its id).
                    del self._jobs[job.id]
                    logs.debug("forgot-job", job=job.id, path=job.relpath)
                elif idle is not None and idle > self.idle_timeout:
                    logs.warning("idle-abort-job", job=job.id, path=job.relpath)
                    self._abort_job(job, f"no rank committed it for {self.idle_timeout:.0f} s "
                                         "after its parts were written")

    # -- shutdown ----------------------------------------------------------------

    def drain(self, timeout: float | None = None) -> bool:
        """Refuse new checkpoints, abort the ones not handed over, finish the
        rest. True if everything finished within timeout."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            self._draining = True
            for ck in list(self._checkpoints.values()):
                if not ck.terminal and not ck.handed_over:
                    self._finish(ck, State.ABORTED, "fastpersistd is shutting down",
                                 "CheckpointAbortedError")
            while any(not c.terminal or c.busy for c in self._checkpoints.values()) or any(
                    j.committing for j in self._jobs.values()):
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cond.wait(left if left is not None else 1.0)
            # Only the ranks can commit a job (they hold its manifest); the ones
            # not committed by now are dropped with the daemon.
            for job in list(self._jobs.values()):
                self._abort_job(job, "fastpersistd is shutting down")
            self._stopping = True
            self._cond.notify_all()
        for w in self._workers:
            w.join()
        return True

    # -- workers -------------------------------------------------------------------

    def _next(self) -> Checkpoint | None:
        runnable = [c for c in self._checkpoints.values() if c.runnable()]
        if not runnable:
            return None
        # Least recently served client first; within a client, oldest checkpoint.
        return min(runnable, key=lambda c: self._served.get(c.client, -1))

    def _work(self) -> None:
        while not self._stopping:
            try:
                self._work_once()
            except Exception as exc:  # a bug here must not silently stop a writer
                logs.error("worker-error", error=repr(exc))

    def _work_once(self) -> None:
        while True:
            with self._cond:
                ck = self._next()
                while ck is None:
                    if self._stopping:
                        return
                    self._cond.wait()
                    ck = self._next()
                ck.busy = True
                self._tick += 1
                self._served[ck.client] = self._tick
                job = ck.pending.popleft() if ck.pending else None
            try:
                if job is not None:
                    self._write(ck, job)
                else:
                    self._commit(ck)
            except BaseException as exc:
                with self._cond:
                    self._fail(ck, exc)
            finally:
                if job is not None:
                    job.data.close()
                with self._cond:
                    ck.busy = False
                    if job is not None:
                        ck.mapped_bytes -= job.nbytes
                    if ck.job is not None:
                        ck.job.remove_if_idle()  # if the job was aborted meanwhile
                    elif ck.terminal and ck.state != State.COMMITTED:
                        ck.clean_up()  # no worker writes into it any more
                    self._cond.notify_all()

    def _write(self, ck: Checkpoint, job: PendingFile) -> None:
        name = ck.file_name(job.index)
        if ck.job is not None and os.path.lexists(ck.staging.path / name):
            # Two parts of one rank (on two daemons): refuse rather than overwrite.
            raise invalid(f"{name} already exists in job {ck.job.id}")
        segments: list[Segment] = [(job.header, 0)]
        segments += [(job.data.view[e.begin:e.end], job.data_start + e.begin)
                     for e in job.entries]
        started = time.perf_counter()
        try:
            result = self.engine.write_file(str(ck.staging.path / name), segments,
                                            job.data_start + job.nbytes)
        except OSError as exc:
            raise os_error(exc, f"cannot save checkpoint {ck.relpath}") from exc
        finally:
            for view, _ in segments[1:]:
                view.release()
        seconds = time.perf_counter() - started
        self.metrics.write_seconds.observe(seconds)
        logs.debug("file-written", checkpoint=ck.id, file=name, bytes=job.nbytes,
                   seconds=round(seconds, 4))
        assert result.crcs is not None
        size = job.data_start + job.nbytes
        with self._cond:
            ck.file_records[job.index] = FileRecord(name, size, job.data_start, result.crcs[0])
            for e, crc in zip(job.entries, result.crcs[1:], strict=True):
                ck.tensor_records[e.name] = TensorRecord(
                    name=e.name, file=name, offset=job.data_start + e.begin,
                    length=e.end - e.begin, dtype=e.dtype, shape=e.shape, crc32c=crc)
            ck.files_written += 1
            ck.bytes_written += size
        self.metrics.bytes_written.inc(size)

    def _commit(self, ck: Checkpoint) -> None:
        if ck.job is not None:
            self._part_durable(ck)
            return
        manifest = Manifest(
            files=tuple(ck.file_records[i] for i in range(ck.files_total)),
            tensors=tuple(ck.tensor_records[n] for n in ck.tensor_order),
            tree=ck.tree,
            fastpersist_version=__version__,
            created_unix=time.time(),
        )
        try:
            data = manifest.to_json()
        except ValueError as exc:  # NaN in a client's tree, say
            raise invalid(f"the tree cannot be written as JSON: {exc}") from None
        ck.staging.commit(data)
        with self._cond:
            self._finish(ck, State.COMMITTED, "", "")
            seconds = time.monotonic() - (ck.first_submit or time.monotonic())
            if seconds > 0:
                self.metrics.throughput.set(ck.bytes_written / seconds)
        logs.info("committed", checkpoint=ck.id, path=ck.relpath, bytes=ck.bytes_written,
                  seconds=round(seconds, 3))

    def _part_durable(self, ck: Checkpoint) -> None:
        """A part's files are durable in its job's directory: report their
        records (CommitJob publishes them with the rest of the job)."""
        records = [ck.tensor_records[n] for n in ck.tensor_order]
        with self._cond:
            ck.part_json = part_json([ck.file_records[i] for i in range(ck.files_total)],
                                     records)
            assert ck.job is not None
            ck.job.touch()
            self._finish(ck, State.COMMITTED, "", "")
        logs.info("part-written", checkpoint=ck.id, job=ck.job.id, rank=ck.rank,
                  bytes=ck.bytes_written)

    # -- helpers (called with the lock held) ------------------------------------------

    def _require_receiving(self, ck: Checkpoint, what: str) -> None:
        if ck.state != State.RECEIVING:
            raise RequestError("FAILED_PRECONDITION",
                               f"cannot {what} checkpoint {ck.id}: it is {ck.state.name.lower()}")

    def _fail(self, ck: Checkpoint, exc: BaseException) -> None:
        code = type(exc).__name__ if isinstance(exc, CheckpointError) else "CheckpointError"
        logs.error("failed", checkpoint=ck.id, path=ck.relpath, error=str(exc), code=code)
        self._finish(ck, State.FAILED, str(exc), code)

    def _finish(self, ck: Checkpoint, state: State, error: str, code: str) -> None:
        if ck.terminal:
            return
        ck.state = state
        ck.error = error
        ck.error_code = code
        ck.finished_at = time.monotonic()
        for job in ck.pending:
            ck.mapped_bytes -= job.nbytes
            job.data.close()
        ck.pending.clear()
        if state != State.COMMITTED and ck.job is not None:
            # The job cannot be committed without this part; its directory goes
            # with the job (Job.remove_if_idle, here or when the worker is done).
            self._abort_job(ck.job, f"the part of rank {ck.rank} is {state.name.lower()}: "
                                    f"{error}")
        elif state != State.COMMITTED and not ck.busy:
            ck.clean_up()
        if ck.job is None:  # a job is counted once, when it ends
            self.metrics.checkpoints.labels(result=state.name.lower()).inc()
        if state == State.ABORTED:
            logs.info("aborted", checkpoint=ck.id, path=ck.relpath, reason=error)
        self._update_gauges()
        self._cond.notify_all()

    def _update_gauges(self) -> None:
        self.metrics.in_flight.set(sum(1 for c in self._checkpoints.values() if not c.terminal))
        self.metrics.staging_reserved.set(self.reserved())

    def _prune(self) -> None:
        now = time.monotonic()
        for ident in [i for i, c in self._checkpoints.items()
                      if c.finished_at is not None and not c.busy
                      and now - c.finished_at > KEEP_FINISHED_SECONDS]:
            del self._checkpoints[ident]
        for ident in [i for i, j in self._jobs.items()
                      if j.finished_at is not None and now - j.finished_at > KEEP_FINISHED_SECONDS
                      and all(p.id not in self._checkpoints for p in j.parts)]:
            del self._jobs[ident]


def _remove_later(replaced: Path | None) -> None:
    """A checkpoint a publish replaced: removed after the reply, which must not
    wait for a large tree to be deleted (on a crash, startup does it)."""
    if replaced is not None:
        threading.Thread(target=shutil.rmtree, args=(replaced,), kwargs={
            "ignore_errors": True}, name="fpd-remove-replaced", daemon=True).start()


def _split(job_id: str) -> tuple[str, str]:
    try:
        return split_job_id(job_id)
    except ValueError as exc:
        raise invalid(str(exc)) from None


def _check_client(client: str) -> None:
    if not client or len(client) > 256:
        raise invalid("client_id must be 1..256 characters")


def _code_for(exc: CheckpointError) -> str:
    from ..errors import (
        CheckpointExistsError,
        CheckpointPermissionError,
        DiskFullError,
    )

    if isinstance(exc, CheckpointExistsError):
        return "ALREADY_EXISTS"
    if isinstance(exc, CheckpointPermissionError):
        return "PERMISSION_DENIED"
    if isinstance(exc, DiskFullError):
        return "RESOURCE_EXHAUSTED"
    return "INTERNAL"


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not allowed")


def anonymous_buffer(nbytes: int) -> Mapping:
    """Memory for a streamed data file (SubmitStream): page-aligned, so the
    engine writes it with O_DIRECT like a shared-memory segment."""
    try:
        m = mmap.mmap(-1, max(nbytes, 1))
    except (OSError, OverflowError, MemoryError) as exc:
        raise RequestError("RESOURCE_EXHAUSTED",
                           f"cannot hold a {nbytes}-byte streamed file in memory: {exc}") from None
    return Mapping(m, memoryview(m)[:nbytes])
