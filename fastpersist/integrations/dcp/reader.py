"""FastPersistReader: torch.distributed.checkpoint's StorageReader on fastpersist.

    dcp.load(state_dict, storage_reader=FastPersistReader("ckpt/step-100"))

read_metadata validates manifest.json (as fastpersist.load does) and rebuilds
DCP's Metadata from dcp_metadata.json, checked against it. read_data reads,
file by file and with the engine (O_DIRECT, many reads in flight), only what
the plan asks for:

- an item read whole (the same layout as saved, a bytes value, or an item
  of at most one CRC block) is checked against its CRC32C in the manifest;
  when the destination is a contiguous CPU tensor of the item's shape, it is
  read straight into it (no copy);
- a part of a larger item (resharding) is read as the 4 MiB CRC blocks that
  hold it, each checked against its own CRC32C (blocks.py), so every byte
  used is verified and the rest of the item is not read.

A mismatch raises ChecksumMismatchError (a CheckpointError) naming the file
and item; DCP reports it from dcp.load inside its CheckpointException.
verify=False (or FASTPERSIST_VERIFY_LOAD=0) skips the checks.

Bytes items (what DCP stores with torch.save: non-tensor values, tuples) are
handed to DCP's planner, whose load_bytes unpickles them with
torch.load(weights_only=False): code from the checkpoint would run. So each
is first loaded with torch.load(weights_only=True), torch's restricted
unpickler (tensors, containers, numbers, strings; io.BytesIO values, which
DCP takes as such, allowed too), and one it refuses
raises PickleNotAllowedError naming the item, unless allow_pickle=True.
FileSystemReader unpickles them all; torch.load itself defaults to
weights_only=True, and so does this reader.
"""

from __future__ import annotations

import io
import os
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from ...adapters import (
    FileRecord,
    Manifest,
    Segment,
    TensorRecord,
    dtype_of,
    os_error,
    settings,
    source_for,
)
from ...errors import ChecksumMismatchError, ManifestError, PickleNotAllowedError
from . import metadata_json
from .blocks import CRC_BLOCK, contiguous_strides, is_whole, touched_blocks
from .memory import bytes_of, no_gc
from .metadata_json import DCP_METADATA_NAME, ItemInfo

# Temporary memory (items read whole and then copied, partial spans) per engine call.
_BATCH_BYTES = 256 << 20
_MAX_METADATA_BYTES = 1 << 30


