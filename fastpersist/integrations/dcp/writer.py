"""FastPersistWriter: torch.distributed.checkpoint's StorageWriter on fastpersist.

    dcp.save(state_dict, storage_writer=FastPersistWriter("ckpt/step-100"))

The save, as DCP drives it:

    set_up_storage_writer   every rank (the coordinator also aborts what a
                            failed earlier save of this writer left)
    prepare_global_plan     the coordinator makes the staging directory beside
                            the target, `.NAME.fp-tmp-TOKEN` (TOKEN: its
                            process's PID-RAND@HOST, the pattern `fpctl gc`
                            knows), and tells each rank TOKEN and its rank in
                            the plan's storage_data; every rank derives the
                            directory from its own checkpoint path and TOKEN,
                            so a cached plan (enable_plan_caching) stays right
    write_data              every rank: its items into data-rRRRRR-NNN.safetensors
                            files with the O_DIRECT engine, fsynced, a CRC32C
                            per item (and per 4 MiB block, blocks.py)
    finish                  the coordinator: dcp_metadata.json (JSON, never a
                            pickle), then manifest.json, then the atomic
                            commit (fastpersist.storage.commit.Staging: fsyncs, rename
                            or exchange with an old checkpoint, parent fsync)

A crash at any moment leaves the old checkpoint or the new one. The writer is
also DCP's AsyncStager (stager.py), so dcp.async_save snapshots into reused
staging buffers, given back as soon as this rank's files are written.

With a daemon (FASTPERSIST_DAEMON, or daemon=), the ranks hand their items to
fastpersistd instead and the coordinator commits the job there, with
dcp_metadata.json beside the manifest; the checkpoint is the same. Plan
caching is refused then: a cached plan would carry an earlier save's job id.
The staging directory, the data files and the daemon's job are fastpersist's
(distributed/external.py, through fastpersist.adapters): this module
translates DCP's calls.
"""

from __future__ import annotations

import dataclasses
import errno
import os
import threading
import uuid
import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from ...adapters import (
    Job,
    StoredTensor,
    checkpoint_path,
    dtype_name,
    gc_paused,
    jobs_for,
    settings,
    through_link,
)
from ...errors import CheckpointError, CheckpointExistsError, UnsupportedValueError
from . import metadata_json
from .blocks import CRC_BLOCK
from .items import files_of, stored_item
from .manifest import build
from .stager import FastPersistStager, Lease

DCP_VERSION = "1.0.0"  # the Metadata.version DCP's FileSystemWriter writes


@dataclasses.dataclass(eq=False)
class _Claim:
    """A save of a path begun by this process and not finished: by `thread`
    (the coordinator's) with `writer`, as `job` once begun."""

    key: tuple[str, Path]  # (daemon address or "", target)
    thread: threading.Thread
    writer: weakref.ref[FastPersistWriter]
    job: Job | None = None

    def in_progress(self) -> bool:
        """DCP tells a storage writer nothing when a save fails (finish is not
        called). A save may still be running only while its writer exists and
        its thread is alive and is not the caller's (a thread runs one save at
        a time); otherwise this is a failed save's claim."""
        return self.thread is not threading.current_thread() and self.thread.is_alive() \
            and self.writer() is not None


# (daemon address or "", target) -> the save of it in flight in this process;
# the next save of the path clears what a failed one left.
_in_flight: dict[tuple[str, Path], _Claim] = {}
_in_flight_lock = threading.Lock()


@dataclasses.dataclass(frozen=True)
class PlanData:
    """SavePlan.storage_data: where this rank writes (the job's name) as which rank."""

    token: str
    rank: int


