"""Hugging Face accelerate: Accelerator.save_state/load_state with the model
weights, the optimizers' and the schedulers' state through fastpersist.

    from fastpersist.integrations.accelerate import register

    accelerator = Accelerator()
    hooks = register(accelerator, async_save=True)  # before save_state/load_state
    ...
    accelerator.save_state("ckpt/step-1000")   # ckpt/step-1000/fastpersist-model/, ...
    accelerator.load_state("ckpt/step-1000")   # read back from there (CRC32C checked)
    hooks.wait()                               # at the end: the last save is durable

What goes where in the checkpoint directory:

    fastpersist-model/, fastpersist-model_1/, ...  each model's state dict (as
        accelerate numbers model.safetensors, model_1.safetensors); the data
        files are safetensors files of the state dict's names (for a prepared
        DDP model, accelerate's own names, `module.`-prefixed)
    fastpersist-optimizer/   {"optimizers": [...], "schedulers": [...]}: every
        prepared optimizer's and scheduler's state_dict, in accelerate's order
    scaler.pt, random_states_N.pkl, sampler.bin, custom_checkpoint_N.pkl
        accelerate's own (torch.save: a few KiB)

instead of model.safetensors, optimizer.bin and scheduler.bin. A directory
without fastpersist-model/ or fastpersist-optimizer/ (written without these
hooks) is loaded by accelerate as usual, and a directory saved with them is
loaded only with them (accelerate alone finds no optimizer.bin and raises).

How. accelerate's documented save/load pre-hooks are handed the models (and
their state dicts); the save hook saves each with fastpersist and empties the
list, so accelerate writes no model file, and the load hook loads them and
empties the list of models to load. The optimizers and schedulers are not
handed to any hook: save_state and load_state take them from the accelerator's
own lists (`_optimizers`, `_schedulers`). So register() also wraps the
instance's save_state and load_state: around accelerate's own, the hooks save
(or load) those states through fastpersist and empty the two lists in place,
so accelerate writes (or reads) no optimizer or scheduler file; the wrapper
puts them back when save_state/load_state returns or raises. Under FSDP,
DeepSpeed or Megatron accelerate saves the models and optimizers itself and
the hooks do nothing.

async_save=True: save_state returns once the states are snapshotted; the next
save_state or load_state (and wait()) waits for them and raises a failure.
With ProjectConfiguration(automatic_checkpoint_naming=True, total_limit=K),
the oldest checkpoint_N folders are deleted once the new one is committed
(accelerate itself deletes them before saving): up to K+1 folders exist while
a save is in flight, so that a crash always leaves a complete one.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

import fastpersist

if TYPE_CHECKING:
    from fastpersist import SaveFuture

log = logging.getLogger(__name__)


OPTIMIZER_DIR = "fastpersist-optimizer"
_STEP = re.compile(r"([0-9]+)(?=[^/]*$)")  # accelerate's order of checkpoint_N folders


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
        self._held: tuple[list[Any], list[Any]] | None = None  # inside save/load_state
        self._handles = [accelerator.register_save_state_pre_hook(self._save),
                         accelerator.register_load_state_pre_hook(self._load)]
        self._originals = (accelerator.save_state, accelerator.load_state)
        self._rotate_in: tuple[Path, int] | None = None  # checkpoints to rotate once committed
        accelerator.save_state = self._wrap(self._rotating(self._originals[0]))
        accelerator.load_state = self._wrap(self._originals[1])

    def _wrap(self, original: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            acc = self.accelerator
            if _own_optimizers(acc):
                return original(*args, **kwargs)
            lists = (acc._optimizers, acc._schedulers)
            self._held = (list(lists[0]), list(lists[1]))
            try:
                return original(*args, **kwargs)
            finally:
                held, self._held = self._held, None
                for live, kept in zip(lists, held, strict=True):
                    live[:] = kept

        call.__wrapped__ = original  # type: ignore[attr-defined]
        return call

    def _rotating(self, save_state: Any) -> Any:
        """save_state with ProjectConfiguration(total_limit) honoured once the
        new checkpoint is committed: accelerate deletes the oldest folders
        before it saves, so a crash while fastpersist writes the new one
        (asynchronously, maybe) would leave none that loads."""
        def call(*args: Any, **kwargs: Any) -> Any:
            config = self.accelerator.project_configuration
            limit = config.total_limit if config.automatic_checkpoint_naming else None
            if limit is None:
                return save_state(*args, **kwargs)
            self.wait()  # the previous checkpoint is committed: its elders may go
            config.total_limit = None
            try:
                result = save_state(*args, **kwargs)
            finally:
                config.total_limit = limit
            self._rotate_in = (Path(self.accelerator.project_dir) / "checkpoints", limit)
            if not self.async_save:
                self._rotate()
            return result

        return call

    def _rotate(self) -> None:
        """Delete the oldest checkpoint_N folders beyond total_limit, as
        accelerate's save_state would have (the same order)."""
        pending, self._rotate_in = self._rotate_in, None
        if pending is None or not self.accelerator.is_main_process:
            return
        root, limit = pending
        folders = sorted((p for p in root.iterdir() if _STEP.search(p.name)
                          and not p.name.startswith(".")),
                         key=lambda p: int(_STEP.findall(p.name)[0]))
        for folder in folders[:max(0, len(folders) - limit)]:
            shutil.rmtree(folder)

    def _writes(self) -> bool:
        acc = self.accelerator
        if acc.project_configuration.save_on_each_node:
            return bool(acc.is_local_main_process)
        return bool(acc.is_main_process)

    def _save(self, models: list[Any], weights: list[dict[str, Any]],
              output_dir: str | os.PathLike[str]) -> None:
        self.wait()
        saves = [(Path(output_dir) / model_dir(i), state) for i, state in enumerate(weights)]
        if self._held is not None:
            optimizers, schedulers = self._held
            saves.append((Path(output_dir) / OPTIMIZER_DIR, {
                "optimizers": [o.state_dict() for o in optimizers],
                "schedulers": [s.state_dict() for s in schedulers]}))
        if self._writes():
            for path, state in saves:
                if self.async_save:
                    self._pending.append(fastpersist.async_save(state, path,
                                                                daemon=self.daemon))
                else:
                    fastpersist.save(state, path, daemon=self.daemon)
        weights.clear()  # saved: accelerate writes no model file
        self._empty_lists()  # nor optimizer or scheduler files

    def _load(self, models: list[Any], input_dir: str | os.PathLike[str]) -> None:
        self.wait()
        self._load_optimizers(Path(input_dir))
        dirs = [Path(input_dir) / model_dir(i) for i in range(len(models))]
        if not models or not all(d.is_dir() for d in dirs):
            return  # not saved through these hooks: accelerate loads its own files
        for model, d in zip(models, dirs, strict=True):
            model.load_state_dict(fastpersist.load(d, map_location="cpu"))
        models.clear()  # loaded: accelerate reads no model file

    def _load_optimizers(self, input_dir: Path) -> None:
        path = input_dir / OPTIMIZER_DIR
        if self._held is None or not path.is_dir():
            return  # accelerate loads its own optimizer.bin and scheduler.bin
        state = fastpersist.load(path, map_location="cpu")
        for kind, objects in zip(("optimizers", "schedulers"), self._held, strict=True):
            if len(state[kind]) != len(objects):
                raise fastpersist.CheckpointError(
                    f"{path} holds the state of {len(state[kind])} {kind}, but this "
                    f"Accelerator has prepared {len(objects)}: prepare the same {kind} as "
                    "when the state was saved")
        for obj, saved in zip(self._held[0] + self._held[1],
                              state["optimizers"] + state["schedulers"], strict=True):
            obj.load_state_dict(saved)
        self._empty_lists()

    def _empty_lists(self) -> None:
        """Empty the accelerator's own lists in place (the ones save_state and
        load_state hand to accelerate's writer and reader); _wrap restores them."""
        if self._held is not None:
            self.accelerator._optimizers.clear()
            self.accelerator._schedulers.clear()

    def wait(self) -> None:
        """Block until the weights saved so far are durable; raise the first failure."""
        pending, self._pending = self._pending, []
        failures = [exc for f in pending if (exc := f.exception()) is not None]
        for exc in failures[1:]:
            log.error("fastpersist save failed: %s", exc)
        if failures:
            self._rotate_in = None  # the newest did not commit: the older ones stay
            raise failures[0]
        self._rotate()

    def remove(self) -> None:
        """Wait for pending saves and unregister the hooks."""
        try:
            self.wait()
        finally:
            for handle in self._handles:
                handle.remove()
            for name in ("save_state", "load_state"):  # the class's methods again
                self.accelerator.__dict__.pop(name, None)


def _own_optimizers(accelerator: Any) -> bool:
    """Whether accelerate saves the optimizers itself (FSDP, DeepSpeed, Megatron)."""
    kind = str(getattr(accelerator.distributed_type, "value", accelerator.distributed_type))
    return kind in ("FSDP", "DEEPSPEED", "MEGATRON_LM")


def register(accelerator: Any, *, async_save: bool = False,
             daemon: str | None = None) -> FastPersistStateHooks:
    """Make accelerator.save_state/load_state write and read the model weights
    and the optimizers' and schedulers' state with fastpersist (see the module
    docstring)."""
    return FastPersistStateHooks(accelerator, async_save=async_save, daemon=daemon)


__all__ = ["OPTIMIZER_DIR", "FastPersistStateHooks", "model_dir", "register"]