class FastPersistReader(StorageReader):
    """Reads a checkpoint that FastPersistWriter wrote at `path`."""

    def __init__(self, path: str | os.PathLike[str], _extension_registry: Any = None, *,
                 verify: bool | None = None, allow_pickle: bool = False) -> None:
        """_extension_registry: FileSystemReader's (stream transforms), taken so
        that the class name is the only change, and unused: a fastpersist
        checkpoint's files have no DCP extensions to undo."""
        super().__init__()
        self.path = Path(os.path.abspath(os.fspath(path)))
        self.verify = verify
        self.allow_pickle = allow_pickle
        self.load_id = str(uuid.uuid4())
        self.storage_data: dict[MetadataIndex, ItemInfo] = {}
        self._records: dict[str, TensorRecord] = {}
        self._files: dict[str, FileRecord] = {}
        self._source = source_for(self.path)
        self.bytes_read = 0  # data bytes read by read_data so far (for tests and benchmarks)

    @property
    def checkpoint_id(self) -> str:
        return str(self.path)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return isinstance(checkpoint_id, (str, os.PathLike))

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        self.storage_data, self._records, self._files = {}, {}, {}
        if checkpoint_id:
            self.path = Path(os.path.abspath(os.fspath(checkpoint_id)))
        self._source = source_for(self.path)  # (its manifest read anew)
        self.load_id = str(uuid.uuid4())

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        with no_gc():
            return self._read_metadata()

    def _read_metadata(self) -> Metadata:
        manifest = self._read_manifest()
        meta_path = self.path / DCP_METADATA_NAME
        try:
            with open(meta_path, "rb") as f:
                data = f.read(_MAX_METADATA_BYTES + 1)
        except FileNotFoundError:
            raise ManifestError(
                f"{self.path} is a fastpersist checkpoint without {DCP_METADATA_NAME}: it was "
                "not saved through torch.distributed.checkpoint (load it with "
                "fastpersist.load)") from None
        except OSError as exc:
            raise os_error(exc, f"cannot read {meta_path}") from exc
        if len(data) > _MAX_METADATA_BYTES:
            raise ManifestError(f"{meta_path} is larger than {_MAX_METADATA_BYTES} bytes")
        metadata = metadata_json.loads(data, manifest, str(self.path))
        if metadata.storage_meta is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any,
                              **kwargs: Any) -> None:
        if metadata.storage_data is None:
            raise ManifestError(f"{self.path}: the DCP metadata has no storage_data")
        self.storage_data = metadata.storage_data
        if not self._records:
            self._read_manifest()

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        verify = settings().verify_load if self.verify is None else self.verify
        by_item: dict[MetadataIndex, list[ReadItem]] = {}
        for req in plan.items:
            by_item.setdefault(req.storage_index, []).append(req)
        by_file: dict[str, list[_Job]] = {}
        for index, reqs in by_item.items():
            info = self.storage_data.get(index)
            if info is None or info.record not in self._records:
                at = None if index.offset is None else list(index.offset)
                raise ManifestError(f"{self.path}: the checkpoint has no item {index.fqn!r} "
                                        f"at {at}")
            record = self._records[info.record]
            by_file.setdefault(record.file, []).append(
                _job(record, info, reqs, planner, self.allow_pickle, str(self.path)))
        for name, jobs in by_file.items():
            self._source.check_file(self._files[name])
            for batch in _batches(jobs):
                self._read(self._files[name], batch, verify)
                for job in batch:
                    job.finish(planner)
        future: Future[None] = Future()
        future.set_result(None)
        return future

    # --- internals -------------------------------------------------------------------

    def _read_manifest(self) -> Manifest:
        manifest = self._source.manifest()
        self._records = {r.name: r for r in manifest.tensors}
        self._files = {f.name: f for f in manifest.files}
        return manifest

    def _read(self, f: FileRecord, batch: list[_Job], verify: bool) -> None:
        """One read of the batch's segments through the source (the engine:
        O_DIRECT, many in flight), each checked against its CRC32C."""
        segments = [s for job in batch for s in job.segments]
        self.bytes_read += sum(len(s[0]) for s in segments)
        crcs = self._source.read_ranges(f, segments, checksum=verify)
        if not verify:
            return
        assert crcs is not None
        actual_crcs = iter(crcs)
        for job in batch:
            for expected, what in job.expected:
                actual = next(actual_crcs)
                if actual != expected:
                    raise ChecksumMismatchError(
                        f"{self.path}: {what}tensor {job.record.name!r} in {f.name} is corrupt: "
                        f"CRC32C {actual:#010x}, expected {expected:#010x}",
                        file=f.name, tensor=job.record.name)


@dataclass
class _Job:
    """What to read of one item, the CRC32C each segment must have, and what
    to do with the bytes once they are read and checked."""

    record: TensorRecord
    segments: list[Segment]
    expected: list[tuple[int, str]]  # (CRC32C, what for messages) per segment
    temp_bytes: int
    finish: Callable[[LoadPlanner], None]
    keep: list[Any] = field(default_factory=list)  # buffers the segments view


def _job(record: TensorRecord, info: ItemInfo, reqs: list[ReadItem],
         planner: LoadPlanner, allow_pickle: bool, where: str) -> _Job:
    if reqs[0].type == LoadItemType.BYTE_IO:
        raw = bytearray(record.length)

        def load_bytes(planner: LoadPlanner) -> None:
            if not allow_pickle:
                _check_weights_only(raw, reqs[0].storage_index.fqn, where)
            for req in reqs:
                planner.load_bytes(req, io.BytesIO(raw))

        return _Job(record, [(memoryview(raw), record.offset)], [(record.crc32c, "")],
                    record.length, load_bytes, [raw])
    dtype = dtype_of(record.dtype)
    shape = record.shape
    for req in reqs:
        if len(req.storage_offsets) != len(shape) or any(
                o + n > d for o, n, d in zip(req.storage_offsets, req.lengths, shape,
                                             strict=True)):
            raise ManifestError(f"{record.name}: the plan asks for {list(req.lengths)} at "
                                    f"{list(req.storage_offsets)} of a chunk of {list(shape)}")
    whole = any(is_whole(shape, r.storage_offsets, r.lengths) for r in reqs)
    blocks: set[int] = set()
    if not whole and info.block_crcs:
        for r in reqs:
            blocks |= touched_blocks(shape, dtype.itemsize, r.storage_offsets, r.lengths)
        whole = len(blocks) == len(info.block_crcs)
    if whole or not info.block_crcs:
        return _whole(record, dtype, reqs, planner)
    return _partial(record, info, dtype, reqs, sorted(blocks))


