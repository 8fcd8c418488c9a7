"""The daemon's checkpoints: one Checkpoint per Begin, and its states.

    RECEIVING  files arrive (SubmitShm / SubmitStream) and are written as they
               come, in submission order, by the write workers (writer.py)
    WRITING    Commit received: every file is in the daemon's hands; from here
               on the daemon finishes it whatever the client does
    COMMITTED  manifest written last, renamed into place, fsynced (commit.py)
    FAILED / ABORTED   the staging directory is removed; nothing is visible

A Checkpoint is plain data; the registry (registry.py) changes it, with its
lock held.

Torch-free: this runs in the daemon.
"""

from __future__ import annotations

import enum
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..format import safetensors_file
from ..format.manifest import FileRecord, TensorRecord
from ..format.names import data_file_name, part_file_name
from ..protocol.shm import Mapping
from ..storage.commit import Staging
from ..storage.retention import AfterCommit
from .jobs import Job

# Terminal checkpoints stay known this long, so a late Wait still gets the result.
KEEP_FINISHED_SECONDS = 600.0


class State(enum.IntEnum):  # the values of CheckpointStatus.State
    RECEIVING = 1
    WRITING = 2
    COMMITTED = 3
    FAILED = 4
    ABORTED = 5


TERMINAL = (State.COMMITTED, State.FAILED, State.ABORTED)


@dataclass
class StreamHandle:
    """A data file being streamed into the checkpoint (streams.py)."""

    cancel: Callable[[], None]  # ends the stream's RPC (when the checkpoint ends first)
    last_chunk: float | None = None  # monotonic time of its last chunk; None while waiting


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


class Checkpoint:
    # Thousands stay known after they finish (registry.MAX_FINISHED): no __dict__.
    __slots__ = ("after_commit", "after_commit_error", "begun_unix", "busy", "bytes_total",
                 "bytes_written", "cleaned", "client", "error", "error_code", "file_records",
                 "files_total", "files_written", "finished_at", "first_submit", "frame_bytes",
                 "handed_over", "id", "job", "last_activity", "mapped_bytes", "memory_only",
                 "names", "part_json", "pending",
                 "rank", "relpath", "remove_parents", "reserved", "staging", "state", "streams",
                 "submitted", "target", "tensor_order", "tensor_records", "tree", "watchers")

    def __init__(self, ident: str, client: str, target: Path, relpath: str,
                 staging: Staging | None, files_total: int, reserved: int,
                 job: Job[Checkpoint] | None = None, rank: int = 0, frame_bytes: int = 0,
                 memory_only: bool = False) -> None:
        self.id = ident
        self.job = job  # a part of this distributed checkpoint (jobs.py)
        self.rank = rank  # the part's rank: its files are part_file_name(rank, i)
        self.part_json = ""  # the part's records, once its files are durable
        self.client = client
        self.target = target
        self.relpath = relpath
        # None while Begin makes the directory (without the service lock); no
        # file can come before, the client has no id yet.
        self.staging = staging
        self.files_total = files_total
        self.reserved = reserved
        # Begin's compression="zstd": submitted files are packed (compressed)
        # in frames of this many bytes; 0: written as submitted.
        self.frame_bytes = frame_bytes
        # Begin's durability="memory": kept in the memory tier alone, no staging
        # directory, nothing written under the root (memory.py copy_only).
        self.memory_only = memory_only
        self.state = State.RECEIVING
        self.error = ""
        self.error_code = ""
        self.pending: deque[PendingFile] = deque()
        self.streams: dict[int, StreamHandle] = {}  # data files being streamed, by index
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
        self.after_commit: AfterCommit | None = None  # a Checkpointer's policy (Commit)
        self.after_commit_error = ""  # what of it failed, once committed
        self.begun_unix = time.time()  # to tell newer saves of the same root (retention.py)
        self.busy = False  # a worker is writing one of its files or committing it
        self.watchers = 0
        self.last_activity = time.monotonic()
        self.first_submit: float | None = None
        self.finished_at: float | None = None
        self.cleaned = False  # staging directory removed (after a failure or abort)
        # Removes the parent directories its Begin made, if they are empty.
        self.remove_parents: Callable[[], None] = _nothing

    def clean_up(self) -> None:
        """Remove a failed checkpoint's staging (a part's goes with its job):
        file-system work, run by the janitor (registry.py), not under the lock."""
        if self.staging is not None:
            self.staging.abort()
            self.remove_parents()

    def drop_details(self) -> None:
        """A finished checkpoint stays known (for a late Wait) by its status
        alone: the tree and records it was committed with can be large. A
        part keeps its records until its job is checked against them."""
        self.tree = None
        self.tensor_order = _NO_NAMES
        self.names = _NO_SET
        self.submitted = _NO_INDEXES
        self.file_records = _NO_FILES
        self.pending = _NO_PENDING
        if self.job is None:
            self.tensor_records = _NO_RECORDS

    def file_name(self, index: int, *, packed: bool = False) -> str:
        return (part_file_name(self.rank, index, packed=packed) if self.job else
                data_file_name(index, packed=packed))

    @property
    def terminal(self) -> bool:
        return self.state in TERMINAL

    @property
    def in_use(self) -> bool:
        """Whether a worker or a stream writes into its staging directory."""
        return self.busy or bool(self.streams)

    def record_file(self, index: int, size: int, data_start: int,
                    entries: list[safetensors_file.ParsedEntry], crcs: list[int]) -> None:
        """Data file `index` is durable: `crcs` are its header's, then its tensors'."""
        if self.terminal:  # aborted meanwhile: its records were dropped (drop_details)
            return
        name = self.file_name(index)
        self.file_records[index] = FileRecord(name, size, data_start, crcs[0])
        for e, crc in zip(entries, crcs[1:], strict=True):
            self.tensor_records[e.name] = TensorRecord(
                name=e.name, file=name, offset=data_start + e.begin, length=e.end - e.begin,
                dtype=e.dtype, shape=e.shape, crc32c=crc)
        self.files_written += 1
        self.bytes_written += size

    def record_packed(self, index: int, file: FileRecord, records: list[TensorRecord]) -> None:
        """Packed data file `index` is durable, with these records."""
        if self.terminal:
            return
        self.file_records[index] = file
        self.tensor_records.update((r.name, r) for r in records)
        self.files_written += 1
        self.bytes_written += file.size

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
            "part_json": self.part_json, "after_commit_error": self.after_commit_error,
            "compression": "zstd" if self.frame_bytes else "",
            "durability": "memory" if self.memory_only else "",
        }


def _nothing() -> None:
    pass


# Shared by every finished checkpoint (drop_details): nothing adds to them once it
# is finished (every change to a checkpoint first checks that it is receiving).
_NO_NAMES: list[str] = []
_NO_SET: set[str] = set()
_NO_INDEXES: set[int] = set()
_NO_FILES: dict[int, FileRecord] = {}
_NO_RECORDS: dict[str, TensorRecord] = {}
_NO_PENDING: deque[PendingFile] = deque()
