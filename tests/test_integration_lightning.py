"""fastpersist.integrations.lightning: real Lightning Trainers on a tiny model, CPU.

Checkpoints are fastpersist checkpoint directories, save_top_k removes the
others atomically, a resumed fit ends bit-exactly where an uninterrupted one
does (weights, optimizer and scheduler), asynchronous saves hold the state of
the moment they were taken and report background failures, and values that
would need pickle are refused by name unless allow_pickle=True.
"""

from __future__ import annotations

import argparse
import os
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

pl = pytest.importorskip("lightning.pytorch")

from lightning.fabric.utilities.data import AttributeDict  # noqa: E402
from lightning.pytorch.callbacks import Callback, ModelCheckpoint  # noqa: E402
from support import inject_enospc  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

import fastpersist  # noqa: E402
from fastpersist import CheckpointError, UnsupportedValueError  # noqa: E402
from fastpersist.integrations.lightning import FastPersistCheckpointIO  # noqa: E402


class Tiny(pl.LightningModule):
    def __init__(self, lr: float = 0.05, extra: Any = None) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(),
                                       torch.nn.Linear(8, 1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        # The newest epoch is always the best: top-k is deterministic.
        self.log("score", float(self.current_epoch), on_epoch=True, on_step=False)
        return loss

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, 1, 0.9)}


def data() -> DataLoader[Any]:
    g = torch.Generator().manual_seed(0)
    ds = TensorDataset(torch.randn(24, 6, generator=g), torch.randn(24, 1, generator=g))
    return DataLoader(ds, batch_size=6, shuffle=False)


def trainer(epochs: int, io: Any = None, callbacks: list[Any] | None = None,
            root: Path | None = None) -> Any:
    return pl.Trainer(max_epochs=epochs, accelerator="cpu", devices=1, deterministic=True,
                      plugins=[io] if io is not None else None, callbacks=callbacks or [],
                      enable_checkpointing=bool(callbacks), logger=False,
                      enable_progress_bar=False, enable_model_summary=False,
                      default_root_dir=str(root) if root else None)


def model(seed: int = 0, **kwargs: Any) -> Tiny:
    torch.manual_seed(seed)
    return Tiny(**kwargs)


@pytest.fixture(autouse=True)
def _quiet() -> Any:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", ".*(num_workers|exists and is not empty|LeafSpec).*")
        yield


def names(d: Path) -> list[str]:
    return sorted(os.listdir(d))  # hidden names too: no leftovers may remain


def final_state(t: Any, m: Tiny) -> dict[str, Any]:
    return {"model": m.state_dict(), "optimizer": t.optimizers[0].state_dict(),
            "scheduler": t.lr_scheduler_configs[0].scheduler.state_dict()}


def assert_bit_equal(a: Any, b: Any, where: str = "") -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape, where
        bits = [t.detach().reshape(-1).contiguous().view(torch.uint8) for t in (a, b)]
        assert torch.equal(*bits), where
    elif isinstance(a, dict):
        assert list(a) == list(b), where
        for k in a:
            assert_bit_equal(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_bit_equal(x, y, f"{where}.{i}")
    else:
        assert a == b, where


def test_top_k_checkpoints_are_fastpersist_directories(tmp_path: Path) -> None:
    ckpts = tmp_path / "ckpts"
    cb = ModelCheckpoint(dirpath=ckpts, save_top_k=2, monitor="score", mode="max",
                         save_last=True)
    t = trainer(4, FastPersistCheckpointIO(), [cb])
    t.fit(model(), data())
    # Epochs 0 and 1 were saved, then removed (renamed aside first: nothing left).
    assert names(ckpts) == ["epoch=2-step=12.ckpt", "epoch=3-step=16.ckpt", "last.ckpt"]
    assert set(cb.best_k_models) == {str(ckpts / "epoch=2-step=12.ckpt"),
                                     str(ckpts / "epoch=3-step=16.ckpt")}
    for name in names(ckpts):
        assert (ckpts / name).is_dir() and (ckpts / name / "manifest.json").is_file()
        loaded = fastpersist.load(ckpts / name)
        assert loaded["hyper_parameters"] == {"lr": 0.05, "extra": None}
        assert set(loaded) >= {"state_dict", "optimizer_states", "lr_schedulers", "loops",
                               "callbacks", "epoch", "global_step"}
    last = fastpersist.load(ckpts / "last.ckpt")
    assert last["epoch"] == 3 and last["global_step"] == 16
    assert_bit_equal(last["state_dict"], t.lightning_module.state_dict())


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_resume_is_bit_exact(tmp_path: Path, async_save: bool) -> None:
    uninterrupted = trainer(5)
    m = model()
    uninterrupted.fit(m, data())
    expected = final_state(uninterrupted, m)

    ckpts = tmp_path / "ckpts"
    first = trainer(2, FastPersistCheckpointIO(async_save=async_save),
                    [ModelCheckpoint(dirpath=ckpts, save_last=True)])
    first.fit(model(), data())
    resumed_model = model(seed=1)  # different initial weights: all must come from the checkpoint
    resumed = trainer(5, FastPersistCheckpointIO(async_save=async_save),
                      [ModelCheckpoint(dirpath=ckpts, save_last=True)])
    resumed.fit(resumed_model, data(), ckpt_path=ckpts / "last.ckpt")
    assert resumed.current_epoch == 5 and resumed.global_step == uninterrupted.global_step
    assert_bit_equal(final_state(resumed, resumed_model), expected)


class Snapshots(Callback):
    """Records a copy of what each checkpoint held when it was taken."""

    def __init__(self) -> None:
        self.taken: list[dict[str, torch.Tensor]] = []

    def on_save_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: dict[str, Any]) -> None:
        self.taken.append({k: v.clone() for k, v in checkpoint["state_dict"].items()})


