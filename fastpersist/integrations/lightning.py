"""Lightning (`lightning.pytorch`) checkpoints through fastpersist.

    from fastpersist.integrations.lightning import FastPersistCheckpointIO

    trainer = lightning.pytorch.Trainer(
        plugins=[FastPersistCheckpointIO(async_save=True)],
        callbacks=[ModelCheckpoint(dirpath="ckpts", save_top_k=2, monitor="val_loss")])
    trainer.fit(model, datamodule)                       # checkpoints: ckpts/*.ckpt/ directories
    trainer.fit(model, datamodule, ckpt_path="ckpts/last.ckpt")   # resume

Each checkpoint is a fastpersist checkpoint directory (named as Lightning
names the file, `.ckpt` included) that `fastpersist.load` and `fpctl` open.
`LightningModule.load_from_checkpoint` reads torch.save files only: load the
dict with `FastPersistCheckpointIO().load_checkpoint(path)` and call
`model.load_state_dict(ckpt["state_dict"])`, or write a torch file with
`fpctl restore CKPT --to model.ckpt --format torch`. See
FastPersistCheckpointIOBase for the options and the pickle policy.
For the `pytorch_lightning` package, use fastpersist.integrations.pytorch_lightning.
"""

from __future__ import annotations

from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
from lightning.fabric.utilities.data import AttributeDict

from ._lightning_io import FastPersistCheckpointIOBase


class FastPersistCheckpointIO(FastPersistCheckpointIOBase, CheckpointIO):
    __doc__ = FastPersistCheckpointIOBase.__doc__
    _safe_dicts = (AttributeDict,)


__all__ = ["FastPersistCheckpointIO"]
