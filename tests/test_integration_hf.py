"""fastpersist.integrations.transformers: a real transformers.Trainer on a tiny,
randomly initialised Llama (CPU) checkpoints through fastpersist and resumes
with resume_from_checkpoint bit-exactly, compared with an uninterrupted run."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

from safetensors import safe_open  # noqa: E402
from support import inject_enospc  # noqa: E402
from transformers import (  # noqa: E402
    LlamaConfig,
    LlamaForCausalLM,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)

import fastpersist  # noqa: E402
from fastpersist.integrations.transformers import (  # noqa: E402
    MODEL_DIR,
    TRAINER_DIR,
    FastPersistTrainer,
)

STEPS, EVERY = 9, 3


def config() -> Any:
    return LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=2, num_key_value_heads=2, vocab_size=64,
                       max_position_embeddings=64)


class Tokens(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    def __init__(self) -> None:
        self.ids = torch.randint(0, 64, (32, 16), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class StopAt(TrainerCallback):
    """Ends training after step `at` (after its checkpoint): an interrupted run."""

    def __init__(self, at: int) -> None:
        self.at = at

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.global_step == self.at:
            control.should_training_stop = True


def train(out: Path, *, cls: type = FastPersistTrainer, seed: int = 0, stop: int | None = None,
          resume: Any = None, save: bool = True, eval_steps_kw: bool = False,
          limit: int = 2, lowest_loss_best: bool = False, **kwargs: Any) -> Any:
    torch.manual_seed(seed)  # the initial weights: a resumed run must not depend on them
    best = {"eval_strategy": "steps", "eval_steps": EVERY, "load_best_model_at_end": True,
            # The highest loss is "best": the first checkpoint, not the final weights.
            "metric_for_best_model": "eval_loss", "greater_is_better": True,
            } if eval_steps_kw else {}
    if lowest_loss_best:  # the final checkpoint is the best one
        best = {"eval_strategy": "steps", "eval_steps": EVERY,
                "metric_for_best_model": "eval_loss", "greater_is_better": False}
        kwargs.setdefault("eval_dataset", Tokens())
    args = TrainingArguments(output_dir=str(out), per_device_train_batch_size=4,
                             max_steps=STEPS, save_steps=EVERY,
                             save_strategy="steps" if save else "no", save_total_limit=limit,
                             learning_rate=1e-3, warmup_steps=2, logging_steps=100,
                             report_to=[], use_cpu=True, seed=0, disable_tqdm=True, **best)
    trainer = cls(model=LlamaForCausalLM(config()), args=args, train_dataset=Tokens(),
                  callbacks=([StopAt(stop)] if stop else []) + kwargs.pop("callbacks", []),
                  **kwargs)
    trainer.train(resume_from_checkpoint=resume)
    return trainer


def final_state(trainer: Any) -> dict[str, Any]:
    return {"model": trainer.model.state_dict(), "optimizer": trainer.optimizer.state_dict(),
            "scheduler": trainer.lr_scheduler.state_dict(),
            "step": trainer.state.global_step}


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


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return final_state(train(tmp_path_factory.mktemp("uninterrupted"), cls=Trainer, save=False))


@pytest.mark.parametrize("mode", ["async", "sync", "async-public"])
def test_checkpoints_and_bit_exact_resume(tmp_path: Path, uninterrupted: dict[str, Any],
                                          mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    if mode == "async-public":  # fastpersist.async_save, where its Saver cannot be imported
        import fastpersist.integrations.transformers as integration

        monkeypatch.setattr(integration, "_new_saver", lambda daemon: None)
    async_save = mode != "sync"
    first = train(tmp_path, stop=6, fastpersist_async=async_save)
    assert first._fp_pending == []  # train() waited for its checkpoints
    ckpt = tmp_path / "checkpoint-6"
    files = sorted(os.listdir(ckpt))
    # HF's small files as HF writes them; the weights and the optimizer through fastpersist.
    assert {MODEL_DIR, TRAINER_DIR, "model.safetensors.index.json", "config.json",
            "trainer_state.json", "rng_state.pth", "training_args.bin"} <= set(files)
    assert "model.safetensors" not in files
    # optimizer.pt and scheduler.pt: refusals for a plain Trainer, not the state.
    assert all(os.path.getsize(ckpt / n) < 1024 for n in ("optimizer.pt", "scheduler.pt"))
    weights = fastpersist.load(ckpt / MODEL_DIR)
    assert_bit_equal(weights, first.model.state_dict())
    assert set(fastpersist.load(ckpt / TRAINER_DIR)) == {"optimizer", "scheduler"}

    # The weights are a model.safetensors shard under HF's names; from_pretrained reads them.
    data_files = sorted((ckpt / MODEL_DIR).glob("data-*.safetensors"))
    with safe_open(str(data_files[0]), "pt") as f:
        assert set(f.keys()) == set(weights)
    reloaded = LlamaForCausalLM.from_pretrained(str(ckpt))
    assert_bit_equal(reloaded.state_dict(), weights)

    resumed = train(tmp_path, seed=1, resume=True, fastpersist_async=async_save)
    assert_bit_equal(final_state(resumed), uninterrupted)
    # save_total_limit=2 rotated checkpoint-3 (and -6) out; everything left is complete.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-6", "checkpoint-9"]
    assert (tmp_path / "checkpoint-9" / "model.safetensors.index.json").is_file()


def test_a_plain_trainer_checkpoint_resumes_bit_exactly(tmp_path: Path,
                                                        uninterrupted: dict[str, Any]) -> None:
    """Runs can switch: a checkpoint of HF's own format is read by HF's code."""
    train(tmp_path, cls=Trainer, stop=6)
    assert (tmp_path / "checkpoint-6" / "optimizer.pt").is_file()
    resumed = train(tmp_path, seed=1, resume=str(tmp_path / "checkpoint-6"))
    assert_bit_equal(final_state(resumed), uninterrupted)
    assert (tmp_path / "checkpoint-9" / MODEL_DIR / "manifest.json").is_file()


class Captured(TrainerCallback):
    """The optimizer state and step as training (re)starts, after any resume."""

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        import copy

        self.optimizer = copy.deepcopy(kwargs["optimizer"].state_dict())
        self.scheduler = copy.deepcopy(kwargs["lr_scheduler"].state_dict())
        self.step = state.global_step


def test_resume_restores_the_optimizer_or_refuses(tmp_path: Path) -> None:
    """A fastpersist checkpoint resumes with the optimizer's state as saved; a
    plain Trainer, which cannot read it, refuses the checkpoint instead of
    starting the optimizer afresh."""
    first = train(tmp_path, stop=6)
    saved = fastpersist.load(tmp_path / "checkpoint-6" / TRAINER_DIR)
    assert_bit_equal(saved["optimizer"], first.optimizer.state_dict())
    assert saved["optimizer"]["state"][0]["exp_avg"].abs().sum() > 0  # AdamW moved

    with pytest.raises(Exception, match=r"resume it with FastPersistTrainer") as info:
        train(tmp_path, cls=Trainer, seed=1, resume=str(tmp_path / "checkpoint-6"))
    assert "fastpersist-trainer/" in str(info.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-3", "checkpoint-6"]
    for name in ("optimizer.pt", "scheduler.pt"):  # whatever reads them: nothing runs
        with pytest.raises(ModuleNotFoundError, match="fastpersist: the optimizer"):
            torch.load(tmp_path / "checkpoint-6" / name, weights_only=False)

    captured = Captured()
    train(tmp_path, seed=1, resume=str(tmp_path / "checkpoint-6"), callbacks=[captured])
    assert captured.step == 6
    assert_bit_equal(captured.optimizer, saved["optimizer"])
    assert_bit_equal(captured.scheduler, saved["scheduler"])


def test_background_failure_is_raised(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    inject_enospc(monkeypatch, TRAINER_DIR)
    with pytest.raises(fastpersist.CheckpointError) as info:
        train(tmp_path)
    chain = [info.value, info.value.__cause__]
    assert any(isinstance(e, fastpersist.DiskFullError) for e in chain)
    assert not (tmp_path / "checkpoint-3" / TRAINER_DIR).exists()


# --- accelerate: Accelerator.save_state/load_state with the weights through fastpersist ---


def accelerate_run(ckpt: Path, *, seed: int = 0, save_at: int | None = None,
                   resume: bool = False, async_save: bool = False,
                   rotating: Path | None = None) -> dict[str, Any]:
    """rotating: save_state() after steps 3 and 5 into rotating/checkpoints/
    (ProjectConfiguration's automatic naming, total_limit=1)."""
    accelerate = pytest.importorskip("accelerate")
    from accelerate.utils import ProjectConfiguration

    from fastpersist.integrations.accelerate import OPTIMIZER_DIR, register

    config = None if rotating is None else ProjectConfiguration(
        project_dir=str(rotating), automatic_checkpoint_naming=True, total_limit=1)
    accelerator = accelerate.Accelerator(cpu=True, project_config=config)
    hooks = register(accelerator, async_save=async_save)
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Dropout(0.2), torch.nn.Tanh(),
                                torch.nn.Linear(16, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, 2, 0.5)
    model, opt, sched = accelerator.prepare(model, opt, sched)
    start = 0
    if resume:
        accelerator.load_state(str(ckpt))
        start = save_at or 0
    data = torch.Generator().manual_seed(0)
    batches = [(torch.randn(8, 6, generator=data), torch.randn(8, 1, generator=data))
               for _ in range(6)]
    for step in range(start, 6):
        x, y = batches[step]
        loss = torch.nn.functional.mse_loss(model(x), y)  # dropout: the RNG state matters
        accelerator.backward(loss)
        opt.step()
        sched.step()
        opt.zero_grad()
        if rotating is not None and step + 1 in (3, 5):
            accelerator.save_state()
        if not resume and step + 1 == save_at:
            accelerator.save_state(str(ckpt))
            hooks.wait()
            saved_opt = fastpersist.load(ckpt / OPTIMIZER_DIR)
            assert_bit_equal(saved_opt, {"optimizers": [opt.state_dict()],
                                         "schedulers": [sched.state_dict()]})
    hooks.remove()
    assert "save_state" not in vars(accelerator)  # the class's own again
    return {"model": model.state_dict(), "optimizer": opt.state_dict(),
            "scheduler": sched.state_dict()}


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_accelerate_save_state_and_load_state(tmp_path: Path, async_save: bool) -> None:
    pytest.importorskip("accelerate")
    expected = accelerate_run(tmp_path / "unused")
    ckpt = tmp_path / "ckpt"
    saved = accelerate_run(ckpt, save_at=3, async_save=async_save)
    assert_bit_equal(saved, expected)  # saving changed nothing
    # The weights, the optimizer's and the scheduler's state through fastpersist;
    # no torch.save file of accelerate's holds any of them.
    assert set(os.listdir(ckpt)) == {"fastpersist-model", "fastpersist-optimizer",
                                     "random_states_0.pkl"}
    with safe_open(str(next((ckpt / "fastpersist-model").glob("data-*.safetensors"))),
                   "pt") as f:
        assert set(f.keys()) == {"0.weight", "0.bias", "3.weight", "3.bias"}
    resumed = accelerate_run(ckpt, seed=1, save_at=3, resume=True)
    assert_bit_equal(resumed, expected)


def test_accelerate_without_the_hooks_and_a_mismatch(tmp_path: Path) -> None:
    """A directory accelerate saved itself loads with the hooks (its own files);
    one whose optimizers do not match this Accelerator's is refused by name."""
    pytest.importorskip("accelerate")
    from accelerate import Accelerator

    from fastpersist.integrations.accelerate import register

    def prepared(n: int, step: bool = False) -> tuple[Any, list[Any]]:
        acc = Accelerator(cpu=True)
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 4)
        opts = [torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9) for _ in range(n)]
        model, *opts = acc.prepare(model, *opts)
        if step:
            model(torch.ones(2, 4)).sum().backward()
            opts[0].step()
        return acc, opts

    acc, (opt,) = prepared(1, step=True)
    acc.save_state(str(tmp_path / "plain"))  # no hooks: accelerate's files
    assert (tmp_path / "plain" / "optimizer.bin").is_file()
    saved = opt.state_dict()
    acc, (opt,) = prepared(1)
    register(acc)
    acc.load_state(str(tmp_path / "plain"))
    assert_bit_equal(opt.state_dict(), saved)
    assert acc._optimizers == [opt]  # put back after load_state
    acc.save_state(str(tmp_path / "one"))
    acc, _ = prepared(2)
    register(acc)
    with pytest.raises(fastpersist.CheckpointError, match=r"fastpersist-optimizer holds the "
                       r"state of 1 optimizers, but this Accelerator has prepared 2"):
        acc.load_state(str(tmp_path / "one"))
    assert len(acc._optimizers) == 2  # put back after the failure too