def test_async_saves_hold_the_state_of_their_moment(tmp_path: Path) -> None:
    ckpts = tmp_path / "ckpts"
    snaps = Snapshots()
    io = FastPersistCheckpointIO(async_save=True)
    t = trainer(3, io, [ModelCheckpoint(dirpath=ckpts, save_top_k=-1), snaps])
    t.fit(model(), data())
    assert io._pending == []  # teardown waited for every save
    assert names(ckpts) == ["epoch=0-step=4.ckpt", "epoch=1-step=8.ckpt", "epoch=2-step=12.ckpt"]
    for name, taken in zip(names(ckpts), snaps.taken, strict=True):
        assert_bit_equal(fastpersist.load(ckpts / name)["state_dict"], taken, name)


def test_async_failure_is_raised_by_the_next_save(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    ckpts = tmp_path / "ckpts"
    inject_enospc(monkeypatch, "epoch=0-step=4.ckpt")
    t = trainer(3, FastPersistCheckpointIO(async_save=True),
                [ModelCheckpoint(dirpath=ckpts, save_top_k=-1)])
    with pytest.raises(CheckpointError, match=r"(?i)no space|epoch=0-step=4") as info:
        t.fit(model(), data())
    chain = [info.value, info.value.__cause__]
    assert any(isinstance(e, fastpersist.DiskFullError) for e in chain)
    assert not ckpts.exists() or "epoch=0-step=4.ckpt" not in names(ckpts)


def test_async_failure_of_the_last_save_is_raised_by_teardown(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ckpts = tmp_path / "ckpts"
    inject_enospc(monkeypatch, "epoch=1-step=8.ckpt")
    io = FastPersistCheckpointIO(async_save=True)
    t = trainer(2, io, [ModelCheckpoint(dirpath=ckpts, save_top_k=-1)])
    with pytest.raises(fastpersist.DiskFullError):
        t.fit(model(), data())
    assert names(ckpts) == ["epoch=0-step=4.ckpt"]
    io.teardown()  # raised once


@pytest.fixture
def _lightning_loader() -> Any:
    """Lightning's pl_load as it was, after the test (enable_load_from_checkpoint patches it)."""
    from lightning.pytorch.core import saving

    original = saving.pl_load
    yield
    saving.pl_load = original


def test_values_that_need_pickle_are_refused_by_name(tmp_path: Path) -> None:
    ckpts = tmp_path / "ckpts"
    t = trainer(1, FastPersistCheckpointIO(), [ModelCheckpoint(dirpath=ckpts)])
    with pytest.raises(UnsupportedValueError, match=r"hyper_parameters\.extra.*PosixPath"
                       r".*allow_pickle=True"):
        t.fit(model(extra=Path("/data")), data())
    assert not ckpts.exists() or names(ckpts) == []  # nothing was written


@pytest.mark.usefixtures("_lightning_loader")
def test_allow_pickle_stores_them(tmp_path: Path) -> None:
    ckpts = tmp_path / "ckpts"
    io = FastPersistCheckpointIO(allow_pickle=True)
    t = trainer(1, io, [ModelCheckpoint(dirpath=ckpts)])
    t.fit(model(extra=Path("/data")), data())
    path = ckpts / "epoch=0-step=4.ckpt"
    with pytest.raises(fastpersist.PickleNotAllowedError):
        fastpersist.load(path)
    assert io.load_checkpoint(path)["hyper_parameters"]["extra"] == Path("/data")
    with pytest.raises(fastpersist.PickleNotAllowedError):  # as torch.load(weights_only=True)
        io.load_checkpoint(path, weights_only=True)
    from fastpersist.integrations.lightning import enable_load_from_checkpoint

    enable_load_from_checkpoint()  # load_from_checkpoint: pickle only with weights_only=False
    with pytest.raises(fastpersist.PickleNotAllowedError):
        Tiny.load_from_checkpoint(path)
    assert Tiny.load_from_checkpoint(path, weights_only=False).hparams.extra == Path("/data")


@pytest.mark.usefixtures("_lightning_loader")
def test_namespace_hparams_are_stored_as_mappings(tmp_path: Path) -> None:
    """A Namespace among the hyperparameters (a module taking `args`) is saved
    without pickle and comes back a Namespace, on resume and in load_from_checkpoint."""
    args = argparse.Namespace(depth=3, opt=argparse.Namespace(name="adamw", betas=[0.9, 0.99]))
    ckpts = tmp_path / "ckpts"
    io = FastPersistCheckpointIO()
    t = trainer(1, io, [ModelCheckpoint(dirpath=ckpts)])
    t.fit(model(extra=args), data())
    path = ckpts / "epoch=0-step=4.ckpt"
    raw = fastpersist.load(path)  # no pickle in it
    assert raw["hyper_parameters"]["extra"] == {
        "__argparse.Namespace__": {"depth": 3, "opt": {"__argparse.Namespace__": {
            "name": "adamw", "betas": [0.9, 0.99]}}}}
    loaded = io.load_checkpoint(path, weights_only=True)
    assert loaded["hyper_parameters"]["extra"] == args
    assert type(loaded["hyper_parameters"]["extra"].opt) is argparse.Namespace
    t2 = trainer(2, FastPersistCheckpointIO(), [ModelCheckpoint(dirpath=ckpts)])
    resumed = model(seed=1, extra=args)
    t2.fit(resumed, data(), ckpt_path=path)
    assert t2.global_step == 8 and resumed.hparams.extra == args
    from fastpersist.integrations.lightning import enable_load_from_checkpoint

    enable_load_from_checkpoint()
    restored = Tiny.load_from_checkpoint(path)
    assert restored.hparams.extra == args and type(restored.hparams.extra) is argparse.Namespace


@pytest.mark.usefixtures("_lightning_loader")
@pytest.mark.parametrize("save_last", [True, "link"], ids=["copy", "link"])
def test_load_from_checkpoint(tmp_path: Path, save_last: Any) -> None:
    """Model.load_from_checkpoint("last.ckpt"), unchanged, on a fastpersist checkpoint."""
    from fastpersist.integrations.lightning import enable_load_from_checkpoint

    enable_load_from_checkpoint()
    enable_load_from_checkpoint()  # idempotent
    ckpts = tmp_path / "ckpts"
    t = trainer(2, FastPersistCheckpointIO(async_save=True),
                [ModelCheckpoint(dirpath=ckpts, save_last=save_last)])
    trained = model(lr=0.02)
    t.fit(trained, data())
    last = ckpts / "last.ckpt"
    assert (last / "manifest.json").is_file()
    restored = Tiny.load_from_checkpoint(str(last))
    assert restored.hparams.lr == 0.02  # hyperparameters from the checkpoint
    assert_bit_equal(restored.state_dict(), trained.state_dict())
    on_cpu = Tiny.load_from_checkpoint(last, map_location="cpu", lr=0.5)
    assert on_cpu.hparams.lr == 0.5 and next(on_cpu.parameters()).device.type == "cpu"
    # A torch.save file still goes to Lightning's own loader.
    torch_file = tmp_path / "torch.ckpt"
    torch.save(fastpersist.load(last, map_location="cpu"), torch_file)
    assert_bit_equal(Tiny.load_from_checkpoint(torch_file).state_dict(), trained.state_dict())


def test_attribute_dicts_are_stored_as_dicts(tmp_path: Path) -> None:
    io = FastPersistCheckpointIO()
    shared = torch.arange(4.0)
    sd = torch.nn.Linear(2, 2).state_dict()
    state = {"hyper_parameters": AttributeDict(cfg=AttributeDict(depth=3), w=[shared]),
             "state_dict": sd, "tied": shared}
    io.save_checkpoint(state, tmp_path / "c.ckpt")
    loaded = io.load_checkpoint(tmp_path / "c.ckpt")
    assert type(loaded["hyper_parameters"]) is dict
    assert loaded["hyper_parameters"]["cfg"] == {"depth": 3}
    assert loaded["hyper_parameters"]["w"][0] is loaded["tied"]  # sharing kept
    assert loaded["state_dict"]._metadata == sd._metadata  # type: ignore[attr-defined]


def test_a_callable_map_location_is_torchs(tmp_path: Path) -> None:
    """load_checkpoint(map_location=fn) calls fn(storage, saved location) per
    tensor as torch.load does (it was a TypeError before load took callables)."""
    io = FastPersistCheckpointIO()
    sd = torch.nn.Linear(2, 2).state_dict()
    io.save_checkpoint({"state_dict": sd}, tmp_path / "c.ckpt")
    seen: list[str] = []

    def doubled(storage: Any, location: str) -> Any:
        seen.append(location)
        t = torch.empty(0, dtype=torch.uint8).set_(storage).clone()
        return t.view(torch.float32).mul_(2).view(torch.uint8).untyped_storage()

    loaded = io.load_checkpoint(tmp_path / "c.ckpt", map_location=doubled)
    assert seen == ["cpu", "cpu"]
    for k, v in sd.items():
        assert torch.equal(loaded["state_dict"][k], v * 2), k


_TOP_K_CRASH = """
import os, sys, torch, lightning as L
from lightning.pytorch.callbacks import ModelCheckpoint, Callback
from fastpersist.integrations.lightning import FastPersistCheckpointIO
out = sys.argv[1]
class M(L.LightningModule):
    def __init__(self): super().__init__(); self.l = torch.nn.Linear(2048, 2048)
    def training_step(self, b, i): return self.l(b[0]).sum()
    def configure_optimizers(self): return torch.optim.Adam(self.parameters())
class Crash(Callback):
    def on_train_batch_start(self, trainer, *a):
        if trainer.global_step == 2:  # ModelCheckpoint has saved step 2 and removed step 1
            os._exit(9)
data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(8, 2048)),
                                   batch_size=1)
t = L.Trainer(default_root_dir=out, max_steps=4, logger=False, enable_progress_bar=False,
              enable_model_summary=False, accelerator="cpu",
              plugins=[FastPersistCheckpointIO(async_save=True)],
              callbacks=[ModelCheckpoint(dirpath=out, save_top_k=1, every_n_train_steps=1),
                         Crash()])
t.fit(M(), data)
"""


@pytest.mark.slow
def test_save_top_k_never_removes_the_last_checkpoint_before_its_successor_is_durable(
        tmp_path: Path) -> None:
    """async_save with save_top_k=1: Lightning starts the new save, then removes
    the old checkpoint at once. A process that dies right after (os._exit) must
    leave a checkpoint that loads; the removal used to run while the new one
    was still a temporary directory, leaving none."""
    import subprocess
    import sys

    out = tmp_path / "ckpts"
    run = subprocess.run([sys.executable, "-c", _TOP_K_CRASH, str(out)], capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 9, run.stderr[-2000:]
    visible = sorted(p.name for p in out.iterdir() if not p.name.startswith("."))
    assert visible == ["epoch=0-step=2.ckpt"], (visible, sorted(os.listdir(out)))
    loaded = fastpersist.load(out / "epoch=0-step=2.ckpt", allow_pickle=True)
    assert loaded["global_step"] == 2
    assert loaded["state_dict"]["l.weight"].shape == (2048, 2048)


def test_remove_checkpoint(tmp_path: Path, caplog: pytest.LogCaptureFixture,
                           monkeypatch: pytest.MonkeyPatch) -> None:
    from fastpersist.integrations import _lightning_io

    deleted: list[Path] = []
    real = _lightning_io.delete_checkpoint  # fastpersist.adapters'

    def delete_checkpoint(path: Path, **kwargs: Any) -> None:
        deleted.append(path)
        real(path, **kwargs)  # renames it aside (durably), then removes it

    monkeypatch.setattr(_lightning_io, "delete_checkpoint", delete_checkpoint)
    io = FastPersistCheckpointIO()
    io.save_checkpoint({"w": torch.ones(3)}, tmp_path / "a.ckpt")
    os.symlink("a.ckpt", tmp_path / "last.ckpt")
    io.remove_checkpoint(tmp_path / "last.ckpt")  # the link only
    assert names(tmp_path) == ["a.ckpt"]
    io.remove_checkpoint(tmp_path / "a.ckpt")
    assert deleted == [tmp_path / "a.ckpt"]
    io.remove_checkpoint(tmp_path / "gone.ckpt")  # nothing there: nothing to do
    assert names(tmp_path) == []
    (tmp_path / "mine.ckpt").mkdir()
    io.remove_checkpoint(tmp_path / "mine.ckpt")  # not a checkpoint: left alone
    assert names(tmp_path) == ["mine.ckpt"] and "not a fastpersist checkpoint" in caplog.text


def test_resume_from_a_torch_checkpoint(tmp_path: Path) -> None:
    """A run that used Lightning's default plugin resumes with fastpersist."""
    first = trainer(1, callbacks=[ModelCheckpoint(dirpath=tmp_path)])
    first.fit(model(), data())
    assert (tmp_path / "epoch=0-step=4.ckpt").is_file()
    t = trainer(2, FastPersistCheckpointIO(), [ModelCheckpoint(dirpath=tmp_path / "fp")])
    t.fit(model(seed=1), data(), ckpt_path=tmp_path / "epoch=0-step=4.ckpt")
    assert t.global_step == 8
    assert (tmp_path / "fp" / "epoch=1-step=8.ckpt" / "manifest.json").is_file()


def test_pytorch_lightning_package(tmp_path: Path) -> None:
    ptl = pytest.importorskip("pytorch_lightning")
    from fastpersist.integrations.pytorch_lightning import FastPersistCheckpointIO as PtlIO

    class PtlTiny(ptl.LightningModule):  # type: ignore[misc, name-defined]
        training_step = Tiny.training_step
        configure_optimizers = Tiny.configure_optimizers

        def __init__(self) -> None:
            super().__init__()
            self.save_hyperparameters({"lr": 0.05})
            self.net = torch.nn.Linear(6, 1)

    def fit(epochs: int, ckpt_path: Path | None = None) -> Any:
        t = ptl.Trainer(max_epochs=epochs, accelerator="cpu", plugins=[PtlIO(async_save=True)],
                        callbacks=[ptl.callbacks.ModelCheckpoint(dirpath=tmp_path, save_top_k=1,
                                                                 monitor="score", mode="max")],
                        logger=False, enable_progress_bar=False, enable_model_summary=False)
        t.fit(PtlTiny(), data(), ckpt_path=ckpt_path)
        return t

    fit(2)
    assert names(tmp_path) == ["epoch=1-step=8.ckpt"]
    t = fit(3, tmp_path / "epoch=1-step=8.ckpt")
    assert t.global_step == 12
    # Lightning never removes the checkpoint it resumed from.
    assert names(tmp_path) == ["epoch=1-step=8.ckpt", "epoch=2-step=12.ckpt"]
    from pytorch_lightning.core import saving

    from fastpersist.integrations.pytorch_lightning import enable_load_from_checkpoint

    original = saving.pl_load
    try:
        enable_load_from_checkpoint()
        restored = PtlTiny.load_from_checkpoint(tmp_path / "epoch=2-step=12.ckpt")
    finally:
        saving.pl_load = original
    assert_bit_equal(restored.state_dict(), t.lightning_module.state_dict())


def test_example_runs() -> None:
    """docs/guides/frameworks.md: python examples/lightning_example.py"""
    import subprocess
    import sys

    example = Path(__file__).parent.parent / "examples" / "lightning_example.py"
    out = subprocess.run([sys.executable, str(example)], capture_output=True, text=True,
                         timeout=300, check=True).stdout
    assert "bit for bit" in out
