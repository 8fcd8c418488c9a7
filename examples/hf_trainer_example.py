"""transformers.Trainer with fastpersist checkpoints: train, resume, check bit-exactness.

Trains a tiny randomly initialised Llama (no download) on random tokens with
FastPersistTrainer, which is transformers.Trainer with checkpoint-N/ written
through fastpersist (asynchronously), stops it after step 6, resumes it with
resume_from_checkpoint=True and checks that the weights and optimizer state
after step 12 equal those of a run that never stopped, bit for bit. Then
loads checkpoint-12 with from_pretrained. CPU, a few seconds.

    pip install transformers==5.24.0 accelerate==1.15.0   # the tested versions
    python examples/hf_trainer_example.py [--dir hf-ckpts]

The lines that differ from a plain Trainer script are marked "fastpersist".
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)
from transformers.utils import logging as hf_logging

from fastpersist.integrations.transformers import FastPersistTrainer  # fastpersist

CONFIG = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
                     max_position_embeddings=64)


class RandomTokens(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    def __init__(self, n: int = 64, length: int = 32) -> None:
        self.ids = torch.randint(0, CONFIG.vocab_size, (n, length),
                                 generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class StopAfter(TrainerCallback):
    """Stops training after a step: stands in for a preempted job."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.global_step == self.step:
            control.should_training_stop = True


def train(out: Path, *, trainer_class: type[Trainer] = FastPersistTrainer, seed: int = 0,
          stop: int | None = None, resume: bool = False, save: bool = True) -> Trainer:
    torch.manual_seed(seed)
    args = TrainingArguments(output_dir=str(out), max_steps=12, save_steps=3,
                             save_strategy="steps" if save else "no",
                             save_total_limit=2, per_device_train_batch_size=8,
                             learning_rate=1e-3, warmup_steps=2, logging_steps=100,
                             report_to=[], use_cpu=True, seed=0, disable_tqdm=True)
    trainer = trainer_class(model=LlamaForCausalLM(CONFIG), args=args,
                            train_dataset=RandomTokens(),
                            callbacks=[StopAfter(stop)] if stop else None)
    trainer.train(resume_from_checkpoint=resume or None)
    return trainer


def same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return bool(torch.equal(a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    return bool(a == b)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dir", type=Path, help="checkpoints here (default: a temp dir)")
    args = parser.parse_args()
    hf_logging.set_verbosity_error()
    root = args.dir or Path(tempfile.mkdtemp(prefix="fp-hf-"))
    try:
        uninterrupted = train(root / "uninterrupted", trainer_class=Trainer, save=False)

        train(root / "run", stop=6)
        ckpt = root / "run" / "checkpoint-6"
        print(f"{ckpt.name}:", " ".join(sorted(os.listdir(ckpt))))
        resumed = train(root / "run", seed=1, resume=True)
        for part in ("model", "optimizer"):
            a = getattr(resumed, part).state_dict()
            b = getattr(uninterrupted, part).state_dict()
            assert same(a, b), f"the resumed run's {part} differs"
        print("resumed at step 6: weights and optimizer state after step 12 equal the "
              "uninterrupted run's bit for bit")

        reloaded = LlamaForCausalLM.from_pretrained(root / "run" / "checkpoint-12")
        assert same(reloaded.state_dict(), resumed.model.state_dict())
        print("LlamaForCausalLM.from_pretrained(checkpoint-12) reads the fastpersist weights")
    finally:
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
