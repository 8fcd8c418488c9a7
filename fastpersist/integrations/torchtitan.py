"""torchtitan: its CheckpointManager, saving and loading through fastpersist.

    from fastpersist.integrations.torchtitan import FastPersistCheckpointManager

    # in the trainer's config, instead of CheckpointManager.Config(...):
    checkpoint=FastPersistCheckpointManager.Config(enable=True, interval=500,
                                                   async_mode="async", keep_latest_k=3)

The fields are torchtitan's own. Every `step-N` checkpoint is then written by
fastpersist's DCP backend (integrations.dcp.FastPersistWriter: O_DIRECT, a
CRC32C per item, committed atomically, JSON metadata) and read back by
FastPersistReader, which checks those CRCs; `fpctl ls/inspect/verify` and
`fastpersist.load` work on it. What changes besides the storage:

- A step folder counts as a checkpoint only once committed: a fastpersist
  checkpoint with its manifest, or a DCP checkpoint with `.metadata` (one
  written before the switch, which still loads, through DCP's own reader).
  Hidden staging directories and leftovers of interrupted saves are never
  loaded or purged by name (`fpctl gc` removes leftovers).
- `keep_latest_k` counts as torchtitan does (the newest k steps, the one still
  being saved among them) but removes only committed checkpoints, and a
  fastpersist one by renaming it aside first (durably): a crash mid-removal
  never leaves a half-deleted `step-N`.
- Hugging Face exports (`last_save_in_hf`, `initial_load_in_hf`) keep
  torchtitan's safetensors writer and reader: those files are for other tools.
- Local paths only: a remote `folder` (gs://, s3://) is refused at start.
- `async_mode="async"` stages through the writer (fastpersist's reused staging
  buffers); `"async_with_pinned_mem"` keeps torchtitan's DefaultStager (CUDA
  only) and DCP's process executor, writing through FastPersistWriter: not yet
  tried on a GPU.

Tested with torchtitan 0.3.0 (its checkpointer needs tyro, docstring-parser,
typeguard and spmd_types; none of torchtitan's training dependencies).
"""

from __future__ import annotations

import os
import re
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType, async_save
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save
from torchtitan.components.checkpointer import MODEL, AsyncMode, CheckpointManager
from torchtitan.components.checkpointer.base import purge_thread
from torchtitan.tools import filesystem
from torchtitan.tools.utils import GarbageCollection

from ..adapters import delete_checkpoint, is_checkpoint
from .dcp import FastPersistReader, FastPersistWriter

_STEP = re.compile(r"step-(\d+)")  # the whole name (torchtitan's search also matches
# ".step-5.fp-tmp-...", an unfinished save's staging directory)


def committed_steps(folder: str) -> dict[int, Path]:
    """step -> path of each committed checkpoint in `folder`: a step-N
    directory with fastpersist's manifest or DCP's .metadata."""
    out: dict[int, Path] = {}
    try:
        names = os.listdir(folder)
    except FileNotFoundError:
        return out
    for name in names:
        match = _STEP.fullmatch(name)
        path = Path(folder) / name
        if match and (is_checkpoint(path) or (path / ".metadata").is_file()):
            out[int(match.group(1))] = path
    return out


def _remove(path: str) -> None:
    """The purge thread's removal: atomic for a fastpersist checkpoint."""
    if is_checkpoint(path):
        delete_checkpoint(Path(path))
    else:
        filesystem.rmtree(path)


class FastPersistCheckpointManager(CheckpointManager):
    """torchtitan's CheckpointManager with fastpersist's DCP storage (see the module)."""

    @dataclass(kw_only=True, slots=True)
    class Config(CheckpointManager.Config):
        # torchtitan builds the class that declares the Config it is given.
        pass

    def __init__(self, config: Config, **kwargs: Any) -> None:
        super().__init__(config, **kwargs)
        self._saving: Path | None = None  # the last save's path, kept while in flight (purge)
        if not self.enable:
            return
        if filesystem.is_remote(self.folder):
            raise ValueError(f"FastPersistCheckpointManager writes to local paths; "
                             f"{self.folder} is remote")
        theirs: threading.Thread | None = getattr(self, "purge_thread", None)
        if theirs is not None:
            # The same queue, with a removal that renames a checkpoint aside first.
            self.purge_queue.put(None)
            theirs.join()
            self.purge_thread = threading.Thread(
                target=purge_thread, args=(self.purge_queue, _remove), daemon=True)
            self.purge_thread.start()

    @torch.no_grad()
    def dcp_save(self, state_dict: dict[str, Any], checkpoint_id: str, async_mode: AsyncMode,
                 enable_garbage_collection: bool = False, to_hf: bool = False) -> Any:
        if to_hf:
            return super().dcp_save(state_dict, checkpoint_id, async_mode,
                                    enable_garbage_collection, to_hf)
        writer = FastPersistWriter(checkpoint_id)
        self._saving = Path(checkpoint_id)
        ret: Any = None
        if async_mode == AsyncMode.ASYNC:
            # The writer is DCP's stager too: reused, bounded staging buffers.
            ret = async_save(state_dict, storage_writer=writer, process_group=self.pg)
        elif async_mode == AsyncMode.ASYNC_WITH_PINNED_MEM:
            ret = async_save(state_dict, storage_writer=writer, process_group=self.pg,
                                 async_checkpointer_type=AsyncCheckpointerType.PROCESS,
                                 async_stager=self.stager)
        else:
            dcp_save(state_dict, storage_writer=writer)
        if enable_garbage_collection:
            GarbageCollection.collect("GC collection invoked by checkpointer.")
        return ret

    @torch.no_grad()
    def dcp_load(self, state_dict: dict[str, Any], checkpoint_id: str, from_hf: bool,
                 from_quantized: bool) -> None:
        if from_hf or not is_checkpoint(checkpoint_id):
            # HF safetensors, or a DCP checkpoint written before the switch.
            super().dcp_load(state_dict, checkpoint_id, from_hf, from_quantized)
            return
        dcp_load(state_dict, storage_reader=FastPersistReader(checkpoint_id))
        # As torchtitan does: the model's states are flattened into state_dict.
        if MODEL in self.states:
            self.states[MODEL].load_state_dict(state_dict)

    def _find_load_step(self, folder: str = "") -> int:
        steps = committed_steps(folder or self.folder)
        return max(steps) if steps else -1

    def _purge_stale_checkpoints(self) -> None:
        if not self._should_purge():
            return
        # As torchtitan counts: the newest keep_latest_k steps, the one being
        # saved among them (keep_latest_k >= 2 keeps a committed one too).
        steps = committed_steps(self.folder)
        match = _STEP.fullmatch(self._saving.name) if self._saving is not None else None
        newest = sorted({*steps, *([int(match.group(1))] if match else [])})
        for step in newest[: -self.keep_latest_k]:
            if step in steps:
                self.purge_queue.put(str(steps[step]))


__all__ = ["FastPersistCheckpointManager", "committed_steps"]