def test_example_runs() -> None:
    """docs/guides/frameworks.md: python examples/hf_trainer_example.py"""
    import subprocess
    import sys

    example = Path(__file__).parent.parent / "examples" / "hf_trainer_example.py"
    out = subprocess.run([sys.executable, str(example)], capture_output=True, text=True,
                         timeout=300, check=True).stdout
    assert "bit for bit" in out and "from_pretrained" in out


def test_through_the_daemon(daemon: Any, uninterrupted: dict[str, Any]) -> None:
    """fastpersist_daemon: fastpersistd writes both checkpoints (its root holds the run)."""
    out = daemon.root / "run"
    train(out, stop=6, fastpersist_daemon=daemon.address)
    assert (out / "checkpoint-6" / "model.safetensors.index.json").is_file()
    resumed = train(out, seed=1, resume=True, fastpersist_daemon=daemon.address)
    assert_bit_equal(final_state(resumed), uninterrupted)


def test_load_best_model_at_end(tmp_path: Path) -> None:
    """HF's own best-model loading reads the weights through the index, once durable."""
    trainer = train(tmp_path, eval_dataset=Tokens(), eval_steps_kw=True)
    best = trainer.state.best_model_checkpoint
    assert best == str(tmp_path / "checkpoint-3") and (Path(best) / MODEL_DIR).is_dir()
    assert_bit_equal(trainer.model.state_dict(), fastpersist.load(Path(best) / MODEL_DIR))


