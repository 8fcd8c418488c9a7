"""Hugging Face accelerate: the model weights of Accelerator.save_state/load_state
through fastpersist.

    from fastpersist.integrations.accelerate import register

    accelerator = Accelerator()
    hooks = register(accelerator, async_save=True)  # before save_state/load_state
    ...
    accelerator.save_state("ckpt/step-1000")   # weights: ckpt/step-1000/fastpersist-model/
    accelerator.load_state("ckpt/step-1000")   # read back from there (CRC32C checked)
    hooks.wait()                               # at the end: the last save is durable

How: accelerate's documented hooks. The save pre-hook is handed the models'
state dicts; it saves each with fastpersist (`fastpersist-model/`, then
`fastpersist-model_1/`, ... as accelerate numbers model.safetensors,
model_1.safetensors) and empties the list, so accelerate writes no model file.
The load pre-hook loads them into the models and empties the list of models
to load, so accelerate reads none. A directory without fastpersist-model/
(written without these hooks) is loaded by accelerate as usual. The data files
are safetensors files of the state dicts' names (for a prepared DDP model,
accelerate's own names, `module.`-prefixed).

What stays accelerate's: the optimizer, scheduler, scaler, sampler, RNG and
custom states (optimizer.bin, scheduler.bin, random_states_N.pkl, ...), written
with torch.save. The hooks are given only the models and their weights:
save_state passes the optimizers straight from the accelerator's own list to
save_accelerator_state, so no hook can take them over; doing so would mean
re-implementing save_state and load_state (with their FSDP, DeepSpeed and
Megatron branches), which the hooks exist to avoid. So with an optimizer like
Adam, fastpersist writes a third of the bytes. For a plain loop that wants it
all, save `{"model": ..., "optimizer": ..., "scheduler": ...}` with
fastpersist.Checkpointer instead (README, "Checkpointing a training loop").
Under FSDP, DeepSpeed or Megatron accelerate saves the models itself and the
hooks do nothing.

async_save=True: save_state returns once the weights are snapshotted; the next
save_state or load_state (and wait()) waits for them and raises a failure.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import fastpersist

if TYPE_CHECKING:
    from fastpersist import SaveFuture

log = logging.getLogger(__name__)


def model_dir(i: int) -> str:
    return "fastpersist-model" if i == 0 else f"fastpersist-model_{i}"


class FastPersistStateHooks:
    """The hooks register() installs on an Accelerator; see the module docstring."""

    def __init__(self, accelerator: Any, *, async_save: bool = False,
                 daemon: str | None = None) -> None:
        self.accelerator = accelerator
        self.async_save = async_save
        self.daemon = daemon
        self._pending: list[SaveFuture] = []
        self._handles = [accelerator.register_save_state_pre_hook(self._save),
                         accelerator.register_load_state_pre_hook(self._load)]

    def _writes(self) -> bool:
        acc = self.accelerator
        if acc.project_configuration.save_on_each_node:
            return bool(acc.is_local_main_process)
        return bool(acc.is_main_process)

    def _save(self, models: list[Any], weights: list[dict[str, Any]],
              output_dir: str | os.PathLike[str]) -> None:
        self.wait()
        if self._writes():
            for i, state in enumerate(weights):
                path = Path(output_dir) / model_dir(i)
                if self.async_save:
                    self._pending.append(fastpersist.async_save(state, path,
                                                                daemon=self.daemon))
                else:
                    fastpersist.save(state, path, daemon=self.daemon)
        weights.clear()  # saved: accelerate writes no model file

    def _load(self, models: list[Any], input_dir: str | os.PathLike[str]) -> None:
        self.wait()
        dirs = [Path(input_dir) / model_dir(i) for i in range(len(models))]
        if not models or not all(d.is_dir() for d in dirs):
            return  # not saved through these hooks: accelerate loads its own files
        for model, d in zip(models, dirs, strict=True):
            model.load_state_dict(fastpersist.load(d, map_location="cpu"))
        models.clear()  # loaded: accelerate reads no model file

    def wait(self) -> None:
        """Block until the weights saved so far are durable; raise the first failure."""
        pending, self._pending = self._pending, []
        failures = [exc for f in pending if (exc := f.exception()) is not None]
        for exc in failures[1:]:
            log.error("fastpersist save failed: %s", exc)
        if failures:
            raise failures[0]

    def remove(self) -> None:
        """Wait for pending saves and unregister the hooks."""
        try:
            self.wait()
        finally:
            for handle in self._handles:
                handle.remove()


def register(accelerator: Any, *, async_save: bool = False,
             daemon: str | None = None) -> FastPersistStateHooks:
    """Make accelerator.save_state/load_state write and read the model weights
    with fastpersist (see the module docstring)."""
    return FastPersistStateHooks(accelerator, async_save=async_save, daemon=daemon)


__all__ = ["FastPersistStateHooks", "model_dir", "register"]
