"""FastPersistWriter's saves through fastpersistd (FASTPERSIST_DAEMON, or
FastPersistWriter(daemon=...)): each rank hands its items to its node's daemon
as one part of a job, and the coordinator commits the job there, as a
distributed fastpersist.save through the daemon does (distributed/storage.py,
ThroughDaemon):

    prepare_global_plan     the coordinator begins the job (BeginJob); its id
                            goes to every rank in the plan's storage_data
    write_data              every rank: its items copied into shared-memory
                            staging (as much as the daemon lets one client
                            hold; the rest streamed to it over gRPC from the
                            tensors), the CRC32C of each 4 MiB block of the
                            items larger than one (the daemon reports one per
                            item; resharding loads check blocks), then the
                            part handed over and written by the daemon
    finish                  the coordinator: CommitJob with the manifest and
                            dcp_metadata.json, which the daemon writes beside
                            it, before it

The checkpoint on disk is the same as an in-process save's. A trainer killed
before the commit leaves the old checkpoint: the daemon drops the job (its
parts' streams break, or nobody touches it for --idle-timeout). Plan caching
(DefaultSavePlanner(enable_plan_caching=True)) is refused: a cached plan would
carry an earlier save's job id.
"""

from __future__ import annotations

import atexit
import contextlib
import threading
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint.planner import SavePlanner, WriteItem
from torch.distributed.checkpoint.storage import WriteResult

from . import _fp
from .blocks import CRC_BLOCK, block_spans
from .items import stored_item
from .manifest import Written
from .memory import bytes_of
from .metadata_json import ItemInfo

_storages: dict[str, _fp.ThroughDaemon] = {}
_storages_lock = threading.Lock()


def storage_for(address: str) -> _fp.ThroughDaemon:
    """The process's connection and shared-memory staging pool for `address`
    (kept across saves: the pool's segments are reused)."""
    with _storages_lock:
        storage = _storages.get(address)
        if storage is None:
            storage = _storages[address] = _fp.ThroughDaemon(address)
        return storage


def begin(storage: _fp.ThroughDaemon, target: Path) -> str:
    """Begin the job of a save of `target`; its id. Asks the daemon what it can
    do each time: one restarted at another version since the last save would
    otherwise commit the job without dcp_metadata.json."""
    info = storage.client.info()
    if "commit-files" not in info.features:
        raise _fp.DaemonError(
            f"fastpersistd at {storage.client.address} (fastpersist {info.version}) cannot "
            "write a DCP checkpoint's metadata (CommitJob.files): DCP saves through it need a "
            f"daemon of fastpersist {_fp.__version__} or later", "FAILED_PRECONDITION")
    return storage.stage(target)


# The daemon takes messages of up to 64 MiB (daemon/server.py); the commit's
# other fields are small.
MAX_COMMIT_BYTES = 60 << 20


def commit(storage: _fp.ThroughDaemon, job_id: str, manifest: bytes,
           files: dict[str, bytes]) -> None:
    """CommitJob with the manifest and `files` beside it."""
    size = len(manifest) + sum(len(d) for d in files.values())
    if size > MAX_COMMIT_BYTES:
        raise _fp.CheckpointError(
            f"the checkpoint's manifest and DCP metadata are {size} bytes together, more than "
            f"fastpersistd takes in one commit ({MAX_COMMIT_BYTES}): save this state in-process "
            "(FastPersistWriter(path, daemon=\"\")), or with fewer, larger items")
    storage.publish(job_id, manifest, None, files=files)


@atexit.register
def _close_all() -> None:
    """Shared-memory segments outlive a process that does not unlink them."""
    with _storages_lock:
        storages = list(_storages.values())
        _storages.clear()
    for storage in storages:
        with contextlib.suppress(Exception):
            storage.close()


def forget(address: str) -> None:
    """Close and drop the process's storage for `address` (tests; a daemon restarted)."""
    with _storages_lock:
        storage = _storages.pop(address, None)
    if storage is not None:
        storage.close()


