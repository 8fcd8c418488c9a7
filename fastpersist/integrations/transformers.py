"""Hugging Face `transformers.Trainer` checkpoints through fastpersist.

    from fastpersist.integrations.transformers import FastPersistTrainer

    trainer = FastPersistTrainer(model=model, args=args, train_dataset=ds)  # was: Trainer(...)
    trainer.train()                                   # checkpoint-N/ saved through fastpersist
    trainer.train(resume_from_checkpoint=True)        # or a checkpoint-N path: resumes exactly

A Trainer subclass of your own (SFTTrainer, ...) takes the mixin instead:
`class MyTrainer(FastPersistTrainerMixin, SFTTrainer)`. Keyword arguments:
fastpersist_async (default True), fastpersist_daemon (as `daemon` in
fastpersist.save).

What changes. Trainer._save_checkpoint writes checkpoint-N/ as usual, except
for the bulk of it, which is written by fastpersist:

    checkpoint-N/
      fastpersist-model/       the model's state_dict, a fastpersist checkpoint (the
                               data files are safetensors files of the model's
                               parameter names: model.safetensors shards)
      fastpersist-trainer/     {"optimizer", "scheduler", "scaler"?}, a fastpersist checkpoint
      model.safetensors.index.json   weight_map -> fastpersist-model/data-*.safetensors,
                               written once the weights are durable
      config.json, generation_config.json, training_args.bin, trainer_state.json,
      rng_state.pth, tokenizer files        HF's own files, written by HF as before

instead of model.safetensors, optimizer.pt, scheduler.pt and scaler.pt
(optimizer.pt and scheduler.pt are left as refusals of a few hundred bytes,
write_refusals: a plain Trainer resuming the checkpoint would otherwise find
no optimizer.pt and silently start the optimizer afresh; torch.load of them
raises an error that says to resume with FastPersistTrainer). Each
fastpersist directory appears atomically once durable. With fastpersist_async
(default), both are snapshotted when the Trainer checkpoints and written while
training goes on (they persist together: neither waits for the other); the next
checkpoint, _load_best_model and the end of train() wait for them and raise a
failure. Resuming (`resume_from_checkpoint`) loads the weights, optimizer,
scheduler and scaler from them (every tensor's CRC32C checked), the rest as HF
does; a checkpoint-N/ without them (written by a plain Trainer) is loaded by HF's
own code, so runs can switch either way.

Model weights stay usable by other tools: `from_pretrained("…/checkpoint-N")`,
HF's load_sharded_checkpoint and safetensors read them through
model.safetensors.index.json (the weights are stored under the model's own
state_dict names, as Trainer resumes them: for the few architectures whose
save_pretrained renames keys on the way out, use `fpctl restore
checkpoint-N/fastpersist-model --to model.safetensors --format safetensors`
to get one file, or trainer.save_model(), which is HF's own format).

Why this design: it overrides the Trainer methods that write and read the
model, optimizer, scheduler and scaler files (save_model when called for a
checkpoint, _save_optimizer_and_scheduler, _save_scaler and their _load_
counterparts), and leaves the orchestration (_save_checkpoint's bookkeeping,
trainer_state.json, best-model tracking, data skipping on resume) to the
Trainer. HF's rotation of old checkpoints (save_total_limit, and its
deletion of all but the best at the end) runs only once the newer
checkpoint's fastpersist saves are committed (a crash in between would leave
none to resume), and resume_from_checkpoint=True takes the newest complete
checkpoint-N/ (hf_files.last_checkpoint). A TrainerCallback cannot do it: on_save
runs after HF has written everything, and nothing can stop the torch.save
files. The RNG state stays HF's rng_state.pth (torch.save, a few KiB), so
that HF's own resume code and other tools keep reading it; fastpersist could
store it without pickle (numpy values are tensors), but HF reads it with
torch.load. DeepSpeed, FSDP, XLA, SageMaker MP
and PEFT adapters keep HF's own checkpoint code (sharded or tiny states).
In a DDP job only the saving process (args.should_save) writes, as in HF.
Through fastpersistd (fastpersist_daemon or FASTPERSIST_DAEMON), the daemon
writes the two fastpersist directories, and the trainer still writes HF's own
files into checkpoint-N/ (and HF rotates old checkpoints): the output_dir must
lie under the daemon's --root and be writable by the trainer as well.
"""

