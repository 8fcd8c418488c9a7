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
"""

from __future__ import annotations

import dataclasses
import errno
import os
import secrets
import shutil
import socket
import threading
import uuid
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import (
    SavePlan,
    SavePlanner,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from . import _fp, metadata_json
from .blocks import block_spans, record_name
from .manifest import Written, build
from .memory import bytes_of, no_gc
from .metadata_json import ItemInfo
from .stager import FastPersistStager, Lease

DCP_VERSION = "1.0.0"  # the Metadata.version DCP's FileSystemWriter writes

_token: str | None = None
_in_flight: set[Path] = set()  # staging directories of this process's saves
_in_flight_lock = threading.Lock()


def process_token() -> str:
    """PID-RAND@HOST of this process (one per process, as leftover names have)."""
    global _token
    if _token is None or not _token.startswith(f"{os.getpid()}-"):
        _token = f"{os.getpid()}-{secrets.token_hex(4)}@{socket.gethostname()}"
    return _token


def staging_path(target: Path, token: str) -> Path:
    return target.parent / f".{target.name}.fp-tmp-{token}"


@dataclasses.dataclass(frozen=True)
class PlanData:
    """SavePlan.storage_data: where this rank writes."""

    token: str
    rank: int


class FastPersistWriter(StorageWriter, AsyncStager):
    """Writes a DCP checkpoint as a fastpersist checkpoint directory at `path`.

    overwrite=False refuses a target that exists; otherwise an existing
    fastpersist checkpoint there is replaced atomically (anything else that
    is not an empty directory is refused). `stager` (default: one over the
    process's shared staging pool) snapshots the state for dcp.async_save.
    """

    _synchronize_after_execute = False

    def __init__(self, path: str | os.PathLike[str], *, overwrite: bool = True,
                 stager: FastPersistStager | None = None) -> None:
        super().__init__()
        self.path = Path(os.path.abspath(os.fspath(path)))
        self.overwrite = overwrite
        self.save_id = str(uuid.uuid4())
        self.is_coordinator = True
        self.rank = 0
        self._stager = stager
        self._lease: Lease | None = None
        self._staging: _fp.Staging | None = None
        self._where: Path | None = None  # the staging directory's own path

    # --- pickling (dcp.async_save with a process executor) -------------------

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        if self._lease is not None and self._stager is not None:
            # The staged state travels with us to another process, which
            # reads it there: its buffer must never be reused here.
            self._lease.handed_off = True
            self._stager.release(self._lease)
            self._lease = None
        state.update(_stager=None, _lease=None, _staging=None, _where=None)
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
            self.path = Path(os.path.abspath(os.fspath(checkpoint_id)))
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

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        for item in plan.items:  # refuse what cannot be stored before any I/O
            if item.tensor_data is not None and _fp.dtypes.to_name(
                    item.tensor_data.properties.dtype) is None:
                raise _fp.UnsupportedValueError(
                    f"{item.index.fqn}: dtype {item.tensor_data.properties.dtype} cannot be "
                    "stored (not a safetensors dtype)")
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        token = process_token()
        self._begin(token)
        return [dataclasses.replace(p, storage_data=PlanData(token, i))
                for i, p in enumerate(plans)]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        data: PlanData = plan.storage_data
        directory = staging_path(self.path, data.token)
        engine = _fp.get_engine()
        results: list[WriteResult] = []
        try:
            for n, items in enumerate(_files_of(plan.items, _fp.knobs.current().file_bytes)):
                results += _write_file(engine, directory, _fp.part_file_name(data.rank, n),
                                       items, planner)
        finally:
            self._release_lease()  # written (or failed): the snapshot is no longer read
        future: Future[list[WriteResult]] = Future()
        future.set_result(results)
        return future

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        staging = self._staging
        if staging is None:
            raise _fp.CheckpointError(f"{self.path}: finish() without prepare_global_plan()")
        try:
            written = {wr.index: wr.storage_data for rank in results for wr in rank}
            metadata.version = DCP_VERSION
            metadata.storage_data = {index: w.info for index, w in written.items()}
            metadata.storage_meta = self.storage_meta()
            with no_gc():
                manifest = build(metadata, written, str(self.path))
                meta_json = metadata_json.dumps(metadata)
            staging.write_file(metadata_json.DCP_METADATA_NAME, meta_json)
            staging.commit(manifest)
        except OSError as exc:
            self._abort_pending()
            raise _fp.os_error(exc, f"cannot commit checkpoint {self.path}") from exc
        except BaseException:
            self._abort_pending()
            raise
        self._staging = None
        self._done_with(self._where)

    # --- the staging directory (coordinator) ------------------------------------

    def _begin(self, token: str) -> None:
        target = self.path
        if not self.overwrite and os.path.lexists(target):
            raise _fp.CheckpointExistsError(errno.EEXIST, f"{target} exists and overwrite=False")
        where = staging_path(target, token)
        with _in_flight_lock:
            if where in _in_flight:
                raise _fp.CheckpointError(f"another save to {target} is in progress in this "
                                          "process")
            _in_flight.add(where)
        try:
            # Ours (this process's token) and not in flight: a failed save's.
            shutil.rmtree(where, ignore_errors=True)
            staging = _fp.Staging.create(target)
            os.rename(staging.path, where)
        except BaseException:
            with _in_flight_lock:
                _in_flight.discard(where)
            raise
        staging.path = where
        self._staging, self._where = staging, where

    def _abort_pending(self) -> None:
        staging, self._staging = self._staging, None
        if staging is not None:
            staging.abort()
        self._done_with(self._where)

    def _done_with(self, where: Path | None) -> None:
        self._where = None
        with _in_flight_lock:
            if where is not None:
                _in_flight.discard(where)


def _item_bytes(item: WriteItem) -> int:
    if item.tensor_data is not None:
        return item.tensor_storage_size() or 0
    return item.bytes_io_data.nbytes if item.bytes_io_data is not None else 0


def _files_of(items: list[WriteItem], file_bytes: int) -> list[list[WriteItem]]:
    """Items grouped into files of about file_bytes (device tensors are copied
    to the host one file at a time)."""
    files: list[list[WriteItem]] = [[]]
    size = 0
    for item in items:
        n = _item_bytes(item)
        if files[-1] and size + n > file_bytes:
            files.append([])
            size = 0
        files[-1].append(item)
        size += n
    return [f for f in files if f]


def _host_bytes(item: WriteItem, data: Any) -> torch.Tensor:
    """The item's bytes as a contiguous CPU tensor (zero-copy when possible)."""
    if item.type == WriteItemType.BYTE_IO:
        raw = bytearray(data.getbuffer())
        return torch.frombuffer(raw, dtype=torch.uint8) if raw else torch.empty(0,
                                                                                dtype=torch.uint8)
    t: torch.Tensor = data.detach()
    if t.device.type != "cpu":
        t = t.to("cpu")
    return t.contiguous()


def _write_file(engine: _fp.Engine, directory: Path, name: str, items: list[WriteItem],
                planner: SavePlanner) -> list[WriteResult]:
    stored, by_name = [], {}
    for item in items:
        t = _host_bytes(item, planner.resolve_data(item))
        if item.type == WriteItemType.BYTE_IO:
            rname, dtype = record_name(item.index.fqn, None), "U8"
        else:
            rname = record_name(item.index.fqn, item.index.offset or ())
            found = _fp.dtypes.to_name(t.dtype)
            if found is None:
                raise _fp.UnsupportedValueError(f"{item.index.fqn}: dtype {t.dtype} cannot be "
                                                "stored")
            dtype = found
        s = _fp.StoredTensor(rname, dtype, tuple(t.shape), t, t.nbytes)
        stored.append(s)
        by_name[rname] = item
    plan = _fp.plan_file(stored)
    lay = plan.layout
    segments: list[_fp.Segment] = [(lay.header, 0)]
    spans: list[list[tuple[int, int]]] = []
    for s, offset in zip(plan.order, lay.offsets, strict=True):
        memory = bytes_of(s.source)
        item_spans = block_spans(s.nbytes)
        spans.append(item_spans)
        segments += [(memory[a:a + n], offset + a) for a, n in item_spans]
    try:
        result = engine.write_file(str(directory / name), segments, lay.size)
    except OSError as exc:
        raise _fp.os_error(exc, f"cannot write {name} of checkpoint {directory}") from exc
    assert result.crcs is not None
    file = _fp.FileRecord(name=name, size=lay.size, data_start=lay.data_start,
                          header_crc32c=result.crcs[0])
    crcs = iter(result.crcs[1:])
    out = []
    for s, offset, item_spans in zip(plan.order, lay.offsets, spans, strict=True):
        block_crcs = [next(crcs) for _ in item_spans]
        whole = _fp.combine([(c, n) for c, (_, n) in zip(block_crcs, item_spans, strict=True)])
        record = _fp.TensorRecord(name=s.name, file=name, offset=offset, length=s.nbytes,
                                  dtype=s.dtype, shape=s.shape, crc32c=whole)
        info = ItemInfo(s.name, tuple(block_crcs) if len(item_spans) > 1 else ())
        item = by_name[s.name]
        out.append(WriteResult(index=item.index, size_in_bytes=s.nbytes,
                               storage_data=Written(info, record, file)))
    return out

