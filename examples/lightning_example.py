"""Lightning with fastpersist checkpoints: train, resume, check bit-exactness.

Trains a small regression model with lightning.pytorch for 4 epochs, saving
the two best checkpoints and last.ckpt asynchronously through fastpersist
(each is a checkpoint directory), then trains the same model again for 2
epochs, resumes it from its last checkpoint for the other 2, and checks that
the weights and optimizer state equal the uninterrupted run's bit for bit.
CPU, a few seconds.

    pip install lightning==2.6.6        # the version this was tested with
    python examples/lightning_example.py [--dir lightning-ckpts]
"""

from __future__ import annotations

import argparse
import logging
import shutil
import tempfile
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

import fastpersist
from fastpersist.integrations.lightning import FastPersistCheckpointIO


class Regressor(pl.LightningModule):
    def __init__(self, hidden: int = 32, lr: float = 1e-2) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, hidden), torch.nn.GELU(),
                                       torch.nn.Linear(hidden, 1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss, on_step=False, on_epoch=True)
        return loss

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, 1, 0.8)}


def data() -> DataLoader[Any]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 8, generator=g)
    return DataLoader(TensorDataset(x, x.sum(1, keepdim=True).sin()), batch_size=32)


def fit(epochs: int, ckpts: Path, ckpt_path: Path | None = None, seed: int = 0) -> pl.Trainer:
    torch.manual_seed(seed)
    model = Regressor()
    trainer = pl.Trainer(
        max_epochs=epochs, accelerator="cpu", deterministic=True, logger=False,
        enable_progress_bar=False, enable_model_summary=False,
        plugins=[FastPersistCheckpointIO(async_save=True)],
        callbacks=[ModelCheckpoint(dirpath=ckpts, save_top_k=2, monitor="train_loss",
                                   save_last=True)])
    trainer.fit(model, data(), ckpt_path=ckpt_path)
    return trainer


def state(trainer: pl.Trainer) -> dict[str, Any]:
    assert trainer.lightning_module is not None
    return {"model": trainer.lightning_module.state_dict(),
            "optimizer": trainer.optimizers[0].state_dict()["state"]}


def same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return bool(torch.equal(a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    return bool(a == b)


def main() -> None:
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", ".*(LeafSpec|exists and is not empty|num_workers).*")
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dir", type=Path, help="checkpoints here (default: a temp dir)")
    args = parser.parse_args()
    root = args.dir or Path(tempfile.mkdtemp(prefix="fp-lightning-"))
    try:
        uninterrupted = fit(4, root / "uninterrupted")
        print("checkpoints:", sorted(p.name for p in (root / "uninterrupted").iterdir()))
        last = fastpersist.load(root / "uninterrupted" / "last.ckpt")
        print(f"last.ckpt: epoch {last['epoch']}, global step {last['global_step']}, "
              f"keys {sorted(last)}")

        fit(2, root / "interrupted")
        resumed = fit(4, root / "interrupted", ckpt_path=root / "interrupted" / "last.ckpt",
                      seed=1)
        assert same(state(resumed), state(uninterrupted)), "the resumed run differs"
        print("resumed from last.ckpt after epoch 2: weights and optimizer state after "
              "epoch 4 equal the uninterrupted run's bit for bit")
    finally:
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