from __future__ import annotations

import copy
import logging
import os
from typing import TYPE_CHECKING, Any

import torch
from transformers import PreTrainedModel, Trainer
from transformers.trainer_utils import rotate_checkpoints
from transformers.utils.import_utils import is_sagemaker_mp_enabled, is_torch_xla_available

import fastpersist

from .hf_files import MODEL_DIR, TRAINER_DIR, last_checkpoint, write_index, write_refusals

if TYPE_CHECKING:
    from fastpersist import SaveFuture

log = logging.getLogger(__name__)

TRAINING_ARGS_NAME = "training_args.bin"  # transformers.trainer.TRAINING_ARGS_NAME


def _new_saver(daemon: str | None) -> Any:
    """A saver of our own, on which a checkpoint's two saves persist together
    (max_in_flight=2) and reuse their staging memory: what Checkpointer does."""
    from ..adapters import pipeline_for

    return pipeline_for(daemon, max_in_flight=2, shared=False)


class FastPersistTrainerMixin:
    """Put before transformers.Trainer (or a subclass of it) in the bases; see
    the module docstring."""

    def __init__(self, *args: Any, fastpersist_async: bool = True,
                 fastpersist_daemon: str | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.fastpersist_async = fastpersist_async
        self.fastpersist_daemon = fastpersist_daemon
        self._fp_saver: Any = None
        self._fp_pending: list[SaveFuture] = []
        self._fp_errors: list[BaseException] = []
        self._fp_staged: dict[str, Any] | None = None  # inside _save_checkpoint
        self._fp_loaded: tuple[str, dict[str, Any]] | None = None
        self._fp_rotate_in: str | None = None  # a run_dir to rotate once committed

    # -- which runs fastpersist takes --------------------------------------

    def _fp_applies(self) -> bool:
        t: Any = self
        if (t.is_deepspeed_enabled or t.is_fsdp_enabled or is_torch_xla_available()
                or is_sagemaker_mp_enabled()):
            return False
        unwrapped = t.accelerator.unwrap_model(t.model, keep_torch_compile=False)
        return not hasattr(unwrapped, "peft_config")  # adapters: HF's own (small) files

    # -- saving ------------------------------------------------------------

    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        if not self._fp_applies():
            super()._save_checkpoint(model, trial)  # type: ignore[misc]
            return
        # Old checkpoints are rotated out only once the newer ones are committed:
        # until then they are what a crash leaves to resume from.
        self.wait_for_checkpoints()
        self._fp_rotate()
        args: Any = getattr(self, "args")  # noqa: B009
        limit, args.save_total_limit = args.save_total_limit, None  # HF's rotation: _fp_rotate
        self._fp_staged = {"save_total_limit": limit}
        try:
            super()._save_checkpoint(model, trial)  # type: ignore[misc]
            staged = self._fp_staged
        finally:
            args.save_total_limit = limit
            self._fp_staged = None
        if "dir" in staged:
            self._fp_save(staged)
            self._fp_rotate_in = os.path.dirname(staged["dir"])
            if not self.fastpersist_async:
                self._fp_rotate()

    def _fp_rotate(self) -> None:
        """HF's rotation of old checkpoints (save_total_limit), deferred from
        _save_checkpoint until the checkpoint it saved is committed."""
        run_dir, self._fp_rotate_in = self._fp_rotate_in, None
        t: Any = self
        if run_dir is not None and t.args.should_save:
            rotate_checkpoints(output_dir=run_dir, save_total_limit=t.args.save_total_limit,
                               best_model_checkpoint=t.state.best_model_checkpoint,
                               use_mtime=True)

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        if self._fp_staged is None or not _internal_call:
            super().save_model(output_dir, _internal_call)  # type: ignore[misc]
            return
        t: Any = self
        output_dir = output_dir if output_dir is not None else t.args.output_dir
        if not t.args.should_save:
            return
        os.makedirs(output_dir, exist_ok=True)
        self._fp_staged["dir"] = output_dir
        self._fp_staged["model"] = t.model.state_dict()
        # What save_pretrained writes besides the weights (as Trainer._save).
        unwrapped = t.accelerator.unwrap_model(t.model, keep_torch_compile=False)
        if isinstance(unwrapped, PreTrainedModel):
            unwrapped.config.dtype = str(unwrapped.dtype).split(".")[1]
            unwrapped.config.architectures = [type(unwrapped).__name__]
            unwrapped.config.save_pretrained(output_dir)
            if unwrapped.can_generate() and unwrapped.generation_config is not None:
                unwrapped.generation_config.save_pretrained(output_dir)
        if t.processing_class is not None:
            t.processing_class.save_pretrained(output_dir)
        elif getattr(t.data_collator, "tokenizer", None) is not None:
            t.data_collator.tokenizer.save_pretrained(output_dir)
        args = copy.copy(t.args)  # as the user set them (_save_checkpoint unset the limit)
        args.save_total_limit = self._fp_staged["save_total_limit"]
        torch.save(args, os.path.join(output_dir, TRAINING_ARGS_NAME))

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        if self._fp_staged is None:
            super()._save_optimizer_and_scheduler(output_dir)  # type: ignore[misc]
            return
        t: Any = self
        if t.args.should_save:
            self._fp_staged["optimizer"] = t.optimizer.state_dict()
            self._fp_staged["scheduler"] = t.lr_scheduler.state_dict()
            write_refusals(output_dir)

    def _save_scaler(self, output_dir: str) -> None:
        if self._fp_staged is None:
            super()._save_scaler(output_dir)  # type: ignore[misc]
            return
        scaler = getattr(getattr(self, "accelerator", None), "scaler", None)
        if scaler is not None and getattr(self, "args").should_save:  # noqa: B009
            self._fp_staged["scaler"] = scaler.state_dict()

    def _fp_save(self, staged: dict[str, Any]) -> None:
        directory = staged["dir"]
        trainer_state = {k: staged[k] for k in ("optimizer", "scheduler", "scaler") if k in staged}
        saves = [(os.path.join(directory, MODEL_DIR), staged["model"], True)]
        if trainer_state:
            saves.append((os.path.join(directory, TRAINER_DIR), trainer_state, False))
        for path, state, is_model in saves:
            if not self.fastpersist_async:
                fastpersist.save(state, path, daemon=self.fastpersist_daemon)
                if is_model:
                    write_index(directory)
                continue
            if self._fp_saver is None:
                self._fp_saver = _new_saver(self.fastpersist_daemon) or False
            if self._fp_saver:
                future = self._fp_saver.save(state, path)
            else:
                future = fastpersist.async_save(state, path, daemon=self.fastpersist_daemon)
            if is_model:
                future.add_done_callback(lambda f, d=directory: self._fp_committed(f, d))
            self._fp_pending.append(future)

    def _fp_committed(self, future: SaveFuture, directory: str) -> None:
        """Runs when the model's save finishes (on fastpersist's writer thread)."""
        if future.exception() is not None:
            return  # raised by wait_for_checkpoints
        try:
            write_index(directory)
        except BaseException as exc:
            self._fp_errors.append(exc)

    def wait_for_checkpoints(self) -> None:
        """Block until every checkpoint so far is durable; raise the first failure."""
        pending, self._fp_pending = self._fp_pending, []
        failures = [exc for f in pending if (exc := f.exception()) is not None]
        errors, self._fp_errors = self._fp_errors, []
        failures += errors
        for exc in failures[1:]:
            log.error("fastpersist checkpoint failed: %s", exc)
        if failures:
            raise failures[0]

    def train(self, *args: Any, **kwargs: Any) -> Any:
        resume = args[0] if args else kwargs.get("resume_from_checkpoint")
        if resume is True and self._fp_applies():
            # HF's get_last_checkpoint takes the newest checkpoint-N/ by name, also
            # one whose fastpersist saves a crash cut short: the newest complete one.
            found = last_checkpoint(getattr(self, "args").output_dir)  # noqa: B009
            if found is not None:
                kwargs.pop("resume_from_checkpoint", None)
                args = (found, *args[1:])
        try:
            result = super().train(*args, **kwargs)  # type: ignore[misc]
        except BaseException:
            try:
                self._fp_finish()
            except BaseException as exc:
                log.error("fastpersist checkpoint failed: %s", exc)
            raise
        self._fp_finish()
        return result

    def _finalize_training(self, *args: Any, **kwargs: Any) -> Any:
        # With save_total_limit=1 HF deletes every checkpoint but the best one
        # here: the newest must be committed first, and rotated as HF would have.
        self.wait_for_checkpoints()
        self._fp_rotate()
        return super()._finalize_training(*args, **kwargs)  # type: ignore[misc]

    def _fp_finish(self) -> None:
        """At the end of train(): wait for the checkpoints, free the staging memory."""
        saver, self._fp_saver = self._fp_saver, None
        try:
            self.wait_for_checkpoints()
            self._fp_rotate()
        finally:
            if saver:
                saver.close()

    # -- loading -----------------------------------------------------------

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        weights = os.path.join(resume_from_checkpoint, MODEL_DIR)
        if not os.path.isdir(weights) or not self._fp_applies():
            super()._load_from_checkpoint(resume_from_checkpoint, model)  # type: ignore[misc]
            return
        t: Any = self
        model = t.model if model is None else model
        state_dict = fastpersist.load(weights, map_location="cpu")
        result = model.load_state_dict(state_dict, False)
        del state_dict
        t._issue_warnings_after_load(result)

    def _fp_trainer_state(self, checkpoint: str) -> dict[str, Any] | None:
        """fastpersist-trainer's state (None: not there, HF's files then), read once
        for _load_optimizer_and_scheduler and _load_scaler, which follow each other."""
        path = os.path.join(checkpoint, TRAINER_DIR)
        if not os.path.isdir(path) or not self._fp_applies():
            return None
        if self._fp_loaded is not None and self._fp_loaded[0] == path:
            return self._fp_loaded[1]
        device = getattr(self, "args").device  # noqa: B009
        distributed = getattr(self, "args").world_size > 1  # noqa: B009
        location = device if distributed and device.type != "cpu" else "cpu"
        state: dict[str, Any] = fastpersist.load(path, map_location=location)
        self._fp_loaded = (path, state)
        return state

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        state = None if checkpoint is None else self._fp_trainer_state(checkpoint)
        if state is None:
            super()._load_optimizer_and_scheduler(checkpoint)  # type: ignore[misc]
            return
        t: Any = self
        t.optimizer.load_state_dict(state["optimizer"])
        t.lr_scheduler.load_state_dict(state["scheduler"])

    def _load_scaler(self, checkpoint: str | None) -> None:
        state = None if checkpoint is None else self._fp_trainer_state(checkpoint)
        if state is None:
            super()._load_scaler(checkpoint)  # type: ignore[misc]
            return
        self._fp_loaded = None
        scaler = getattr(getattr(self, "accelerator", None), "scaler", None)
        if scaler is not None and "scaler" in state:
            scaler.load_state_dict(state["scaler"])

    def _load_best_model(self) -> None:
        self.wait_for_checkpoints()  # it reads the best checkpoint's weights (via the index)
        super()._load_best_model()  # type: ignore[misc]


class FastPersistTrainer(FastPersistTrainerMixin, Trainer):
    """transformers.Trainer whose checkpoints go through fastpersist; see the module
    docstring."""


__all__ = ["FastPersistTrainer", "FastPersistTrainerMixin", "write_index", "write_refusals"]