def write(storage: _fp.ThroughDaemon, target: Path, job_id: str, rank: int,
          files: list[list[WriteItem]], planner: SavePlanner) -> list[WriteResult]:
    """This rank's part of the job, durable. Files are staged in shared memory
    up to the staging limit (_staging_limit); the rest are streamed to the
    daemon from the tensors, which do not change meanwhile (the caller waits
    for dcp.save; dcp.async_save's are its snapshot; a device tensor is copied
    to the host as the stream reaches it). If the daemon has no room for the
    staged ones when the part opens (other ranks of the node hold its budget),
    ThroughDaemon.write streams them from their buffers."""
    pool = storage.pool
    by_name: dict[str, WriteItem] = {}
    stored_files = []
    for items in files:
        stored = []
        for item in items:
            s = stored_item(item, planner.resolve_data(item), host=False)
            stored.append(s)
            by_name[s.name] = item
        stored_files.append(stored)
    staged = _stage(pool, stored_files, _staging_limit(storage))
    try:
        blocks: dict[str, list[int]] = {}
        for file in staged:
            file.wait_copied()
            blocks.update(_block_crcs(file))
        records = storage.write(target, job_id, rank, _fp.StagedFiles.copied(staged), None)
    finally:
        for file in staged:
            pool.give_back(file)  # reused, or quarantined if the daemon may still read it
    results = []
    for file_record, tensors in records:
        for record in tensors:
            item_blocks = blocks.get(record.name)
            if item_blocks is not None:
                spans = block_spans(record.length)
                if _fp.combine(list(zip(item_blocks, (n for _, n in spans), strict=True))
                               ) != record.crc32c:
                    raise _fp.CorruptCheckpointError(
                        f"{record.name}: fastpersistd's CRC32C of the item differs from this "
                        "process's of the same bytes: they changed during the save")
            info = ItemInfo(record.name, tuple(item_blocks or ()))
            item = by_name.pop(record.name)
            results.append(WriteResult(index=item.index, size_in_bytes=record.length,
                                       storage_data=Written(info, record, file_record)))
    if by_name:
        raise _fp.DaemonError(f"fastpersistd reported no record of {sorted(by_name)[:3]}",
                              "INTERNAL")
    return results


def _stage(pool: _fp.StagingPool, stored_files: list[list[_fp.StoredTensor]],
           limit: int) -> list[_fp.StagedFile]:
    """Each file staged in a buffer of the pool while they fit `limit` (0: no
    limit) and shared memory has room; unstaged (streamed) after that."""
    staged: list[_fp.StagedFile] = []
    held = 0  # bytes of the pool's buffers these files hold
    try:
        for stored in stored_files:
            nbytes = sum(s.nbytes for s in stored)
            pinned = any(s.source.is_cuda for s in stored)
            buffer = None
            if not limit or held + nbytes <= limit:
                try:
                    buffer = pool.acquire(nbytes, 0, pinned)
                except (OSError, _fp.CheckpointError):
                    buffer = None  # shared memory is full (ENOSPC): stream it
            if buffer is not None and limit and held + buffer.numel() > limit:
                pool.give_back_unused([buffer], pinned)  # a free buffer larger than asked
                buffer = None
            if buffer is None:
                staged.append(_fp.StagedFile(stored, None))
                continue
            held += buffer.numel()
            try:
                staged.append(_fp.stage_file(stored, buffer, pinned))
            except BaseException:
                pool.discard(buffer, pinned)
                raise
    except BaseException:
        for file in staged:
            pool.give_back(file)
        raise
    return staged


def _staging_limit(storage: _fp.ThroughDaemon) -> int:
    """The shared memory a part may hold (0: no limit): FASTPERSIST_STAGING_BUDGET
    and the daemon's budgets, whichever is least. A part over the daemon's would
    be refused (RESOURCE_EXHAUSTED)."""
    info = storage.client.info(cached=True)
    limits = [b for b in (_fp.knobs.current().staging_budget, info.client_budget,
                          info.staging_budget) if b]
    return min(limits, default=0)


def _block_crcs(file: _fp.StagedFile) -> dict[str, list[int]]:
    """The CRC32C of each block of the file's items larger than one block,
    from what the daemon reads: the staged copy, or a streamed file's tensors
    (a device or non-contiguous one copied to the host, one at a time)."""
    out: dict[str, list[int]] = {}
    if file.buffer is None:
        for t in file.entries:
            if t.nbytes > CRC_BLOCK:
                src = t.source if t.source.is_cpu and t.source.is_contiguous() else \
                    t.source.to("cpu").contiguous()
                out[t.name] = _crcs(bytes_of(src), t.nbytes)
        return out
    memory = bytes_of(file.buffer)
    for t, start in zip(file.order, file.starts, strict=False):
        if t.nbytes > CRC_BLOCK:
            out[t.name] = _crcs(memory[start:start + t.nbytes], t.nbytes)
    return out


def _crcs(memory: memoryview, nbytes: int) -> list[int]:
    return [_fp.crc32c(memory[a:a + n]) for a, n in block_spans(nbytes)]


def refuse_cached_plans(plans: list[Any]) -> None:
    if any(not getattr(p, "usable", True) for p in plans):
        raise _fp.CheckpointError(
            "FastPersistWriter through fastpersistd cannot use cached plans "
            "(DefaultSavePlanner(enable_plan_caching=True)): each save is a new job of the "
            "daemon, whose id a cached plan would not carry")