@pytest.mark.parametrize("writer", ["write_index", "write_refusals"])
def test_small_files_leave_only_what_gc_collects(tmp_path: Path, writer: str,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """The index and the refusals are replaced through a temporary named as
    fastpersist's leftovers are (a crash before the rename leaves one: `fpctl
    gc` removes it), and the directory is fsynced after the rename."""
    import subprocess
    import sys

    fastpersist.save({"w": torch.ones(3)}, tmp_path / MODEL_DIR)
    script = ("import os, sys\n"
              "from fastpersist.integrations import transformers as t\n"
              "os.replace = lambda *a, **k: os._exit(9)  # the machine dies before the rename\n"
              f"t.{writer}(sys.argv[1])\n")
    died = subprocess.run([sys.executable, "-c", script, str(tmp_path)], timeout=120)
    assert died.returncode == 9
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")]  # the temporary
    subprocess.run([sys.executable, "-m", "fastpersist.cli", "gc", str(tmp_path)], check=True,
                   timeout=120, capture_output=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == [MODEL_DIR]

    import fastpersist.adapters as adapters
    import fastpersist.integrations.transformers as integration

    synced: list[str] = []
    real = adapters.fsync_dir
    monkeypatch.setattr(adapters, "fsync_dir", lambda p: (synced.append(str(p)), real(p))[1])
    getattr(integration, writer)(tmp_path)
    assert synced and set(synced) == {str(tmp_path)}