class FastPersistWriter(StorageWriter, AsyncStager):
    """Writes a DCP checkpoint as a fastpersist checkpoint directory at `path`.

    overwrite=False refuses a target that exists; otherwise an existing
    fastpersist checkpoint there is replaced atomically (anything else that
    is not an empty directory is refused). `stager` (default: one over the
    process's shared staging pool) snapshots the state for dcp.async_save.
    daemon: fastpersistd's address ("unix:///PATH"; None: FASTPERSIST_DAEMON,
    "": write in this process); `path` must then lie under the daemon's --root.

    FileSystemWriter's arguments are taken in its order, so that changing the
    class name is the only change a DCP user makes, and change nothing, for
    these reasons: single_file_per_rank (each rank writes its own data files,
    cut at FASTPERSIST_FILE_BYTES: the layout is fastpersist's), sync_files
    (every file is fsynced before the commit, always: a checkpoint is durable
    or absent), thread_count (the engine's parallel O_DIRECT I/O:
    FASTPERSIST_THREADS), per_thread_copy_ahead and cache_staged_state_dict
    (the stager copies into reused, bounded staging: FASTPERSIST_STAGING_BUDGET),
    serialization_format (the data files are safetensors files either way).
    _extensions (stream transforms, e.g. torch's ZStandard) are refused by name:
    they would change the bytes, which fastpersist compresses its own way.
    """

    _synchronize_after_execute = False

    def __init__(self, path: str | os.PathLike[str], single_file_per_rank: bool = True,
                 sync_files: bool = True, thread_count: int = 1,
                 per_thread_copy_ahead: int = 10_000_000,
                 cache_staged_state_dict: bool = False, overwrite: bool = True,
                 _extensions: Sequence[Any] | None = None,
                 serialization_format: Any = None, *,
                 stager: FastPersistStager | None = None, daemon: str | None = None) -> None:
        if _extensions:
            raise ValueError(
                f"FastPersistWriter does not apply DCP stream extensions ({list(_extensions)}): "
                "its data files are fastpersist's safetensors files, written with O_DIRECT; "
                "leave _extensions out")
        super().__init__()
        self.path = checkpoint_path(path)
        self.overwrite = overwrite
        self.daemon = settings().daemon if daemon is None else daemon
        self.save_id = str(uuid.uuid4())
        self.is_coordinator = True
        self.rank = 0
        self._stager = stager
        self._lease: Lease | None = None
        self._job: Job | None = None  # the coordinator's: begun, not yet committed
        self._claim: _Claim | None = None

    # --- pickling (dcp.async_save with a process executor) -------------------

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        if self._lease is not None and self._stager is not None:
            # The staged state travels with us to another process, which
            # reads it there: its buffer must never be reused here.
            self._lease.handed_off = True
            self._stager.release(self._lease)
            self._lease = None
        state.update(_stager=None, _lease=None, _job=None, _claim=None)
        return state

    # --- AsyncStager -----------------------------------------------------------

    @property
    def stager(self) -> FastPersistStager:
        if self._stager is None:
            self._stager = FastPersistStager()
        return self._stager

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        self._release_lease()  # a previous stage whose save never wrote
        staged, self._lease = self.stager.stage_leased(state_dict)
        return staged

    def synchronize_staging(self) -> None:
        """stage() is synchronous."""

    def close(self) -> None:
        self._release_lease()

    def _release_lease(self) -> None:
        lease, self._lease = self._lease, None
        if lease is not None:
            self.stager.release(lease)

    # --- StorageWriter ---------------------------------------------------------

    @property
    def checkpoint_id(self) -> str:
        return str(self.path)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return isinstance(checkpoint_id, (str, os.PathLike))

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        if checkpoint_id:
            self.path = checkpoint_path(checkpoint_id)
        self.save_id = str(uuid.uuid4())

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=str(self.path), save_id=self.save_id)

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.is_coordinator = is_coordinator
        self.rank = int(kwargs.get("rank") or 0)
        if kwargs.get("use_collectives", True) is False and torch.distributed.is_initialized() \
                and torch.distributed.get_world_size() > 1:
            raise ValueError("FastPersistWriter needs use_collectives=True: the ranks write one "
                             "checkpoint that the coordinator commits")
        self._abort_pending()
        # A path that is a link to a directory is saved through, as by
        # FileSystemWriter; every rank resolves it, so all name one staging place.
        self.path = through_link(self.path)

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        for item in plan.items:  # refuse what cannot be stored before any I/O
            if item.tensor_data is not None and dtype_name(
                    item.tensor_data.properties.dtype) is None:
                raise UnsupportedValueError(
                    f"{item.index.fqn}: dtype {item.tensor_data.properties.dtype} cannot be "
                    "stored (not a safetensors dtype)")
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        if self.daemon:
            _refuse_cached_plans(plans)
        job = self._begin()
        return [dataclasses.replace(p, storage_data=PlanData(job.name, i))
                for i, p in enumerate(plans)]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        data = plan.storage_data
        if not isinstance(data, PlanData):
            # DCP's plan cache (enable_plan_caching) is one per planner class for
            # the whole process: a plan cached for another storage writer's save.
            raise CheckpointError(
                f"the save plan of {self.path} was made for another storage writer "
                f"(its storage_data is a {type(data).__name__}): DCP's plan cache is shared "
                "by every DefaultSavePlanner of a process; with enable_plan_caching, save "
                "through one storage writer class per process (or use a planner subclass)")
        by_name: dict[str, WriteItem] = {}

        def stored(items: list[WriteItem]) -> list[StoredTensor]:
            # In this process, one file's items at a time, as contiguous host
            # tensors; through the daemon as they are (staging copies them).
            out = []
            for item in items:
                s = stored_item(item, planner.resolve_data(item), host=not self.daemon)
                by_name[s.name] = item
                out.append(s)
            return out

        files = files_of(plan.items, settings().file_bytes)
        try:
            written = jobs_for(self.daemon).write(self.path, data.token, data.rank,
                                                  map(stored, files), CRC_BLOCK)
        finally:
            self._release_lease()  # written (or failed): the snapshot is no longer read
        future: Future[list[WriteResult]] = Future()
        future.set_result([WriteResult(index=by_name[w.record.name].index,
                                       size_in_bytes=w.record.length, storage_data=w)
                           for w in written])
        return future

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        job = self._job
        if job is None:
            raise CheckpointError(f"{self.path}: finish() without prepare_global_plan()")
        try:
            written = {wr.index: wr.storage_data for rank in results for wr in rank}
            metadata.version = DCP_VERSION
            metadata.storage_data = {index: metadata_json.ItemInfo(w.record.name, w.blocks)
                                     for index, w in written.items()}
            metadata.storage_meta = self.storage_meta()
            with gc_paused():
                manifest = build(metadata, written, str(self.path))
                meta_json = metadata_json.dumps(metadata)
            job.commit(manifest, {metadata_json.DCP_METADATA_NAME: meta_json})
        except BaseException:
            self._abort_pending()
            raise
        self._job = None
        self._drop_claim()

    # --- the staging directory or the daemon's job (coordinator) ------------------

    def _begin(self) -> Job:
        if not self.overwrite and os.path.lexists(self.path):
            raise CheckpointExistsError(errno.EEXIST, f"{self.path} exists and overwrite=False")
        failed = self._take_claim()
        try:
            if failed is not None and failed.job is not None and self.daemon:
                failed.job.abort()  # else the daemon refuses a new job of the path
            job = jobs_for(self.daemon).begin(self.path)
        except BaseException:
            self._drop_claim()
            raise
        assert self._claim is not None
        self._claim.job = self._job = job
        return job

    def _take_claim(self) -> _Claim | None:
        """Claim the path for this save; returns a failed save's claim it replaced."""
        key = (self.daemon, self.path)
        with _in_flight_lock:
            held = _in_flight.get(key)
            if held is not None and held.in_progress():
                raise CheckpointError(
                    f"another save to {self.path} is in progress in this process (begun by "
                    f"thread {held.thread.name!r}, whose writer is still in use)")
            self._claim = _in_flight[key] = _Claim(key, threading.current_thread(),
                                                   weakref.ref(self))
        return held

    def _abort_pending(self) -> None:
        """Drop this writer's unfinished save, unless a later save of the path
        took it over (then what it left is that save's to clear)."""
        job, self._job = self._job, None
        claim, self._claim = self._claim, None
        # Under the lock: a save taking the path over meanwhile would make its
        # staging directory under the same name (the token is per process).
        with _in_flight_lock:
            if claim is None or _in_flight.get(claim.key) is not claim:
                return
            try:
                if job is not None:
                    job.abort()
            finally:
                del _in_flight[claim.key]

    def _drop_claim(self) -> None:
        claim, self._claim = self._claim, None
        with _in_flight_lock:
            if claim is not None and _in_flight.get(claim.key) is claim:
                del _in_flight[claim.key]


def _refuse_cached_plans(plans: list[SavePlan]) -> None:
    if any(not getattr(p, "usable", True) for p in plans):
        raise CheckpointError(
            "FastPersistWriter through fastpersistd cannot use cached plans "
            "(DefaultSavePlanner(enable_plan_caching=True)): each save is a new job of the "
            "daemon, whose id a cached plan would not carry")
