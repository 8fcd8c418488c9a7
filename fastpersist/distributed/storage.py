"""Where a distributed save's bytes go: written in-process, or by fastpersistd.

The coordinator (coordinator.py) decides who writes what and when; a Storage
does the writing, in a storage domain (the shared filesystem, or one node's
disk) whose first rank stages and publishes:

    stage(target)                   the domain's first rank: make the staging
                                    place; returns its name, which every rank
                                    of the domain is given
    write(target, where, rank, files, node)
                                    each rank: its files, durable, and their
                                    records for the job manifest
    publish(where, manifest, node, after_commit)
                                    the domain's first rank: the commit, then
                                    a Checkpointer's policy if given (rank 0,
                                    the job's commit point); returns what of
                                    the policy failed ("": nothing)
    abort(where) / unpublish(target)   after a failure
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
from pathlib import Path
from typing import Protocol

from .. import datafile
from ..commit import Staging, delete_checkpoint, os_error
from ..engine import get_engine
from ..errors import CheckpointError, DaemonError, ManifestError, PostCommitError
from ..format.manifest import (
    DISTRIBUTED_SCHEMA_VERSION,
    FileRecord,
    TensorRecord,
    records_from_json,
)
from ..format.names import part_file_name
from ..retention import AfterCommit, apply_at
from ..snapshot import StagedFile
from ..staging import StagingPool

Records = list[tuple[FileRecord, list[TensorRecord]]]


class Storage(Protocol):
    pool: StagingPool

    def stage(self, target: Path) -> str: ...

    def write(self, target: Path, where: str, rank: int, files: list[StagedFile],
              node: str | None) -> Records: ...

    def publish(self, where: str, manifest: bytes, node: str | None,
                after_commit: AfterCommit | None = None) -> str: ...

    def abort(self, where: str) -> None: ...

    def unpublish(self, target: Path) -> None: ...

    def close(self) -> None: ...


def _with_node(record: FileRecord, node: str | None) -> FileRecord:
    return record if node is None else dataclasses.replace(record, node=node)


class InProcess:
    """Each rank writes its files itself, with the direct-I/O engine."""

    def __init__(self) -> None:
        self.pool = StagingPool()
        self._staging: dict[str, Staging] = {}

    def stage(self, target: Path) -> str:
        staging = Staging.create(target)
        self._staging[str(staging.path)] = staging
        return str(staging.path)

    def write(self, target: Path, where: str, rank: int, files: list[StagedFile],
              node: str | None) -> Records:
        engine = get_engine()
        out = []
        for n, file in enumerate(f for f in files if f.tensors):
            name = part_file_name(rank, n)
            file.wait_copied()
            try:
                record, records = datafile.write(engine, where, name, file.tensors)
            except OSError as exc:
                raise os_error(exc, f"cannot write {name} of the checkpoint") from exc
            out.append((_with_node(record, node), records))
        return out

    def publish(self, where: str, manifest: bytes, node: str | None,
                after_commit: AfterCommit | None = None) -> str:
        staging = self._staging[where]
        staging.commit(manifest)
        del self._staging[where]  # (kept until then for abort())
        if after_commit is None:
            return ""
        try:
            apply_at(staging.target.parent, staging.target.name, after_commit)
        except PostCommitError as exc:
            return str(exc)
        return ""

    def abort(self, where: str) -> None:
        staging = self._staging.pop(where, None)
        if staging is not None:
            staging.abort()

    def unpublish(self, target: Path) -> None:
        delete_checkpoint(target)

    def close(self) -> None:
        self.pool.clear()


class ThroughDaemon:
    """Each rank hands its files to its node's fastpersistd, as one part of
    the job; the domain's first rank begins and commits the job there
    (proto/fastpersist.proto: BeginJob, Begin with a job_id, CommitJob)."""

    def __init__(self, address: str) -> None:
        from ..daemon_client import DaemonClient
        from ..segments import SegmentBuffers, socket_group

        self.client = DaemonClient(address)
        self._segments = SegmentBuffers(socket_group(address))
        # A quarantined segment is unlinked and unmapped here; the daemon's
        # mapping keeps its pages while it may still read them.
        self.pool = StagingPool(self._segments.allocate, self._segments.free,
                                let_go=self._segments.free)

    def stage(self, target: Path) -> str:
        return self.client.begin_job(self.client.relative(target))

    def write(self, target: Path, where: str, rank: int, files: list[StagedFile],
              node: str | None) -> Records:
        """The part's files, durable in the job's directory. Each buffer is lent
        to the daemon and marked returned only by its report (handover.py), so
        the caller's StagingPool.give_back quarantines what the daemon may
        still read. A lost reply after Commit is settled by asking the daemon."""
        from ..handover import Handover

        files = [f for f in files if f.tensors]
        if not files:
            return []
        reserve = sum(f.buffer.numel() for f in files if f.buffer is not None)
        ident, stream = self.client.open(self.client.relative(target), reserve, len(files),
                                         job_id=where, rank=rank)
        # Open's stream is our liveness lease until the hand-over.
        handover = Handover(self.client, self._segments, ident,
                            f"the part of rank {rank} of {target}", stream)
        try:
            for index, file in enumerate(files):
                handover.submit(index, file)
            handover.commit("null", [t.name for f in files for t in f.tensors])
            status = handover.wait_end()
        except Exception as exc:
            error = handover.outcome_after(exc)
            if error is exc:
                raise
            if error is not None:
                raise error from exc
            assert handover.status is not None  # committed after all
            status = handover.status
        finally:
            handover.close()
        return _part_records(status.part_json, node)

    def publish(self, where: str, manifest: bytes, node: str | None,
                after_commit: AfterCommit | None = None) -> str:
        return self.client.commit_job(where, manifest, node or "", after_commit)

    def abort(self, where: str) -> None:
        with contextlib.suppress(CheckpointError):
            self.client.abort_job(where)

    def unpublish(self, target: Path) -> None:
        self.client.delete(self.client.relative(target))

    def close(self) -> None:
        self.pool.clear()
        self.client.close()


def _part_records(part_json: str, node: str | None) -> Records:
    """The records the daemon reported for a part, grouped by file."""
    try:
        files, tensors = records_from_json(json.loads(part_json), "fastpersistd's part report",
                                           DISTRIBUTED_SCHEMA_VERSION)
    except (ValueError, ManifestError) as exc:
        raise DaemonError(f"fastpersistd reported a part's records that cannot be read: {exc}",
                          "INTERNAL") from None
    by_file: dict[str, list[TensorRecord]] = {f.name: [] for f in files}
    for t in tensors:
        by_file[t.file].append(t)
    return [(_with_node(f, node), by_file[f.name]) for f in files]


def storage_for(daemon: str) -> Storage:
    return ThroughDaemon(daemon) if daemon else InProcess()


__all__ = ["InProcess", "Records", "Storage", "ThroughDaemon", "storage_for"]
