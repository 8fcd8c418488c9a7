"""FastPersistTrainer killed (os._exit, as a node dies) while a checkpoint's
fastpersist saves are in flight: HF's rotation of old checkpoints
(save_total_limit) must not have deleted the last committed one, and
resume_from_checkpoint=True must resume from it, bit-exactly."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("transformers")

from test_integration_hf import accelerate_run, assert_bit_equal, final_state, train
from transformers import Trainer
from transformers.trainer_utils import get_last_checkpoint

import fastpersist
from fastpersist.integrations.hf_files import MODEL_DIR, TRAINER_DIR, last_checkpoint

CHILD = Path(__file__).parent / "helpers" / "hf_crash_trainer.py"


def crash(out: Path, at: int, moment: str, **kwargs: Any) -> None:
    done = subprocess.run([sys.executable, str(CHILD), str(out), str(at), moment,
                           json.dumps(kwargs)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 9, done.stdout + done.stderr


@pytest.mark.slow
@pytest.mark.parametrize("async_save", [True, False], ids=["async", "sync"])
def test_killed_mid_save_with_save_total_limit_1_resumes(tmp_path: Path,
                                                         async_save: bool) -> None:
    expected = final_state(train(tmp_path / "uninterrupted", cls=Trainer, save=False))
    out = tmp_path / "run"
    crash(out, 6, "write", limit=1, fastpersist_async=async_save)
    # checkpoint-6 holds HF's files but not fastpersist's: checkpoint-3 stays.
    assert get_last_checkpoint(str(out)) == str(out / "checkpoint-6")
    assert last_checkpoint(out) == str(out / "checkpoint-3")
    resumed = train(out, seed=1, resume=True, limit=1, fastpersist_async=async_save)
    assert_bit_equal(final_state(resumed), expected)
    assert sorted(p.name for p in out.iterdir()) == ["checkpoint-9"]


@pytest.mark.slow
def test_killed_at_train_end_keeps_the_best_checkpoint(tmp_path: Path) -> None:
    """save_total_limit=1 with a best model: at the end of training HF deletes
    every checkpoint but the best, here the newest, whose saves must be
    committed first."""
    ran = train(tmp_path / "whole", limit=1, lowest_loss_best=True)
    assert ran.state.best_model_checkpoint == str(tmp_path / "whole" / "checkpoint-9")
    out = tmp_path / "run"
    crash(out, 9, "train_end", limit=1, lowest_loss_best=True)
    assert last_checkpoint(out) == str(out / "checkpoint-9")
    for part in (MODEL_DIR, TRAINER_DIR):  # what a resume loads: the whole run's own
        assert_bit_equal(fastpersist.load(out / "checkpoint-9" / part),
                         fastpersist.load(tmp_path / "whole" / "checkpoint-9" / part))
    assert_bit_equal(fastpersist.load(out / "checkpoint-9" / MODEL_DIR),
                     ran.model.state_dict())


@pytest.mark.slow
@pytest.mark.parametrize("async_save", [True, False], ids=["async", "sync"])
def test_accelerate_total_limit_killed_mid_save_resumes(tmp_path: Path,
                                                        async_save: bool) -> None:
    """accelerate deletes the oldest checkpoint_N before it saves the next one:
    with the hooks, only once the next one is committed."""
    pytest.importorskip("accelerate")
    expected = accelerate_run(tmp_path / "unused")
    child = Path(__file__).parent / "helpers" / "accelerate_crash.py"
    done = subprocess.run([sys.executable, str(child), str(tmp_path),
                           "async" if async_save else "sync"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 9, done.stdout + done.stderr
    checkpoints = tmp_path / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["checkpoint_0", "checkpoint_1"]
    resumed = accelerate_run(checkpoints / "checkpoint_0", seed=1, save_at=3, resume=True)
    assert_bit_equal(resumed, expected)


def test_accelerate_total_limit_rotates_after_commit(tmp_path: Path) -> None:
    """Uninterrupted: total_limit=1 still leaves one checkpoint, the newest."""
    pytest.importorskip("accelerate")
    expected = accelerate_run(tmp_path / "unused")
    assert_bit_equal(accelerate_run(tmp_path / "unused", rotating=tmp_path, async_save=True),
                     expected)
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["checkpoint_1"]
    resumed = accelerate_run(tmp_path / "checkpoints" / "checkpoint_1", seed=1, save_at=5,
                             resume=True)
    assert_bit_equal(resumed, expected)
