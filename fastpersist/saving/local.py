"""The local sink: a checkpoint directory written by this process with the
engine (persist.CheckpointWriter), for async_save, Checkpointer and save
without a daemon. See sink.py for the call sequence."""

from __future__ import annotations

from typing import Any

from ..errors import CheckpointAbortedError
from ..knobs import current as current_knobs
from ..storage.retention import apply_at
from ..tensors import packed, plan, state
from ..tensors.plan import StoredTensor
from .files import StagedFiles
from .persist import CheckpointWriter
from .sink import SaveRequest
from .snapshot import FilePlan, group_into_files
from .staging import StagingPool

Planned = tuple[Any, list[StoredTensor]]  # the tree, and its tensors in entry order


def cut(stored: list[StoredTensor], request: SaveRequest, budget: int | None = None,
        file_bytes: int | None = None) -> tuple[list[FilePlan], int]:
    """Data files of at most FASTPERSIST_FILE_BYTES (or `file_bytes`, if
    less; and, under a staging budget, half of it: group_into_files): one
    layout on disk whoever writes it, this process or a daemon. budget: the
    sink's (a daemon's window), else FASTPERSIST_STAGING_BUDGET. Returns the
    files and the budget they were cut for.

    Compressing a file holds all its stored frames in memory until the file
    is written (codec/packing.plan), beside the staged files: so with
    compression and a budget, staging gets two thirds of it and files are cut
    at a third, which also bounds a blocking save (which stages nothing) by
    the encoded copy of one file. A single tensor over that cap still gets a
    file of its own, encoded whole."""
    knobs = current_knobs()
    if budget is None:
        budget = knobs.staging_budget
    file_bytes = min(knobs.file_bytes, file_bytes or knobs.file_bytes)
    if request.compression and budget:
        budget = max(budget // 3 * 2, 2)
        file_bytes = min(file_bytes, budget // 2)
    budget = 0 if request.inline else budget
    return group_into_files(stored, budget, file_bytes), budget


def plan_state(obj: Any, request: SaveRequest) -> Planned:
    packed.check_compression(request.compression)
    tree, leaves = state.encode(obj, allow_pickle=request.allow_pickle)
    return tree, plan.plan_tensors(leaves)


class LocalJob:
    def __init__(self, writer: CheckpointWriter, files: list[FilePlan], budget: int,
                 request: SaveRequest) -> None:
        self.writer = writer
        self.files = files
        self.budget = budget
        self.request = request

    def owned(self) -> None:
        """Nobody else takes it over."""

    def write(self, files: StagedFiles, pool: StagingPool) -> None:
        writer, request = self.writer, self.request
        try:
            for staged in files:
                if request.aborted():
                    raise CheckpointAbortedError(f"save of {writer.target} was aborted")
                staged.wait_copied()
                writer.write_file(staged.tensors)
                pool.give_back(staged)  # a later file of this save may wait for room
            writer.commit()
        except BaseException:
            writer.abort()
            raise
        if request.after_commit is not None:
            apply_at(writer.target.parent, writer.target.name, request.after_commit)
        if request.on_commit is not None:
            request.on_commit(writer.target)


class LocalSink:
    collective = False
    leader = True  # this process commits
    writes_in_process = True
    takes_urls = False

    def __init__(self, pool: StagingPool | None = None) -> None:
        self.pool = pool or StagingPool()

    def plan(self, obj: Any, request: SaveRequest) -> Planned:
        return plan_state(obj, request)

    def cut(self, planned: Planned, request: SaveRequest) -> list[FilePlan]:
        return cut(planned[1], request)[0]

    def staging_budget(self) -> int:
        return current_knobs().staging_budget

    def begin(self, planned: Planned, request: SaveRequest) -> LocalJob:
        if request.durability != "disk":
            raise ValueError("a memory-only save is kept by fastpersistd: save through it")
        tree, stored = planned
        files, budget = cut(stored, request)
        writer = CheckpointWriter.begin(request.path, tree, stored, request.compression)
        return LocalJob(writer, files, budget, request)

    def close(self) -> None:
        """Nothing beyond the pool, which the pipeline clears."""



__all__ = ["LocalJob", "LocalSink", "cut", "plan_state"]
