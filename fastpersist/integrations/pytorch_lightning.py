"""Lightning (the `pytorch_lightning` package) checkpoints through fastpersist.

    from fastpersist.integrations.pytorch_lightning import FastPersistCheckpointIO

    trainer = pytorch_lightning.Trainer(
        plugins=[FastPersistCheckpointIO(async_save=True)],
        callbacks=[ModelCheckpoint(dirpath="ckpts", save_top_k=2, monitor="val_loss")])
    trainer.fit(model, datamodule)                       # checkpoints: ckpts/*.ckpt/ directories
    trainer.fit(model, datamodule, ckpt_path="ckpts/last.ckpt")   # resume

Each checkpoint is a fastpersist checkpoint directory (named as Lightning
names the file, `.ckpt` included) that `fastpersist.load` and `fpctl` open.
`LightningModule.load_from_checkpoint(path)` reads them, unchanged, once
`enable_load_from_checkpoint()` has run in the process (it wraps the loader
that pytorch_lightning.core.saving uses, for fastpersist checkpoint directories only;
anything else still goes to Lightning's own). See
FastPersistCheckpointIOBase for the options and the pickle policy.
For the `lightning` package, use fastpersist.integrations.lightning.
"""

from __future__ import annotations

from lightning_fabric.plugins.io.checkpoint_io import CheckpointIO
from lightning_fabric.utilities.data import AttributeDict

from ._lightning_io import FastPersistCheckpointIOBase, install_loader


class FastPersistCheckpointIO(FastPersistCheckpointIOBase, CheckpointIO):
    __doc__ = FastPersistCheckpointIOBase.__doc__
    _safe_dicts = (AttributeDict,)


def enable_load_from_checkpoint() -> None:
    """Let `LightningModule.load_from_checkpoint(path)` (and the
    LightningDataModule's) open a fastpersist checkpoint directory, with the
    same call; torch.save files and URLs still load as before. Once per
    process; calling it again does nothing."""
    from pytorch_lightning.core import saving

    install_loader(saving, FastPersistCheckpointIO)


__all__ = ["FastPersistCheckpointIO", "enable_load_from_checkpoint"]
