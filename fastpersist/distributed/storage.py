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
    publish(where, manifest, node, after_commit, files)
                                    the domain's first rank: `files` (small,
                                    beside the manifest: DCP's metadata), the
                                    commit, then a Checkpointer's policy if
                                    given (rank 0, the job's commit point);
                                    returns what of the policy failed ("":
                                    nothing)
    abort(where)                    after a failure

Node-local, the other domains' first ranks publish in two steps around the
commit (prepared.py):

    prepare(target, where, manifest, node, commit_node)
                                    before the commit: everything durable,
                                    nothing visible; returns the prepared part
    resolve(target, prepared, publish)
                                    after it: publish the part, or discard it
                                    if the job did not commit (settling.py too)

On shared storage, after a failed exchange with no store to agree in:

    fate(target, where, ident)      whether rank 0 published: takes the staging
                                    place out of its reach, then looks
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import time
from pathlib import Path
from typing import Any, Protocol

from ..engine import get_engine
from ..errors import CheckpointError, DaemonError, ManifestError, PostCommitError
from ..format.manifest import (
    DISTRIBUTED_SCHEMA_VERSION,
    FileRecord,
    TensorRecord,
    records_from_json,
)
from ..format.names import part_file_name
from ..saving.files import StagedFiles
from ..saving.staging import StagingPool
from ..storage.commit import Staging, leftover_name, os_error
from ..storage.prepared import discard_prepared, prepare, publish_prepared
from ..storage.retention import AfterCommit, apply_at
from ..tensors import datafile, packed

Records = list[tuple[FileRecord, list[TensorRecord]]]


class Storage(Protocol):
    pool: StagingPool

    def stage(self, target: Path) -> str: ...

    def write(self, target: Path, where: str, rank: int, files: StagedFiles,
              node: str | None, frame_bytes: int = 0) -> Records: ...

    def publish(self, where: str, manifest: bytes, node: str | None,
                after_commit: AfterCommit | None = None,
                files: dict[str, bytes] | None = None) -> str: ...

    def abort(self, where: str) -> None: ...

    def prepare(self, target: Path, where: str, manifest: bytes, node: str,
                commit_node: str) -> str: ...

    def resolve(self, target: Path, prepared: str, publish: bool) -> None: ...

    def place(self, target: Path, where: str) -> Path: ...

    def fate(self, target: Path, where: str, ident: Ident, wait: float) -> bool | None: ...

    def close(self) -> None: ...


Ident = tuple[int, int]  # a directory's (st_dev, st_ino): it keeps them when renamed


def ident_of(path: Path) -> Ident | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


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

    def write(self, target: Path, where: str, rank: int, files: StagedFiles,
              node: str | None, frame_bytes: int = 0) -> Records:
        """frame_bytes: pack (compress) the files in frames of this many bytes."""
        engine = get_engine()
        out = []
        for n, file in enumerate(f for f in files if f.tensors):
            name = part_file_name(rank, n, packed=bool(frame_bytes))
            file.wait_copied()
            try:
                if frame_bytes:
                    record, records = packed.write(engine, where, name, file.tensors,
                                                   frame_bytes)
                else:
                    record, records = datafile.write(engine, where, name, file.tensors)
            except OSError as exc:
                raise os_error(exc, f"cannot write {name} of the checkpoint") from exc
            out.append((_with_node(record, node), records))
            # Written: the caller of a windowed save may be waiting for its room.
            self.pool.give_back(file)
        return out

    def publish(self, where: str, manifest: bytes, node: str | None,
                after_commit: AfterCommit | None = None,
                files: dict[str, bytes] | None = None) -> str:
        staging = self._staging[where]
        for name, data in (files or {}).items():
            staging.write_file(name, data)
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

    def prepare(self, target: Path, where: str, manifest: bytes, node: str,
                commit_node: str) -> str:
        prepared = prepare(self._staging[where], manifest, commit_node)
        del self._staging[where]
        return str(prepared)

    def resolve(self, target: Path, prepared: str, publish: bool) -> None:
        if publish:
            publish_prepared(Path(prepared), target)
        else:
            discard_prepared(Path(prepared))

    def place(self, target: Path, where: str) -> Path:
        return Path(where)

    def fate(self, target: Path, where: str, ident: Ident, wait: float) -> bool | None:
        # Renamed away, the staging directory can no longer be published; if
        # rank 0 published first, the target is that directory. (With
        # RENAME_EXCHANGE, `where` then holds the checkpoint it replaced, which
        # rank 0 was about to remove: we remove it.)
        aside = target.parent / leftover_name(target.name, "del")
        try:
            os.rename(where, aside)
        except FileNotFoundError:
            pass
        except OSError:
            return True if ident_of(target) == ident else None
        committed = ident_of(target) == ident
        shutil.rmtree(aside, ignore_errors=True)
        self._staging.pop(where, None)
        return committed

    def close(self) -> None:
        self.pool.clear()


class ThroughDaemon:
    """Each rank hands its files to its node's fastpersistd, as one part of
    the job; the domain's first rank begins and commits the job there
    (proto/fastpersist.proto: BeginJob, Begin with a job_id, CommitJob)."""

    def __init__(self, address: str) -> None:
        from ..protocol.client import DaemonClient
        from ..saving.segments import SegmentBuffers, socket_group

        self.client = DaemonClient(address)
        self._segments = SegmentBuffers(socket_group(address))
        # A quarantined segment is unlinked and unmapped here; the daemon's
        # mapping keeps its pages while it may still read them.
        self.pool = StagingPool(self._segments.allocate, self._segments.free,
                                let_go=self._segments.free)

    def stage(self, target: Path) -> str:
        self.client.info()  # renewed: a daemon restarted since may have another root
        return self.client.begin_job(self.client.relative(target))

    def write(self, target: Path, where: str, rank: int, files: StagedFiles,
              node: str | None, frame_bytes: int = 0) -> Records:
        """The part's files, durable in the job's directory, each handed to
        the daemon as soon as it is copied (StagedFiles), at most
        files.reserve bytes of them staged at once. Each buffer is lent
        to the daemon and marked returned only by its report (handover.py), so
        the caller's StagingPool.give_back quarantines what the daemon may
        still read. A lost reply after Commit is settled by asking the daemon.
        frame_bytes: the daemon packs (compresses) the files, in such frames."""
        from ..saving.handover import Handover

        if not files.count:
            return []
        reserve = files.reserve
        relative = self.client.relative(target)

        def open_part(staging_bytes: int) -> tuple[str, Any]:
            return self.client.open(relative, staging_bytes, files.count, job_id=where,
                                    rank=rank, compression="zstd" if frame_bytes else "",
                                    frame_bytes=frame_bytes)

        by_stream = False
        try:
            ident, stream = open_part(reserve)
        except DaemonError as exc:
            # No room for the buffers (other ranks of the node hold the daemon's
            # staging budget, or the part is over one client's): the daemon
            # takes the same bytes streamed, from the buffers, never lent.
            if exc.code != "RESOURCE_EXHAUSTED" or not reserve:
                raise
            by_stream = True
            ident, stream = open_part(0)
        # Open's stream is our liveness lease until the hand-over.
        handover = Handover(self.client, self._segments, ident,
                            f"the part of rank {rank} of {target}", stream)
        try:
            sent = []
            for index, file in enumerate(files):
                handover.submit(index, file, stream=by_stream)
                sent.append(file)
                handover.return_when_written(index, file, files, self.pool)
            handover.commit("null", [t.name for f in sent for t in f.entries])
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
                after_commit: AfterCommit | None = None,
                files: dict[str, bytes] | None = None) -> str:
        return self.client.commit_job(where, manifest, node or "", after_commit, files)

    def abort(self, where: str) -> None:
        with contextlib.suppress(CheckpointError):
            self.client.abort_job(where)

    def prepare(self, target: Path, where: str, manifest: bytes, node: str,
                commit_node: str) -> str:
        name = self.client.prepare_job(where, manifest, node, commit_node)
        return str(target.parent / name)

    def resolve(self, target: Path, prepared: str, publish: bool) -> None:
        self.client.resolve_prepared(self.client.relative(target), Path(prepared).name, publish)

    def place(self, target: Path, where: str) -> Path:
        return target.parent / where.rpartition(":")[0]

    def fate(self, target: Path, where: str, ident: Ident, wait: float) -> bool | None:
        # Our daemon drops the job unless it committed it or is committing it
        # (it is the one that began it when it runs on rank 0's node); then
        # the directory shows what became of it: renamed to the target, or gone.
        with contextlib.suppress(CheckpointError):
            self.client.abort_job(where)
        place = self.place(target, where)
        deadline = time.monotonic() + wait
        while True:
            if ident_of(target) == ident:
                return True
            if not os.path.lexists(place):
                return ident_of(target) == ident  # it may have moved in between
            if time.monotonic() > deadline:
                return None  # another node's daemon holds it, and nobody there answers
            time.sleep(0.05)

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


__all__ = ["Ident", "InProcess", "Records", "Storage", "ThroughDaemon", "ident_of",
           "storage_for"]
