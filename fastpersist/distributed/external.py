"""A distributed save that another framework planned (DCP's planners): each
rank writes the items it was given into its part's data files, with the
CRC32C of every `block` of each item larger than one (for readers that check
part of an item: DCP's resharding loads), and the coordinator commits the
job with a manifest it built and small files beside it.

    jobs = jobs_for(daemon)             in this process (""), or fastpersistd
    job = jobs.begin(target)            the coordinator; job.name goes to every rank
    jobs.write(target, job.name, rank, files, block)
                                        every rank: its files, durable; what it wrote
    job.commit(manifest, files)         the coordinator; or job.abort()

In this process the job is a staging directory `.NAME.fp-tmp-TOKEN` beside
the target, TOKEN the coordinator's process token (the pattern `fpctl gc`
knows), which every rank derives from its own target and TOKEN (so a plan
cached by the framework stays right); each rank writes its files there with
the data-file writer every save uses (datafile.write_in_blocks). Through
fastpersistd the job is a job of the daemon (storage.ThroughDaemon), as a
distributed fastpersist.save's: each rank's files are copied into shared
memory as far as the staging limits allow and streamed to the daemon after
that. The checkpoint on disk is the same either way.

The integrations reach this through fastpersist.adapters.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from .._version import __version__
from ..checksum import block_spans, combine, crc32c
from ..engine import get_engine
from ..errors import CheckpointError, CorruptCheckpointError, DaemonError
from ..format.manifest import FileRecord, TensorRecord
from ..format.names import part_file_name
from ..saving import segments
from ..saving.files import StagedFiles
from ..saving.snapshot import StagedFile, stage_file
from ..saving.staging import StagingPool
from ..storage.commit import Staging, os_error
from ..storage.leftovers import leftover_name
from ..storage.leftovers import process_token as new_token
from ..tensors.datafile import write_in_blocks
from ..tensors.plan import StoredTensor, memory_of
from .storage import ThroughDaemon


@dataclass(frozen=True)
class ItemWritten:
    """One item as a rank wrote it: its record, its file, and the CRC32C of
    each block of it when it is larger than one block (else none)."""

    record: TensorRecord
    file: FileRecord
    blocks: tuple[int, ...] = ()


class Job(Protocol):
    """A save begun by the coordinator."""

    name: str  # what every rank is given to write its part (write's `job`)

    def commit(self, manifest: bytes, files: dict[str, bytes]) -> None:
        """`files` (small: DCP's metadata), then the manifest and the commit;
        an OSError as the CheckpointError for it."""

    def abort(self) -> None: ...


class Jobs(Protocol):
    def begin(self, target: Path) -> Job: ...

    def write(self, target: Path, job: str, rank: int, files: Iterable[list[StoredTensor]],
              block: int) -> list[ItemWritten]: ...


_token: str | None = None


def process_token() -> str:
    """PID-RAND@HOST of this process (one per process, as leftover names have)."""
    global _token
    if _token is None or not _token.startswith(f"{os.getpid()}-"):
        _token = new_token()
    return _token


def staging_path(target: Path, token: str) -> Path:
    """The staging directory every rank of an in-process job writes into."""
    return target.parent / leftover_name(target.name, "tmp", token)


@dataclass
class InProcessJob:
    name: str  # the coordinator's process token
    staging: Staging

    def commit(self, manifest: bytes, files: dict[str, bytes]) -> None:
        try:
            for name, data in files.items():
                self.staging.write_file(name, data)
            self.staging.commit(manifest)
        except OSError as exc:
            raise os_error(exc, f"cannot commit checkpoint {self.staging.target}") from exc

    def abort(self) -> None:
        self.staging.abort()


class InProcessJobs:
    """Every rank writes its files itself, with the direct-I/O engine."""

    def begin(self, target: Path) -> InProcessJob:
        token = process_token()
        where = staging_path(target, token)
        # Ours (this process's token) and not in flight: a failed save's.
        shutil.rmtree(where, ignore_errors=True)
        staging = Staging.create(target)
        os.rename(staging.path, where)
        staging.path = where
        return InProcessJob(token, staging)

    def write(self, target: Path, job: str, rank: int, files: Iterable[list[StoredTensor]],
              block: int) -> list[ItemWritten]:
        """Each file in the job's staging directory, durable; `files` are
        taken one at a time (a device tensor is copied to the host then)."""
        directory = str(staging_path(target, job))
        engine = get_engine()
        out = []
        for n, tensors in enumerate(files):
            name = part_file_name(rank, n)
            try:
                file, records, blocks = write_in_blocks(engine, directory, name, tensors, block)
            except OSError as exc:
                raise os_error(exc, f"cannot write {name} of checkpoint {directory}") from exc
            out += [ItemWritten(r, file, tuple(b) if len(b) > 1 else ())
                    for r, b in zip(records, blocks, strict=True)]
        return out


# The daemon takes messages of up to 64 MiB (daemon/server.py); the commit's
# other fields are small.
MAX_COMMIT_BYTES = 60 << 20


@dataclass
class DaemonJob:
    name: str  # the daemon's job id
    storage: ThroughDaemon
    target: Path

    def commit(self, manifest: bytes, files: dict[str, bytes]) -> None:
        """CommitJob with the manifest and `files` beside it."""
        size = len(manifest) + sum(len(d) for d in files.values())
        if size > MAX_COMMIT_BYTES:
            raise CheckpointError(
                f"the checkpoint's manifest and DCP metadata are {size} bytes together, more "
                f"than fastpersistd takes in one commit ({MAX_COMMIT_BYTES}): save this state "
                "in-process (FastPersistWriter(path, daemon=\"\")), or with fewer, larger items")
        try:
            self.storage.publish(self.name, manifest, None, files=files)
        except OSError as exc:
            raise os_error(exc, f"cannot commit checkpoint {self.target}") from exc

    def abort(self) -> None:
        """(The daemon also drops a job nobody touches.)"""
        self.storage.abort(self.name)


class DaemonJobs:
    """Each rank hands its items to its node's fastpersistd as one part of a
    job, which the coordinator commits there."""

    def __init__(self, address: str) -> None:
        # The connection and shared-memory pool are kept across saves: the
        # pool's segments are reused.
        self.storage = ThroughDaemon(address)

    def begin(self, target: Path) -> DaemonJob:
        """Asks the daemon what it can do each time: one restarted at another
        version since the last save would otherwise commit the job without
        the files beside the manifest."""
        info = self.storage.client.info()
        if "commit-files" not in info.features:
            raise DaemonError(
                f"fastpersistd at {self.storage.client.address} (fastpersist {info.version}) "
                "cannot write a DCP checkpoint's metadata (CommitJob.files): DCP saves through "
                f"it need a daemon of fastpersist {__version__} or later", "FAILED_PRECONDITION")
        return DaemonJob(self.storage.stage(target), self.storage, target)

    def write(self, target: Path, job: str, rank: int, files: Iterable[list[StoredTensor]],
              block: int) -> list[ItemWritten]:
        """This rank's part of the job, durable. Files are staged in shared
        memory up to the staging limit (staging_limit); the rest are streamed
        to the daemon from the tensors, which do not change meanwhile (the
        caller's snapshot, or live tensors the caller waits for; a device
        tensor is copied to the host as the stream reaches it). If the daemon
        has no room for the staged ones when the part opens (other ranks of
        the node hold its budget), ThroughDaemon.write streams them from
        their buffers. The daemon's CRC32C of each item is checked against
        this process's of its blocks."""
        storage, pool = self.storage, self.storage.pool
        stored_files = list(files)
        names = {t.name for f in stored_files for t in f}
        staged = _stage(pool, stored_files, staging_limit(storage))
        try:
            blocks: dict[str, list[int]] = {}
            for file in staged:
                file.wait_copied()
                blocks.update(block_crcs(file, block))
            records = storage.write(target, job, rank, StagedFiles.copied(staged), None)
        finally:
            for file in staged:
                pool.give_back(file)  # reused, or quarantined if the daemon may still read it
        out = []
        for file_record, tensors in records:
            for record in tensors:
                item_blocks = blocks.get(record.name)
                if item_blocks is not None:
                    spans = block_spans(record.length, block)
                    if combine(list(zip(item_blocks, (n for _, n in spans), strict=True))
                               ) != record.crc32c:
                        raise CorruptCheckpointError(
                            f"{record.name}: fastpersistd's CRC32C of the item differs from "
                            "this process's of the same bytes: they changed during the save")
                names.discard(record.name)
                out.append(ItemWritten(record, file_record, tuple(item_blocks or ())))
        if names:
            raise DaemonError(f"fastpersistd reported no record of {sorted(names)[:3]}",
                              "INTERNAL")
        return out

    def close(self) -> None:
        self.storage.close()


def _stage(pool: StagingPool, stored_files: list[list[StoredTensor]],
           limit: int) -> list[StagedFile]:
    """Each file staged in a buffer of the pool while they fit `limit` (0: no
    limit) and shared memory has room; unstaged (streamed) after that."""
    staged: list[StagedFile] = []
    held = 0  # bytes of the pool's buffers these files hold
    try:
        for stored in stored_files:
            nbytes = sum(s.nbytes for s in stored)
            pinned = any(s.source.is_cuda for s in stored)
            buffer = None
            if not limit or held + nbytes <= limit:
                try:
                    buffer = pool.acquire(nbytes, 0, pinned)
                except (OSError, CheckpointError):
                    buffer = None  # shared memory is full (ENOSPC): stream it
            if buffer is not None and limit and held + buffer.numel() > limit:
                pool.give_back_unused([buffer], pinned)  # a free buffer larger than asked
                buffer = None
            if buffer is None:
                staged.append(StagedFile(stored, None))
                continue
            held += buffer.numel()
            try:
                staged.append(stage_file(stored, buffer, pinned))
            except BaseException:
                pool.discard(buffer, pinned)
                raise
    except BaseException:
        for file in staged:
            pool.give_back(file)
        raise
    return staged


def staging_limit(storage: ThroughDaemon) -> int:
    """The shared memory a part may hold (0: no limit): the same window as a
    single save's through the daemon (segments.staging_limit)."""
    return segments.staging_limit(storage.client)


def block_crcs(file: StagedFile, block: int) -> dict[str, list[int]]:
    """The CRC32C of each block of the file's items larger than one block,
    from what the daemon reads: the staged copy, or a streamed file's tensors
    (a device or non-contiguous one copied to the host, one at a time)."""
    out: dict[str, list[int]] = {}
    if file.buffer is None:
        for t in file.entries:
            if t.nbytes > block:
                src = t.source if t.source.is_cpu and t.source.is_contiguous() else \
                    t.source.to("cpu").contiguous()
                out[t.name] = _crcs(memory_of(src), t.nbytes, block)
        return out
    memory = memory_of(file.buffer)
    for t, start in zip(file.order, file.starts, strict=False):
        if t.nbytes > block:
            out[t.name] = _crcs(memory[start:start + t.nbytes], t.nbytes, block)
    return out


def _crcs(memory: memoryview, nbytes: int, block: int) -> list[int]:
    return [crc32c(memory[a:a + n]) for a, n in block_spans(nbytes, block)]


_in_process = InProcessJobs()
_daemons: dict[str, DaemonJobs] = {}
_daemons_lock = threading.Lock()


def jobs_for(daemon: str) -> Jobs:
    """In this process (""), or through fastpersistd at `daemon`: the
    process's connection and shared-memory pool for it."""
    if not daemon:
        return _in_process
    return daemon_jobs(daemon)


def daemon_jobs(address: str) -> DaemonJobs:
    with _daemons_lock:
        jobs = _daemons.get(address)
        if jobs is None:
            jobs = _daemons[address] = DaemonJobs(address)
        return jobs


def forget(address: str) -> None:
    """Close and drop the process's connection to `address` (tests; a daemon restarted)."""
    with _daemons_lock:
        jobs = _daemons.pop(address, None)
    if jobs is not None:
        jobs.close()


@atexit.register
def _close_all() -> None:
    """Shared-memory segments outlive a process that does not unlink them."""
    with _daemons_lock:
        jobs = list(_daemons.values())
        _daemons.clear()
    for j in jobs:
        with contextlib.suppress(Exception):
            j.close()


__all__ = ["MAX_COMMIT_BYTES", "DaemonJob", "DaemonJobs", "InProcessJob", "InProcessJobs",
           "ItemWritten", "Job", "Jobs", "block_crcs", "daemon_jobs", "forget", "jobs_for",
           "process_token", "staging_limit", "staging_path"]