def _check_weights_only(raw: bytearray, fqn: str, where: str) -> None:
    """Refuse a bytes item that torch's restricted unpickler refuses: the
    planner would unpickle it without restriction (the module docstring)."""
    try:
        # io.BytesIO values, which DCP supports as such, are bytes: allowed.
        with torch.serialization.safe_globals([io.BytesIO]):
            torch.load(io.BytesIO(raw), weights_only=True)
    except Exception as exc:  # torch raises UnpicklingError, or whatever the data provokes
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise PickleNotAllowedError(
            f"{where}: item {fqn!r} is pickled data that torch.load(weights_only=True) refuses "
            f"({first[:200]}); FastPersistReader(..., allow_pickle=True) unpickles it, which "
            "runs code from the checkpoint: only for checkpoints you trust") from None


def _whole(record: TensorRecord, dtype: torch.dtype, reqs: list[ReadItem],
           planner: LoadPlanner) -> _Job:
    shape = record.shape
    if len(reqs) == 1 and is_whole(shape, reqs[0].storage_offsets, reqs[0].lengths):
        dest = planner.resolve_tensor(reqs[0]).detach()
        if (dest.device.type == "cpu" and dest.dtype == dtype and tuple(dest.shape) == shape
                and dest.is_contiguous()):
            # Straight into the caller's tensor.
            def commit(planner: LoadPlanner) -> None:
                planner.commit_tensor(reqs[0], dest)

            return _Job(record, [(bytes_of(dest), record.offset)], [(record.crc32c, "")],
                        0, commit, [dest])
    buf = torch.empty(shape, dtype=dtype)

    def copy_out(planner: LoadPlanner) -> None:
        for req in reqs:
            src = buf
            for d, (o, n) in enumerate(zip(req.storage_offsets, req.lengths, strict=True)):
                src = src.narrow(d, o, n)
            _copy_to(planner, req, src)

    return _Job(record, [(bytes_of(buf), record.offset)], [(record.crc32c, "")],
                record.length, copy_out, [buf])


def _partial(record: TensorRecord, info: ItemInfo, dtype: torch.dtype,
             reqs: list[ReadItem], blocks: list[int]) -> _Job:
    lo = blocks[0] * CRC_BLOCK
    hi = min((blocks[-1] + 1) * CRC_BLOCK, record.length)
    buf = torch.empty(hi - lo, dtype=torch.uint8)
    memory = bytes_of(buf)
    segments: list[Segment] = []
    expected = []
    for b in blocks:
        start = b * CRC_BLOCK
        n = min(CRC_BLOCK, record.length - start)
        segments.append((memory[start - lo:start - lo + n], record.offset + start))
        expected.append((info.block_crcs[b], f"block {b} of "))
    strides = contiguous_strides(record.shape)

    def copy_out(planner: LoadPlanner) -> None:
        elems = buf.view(dtype)
        base = lo // dtype.itemsize
        for req in reqs:
            first = sum(o * s for o, s in zip(req.storage_offsets, strides, strict=True))
            src = elems.as_strided(tuple(req.lengths), tuple(strides), first - base) \
                if all(req.lengths) else torch.empty(tuple(req.lengths), dtype=dtype)
            _copy_to(planner, req, src)

    return _Job(record, segments, expected, hi - lo, copy_out, [buf])


def _copy_to(planner: LoadPlanner, req: ReadItem, src: torch.Tensor) -> None:
    dest = planner.resolve_tensor(req).detach()
    if dest.shape != src.shape:
        raise ManifestError(f"{req.storage_index.fqn}: the plan's destination is "
                                f"{list(dest.shape)}, the stored part {list(src.shape)}")
    dest.copy_(src)
    planner.commit_tensor(req, dest)


def _batches(jobs: list[_Job]) -> list[list[_Job]]:
    """Consecutive jobs in groups of at most _BATCH_BYTES of temporary memory
    (or one larger job), in file order so reads go forward."""
    jobs = sorted(jobs, key=lambda j: j.record.offset)
    out: list[list[_Job]] = [[]]
    size = 0
    for job in jobs:
        if out[-1] and size + job.temp_bytes > _BATCH_BYTES:
            out.append([])
            size = 0
        out[-1].append(job)
        size += job.temp_bytes
    return [b for b in out if b]
