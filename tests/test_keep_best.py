"""Checkpointer conveniences: keep-best-by-metric retention (keep_best.py) and
should_save() (cadence.py), in-process, on real checkpoints."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

import fastpersist
from fastpersist import Checkpointer


def state(step: int) -> dict[str, object]:
    return {"w": torch.full((4,), float(step)), "step": step}


def on_disk(root: Path) -> list[int]:
    return sorted(int(p.name[5:]) for p in root.glob("step-*"))


def run(root: Path, losses: dict[int, float], **kwargs: object) -> Checkpointer:
    ckpt = Checkpointer(root, **kwargs)  # type: ignore[arg-type]
    for step, loss in losses.items():
        ckpt.save(step, state(step), metrics={"val_loss": loss, "acc": -loss})
        ckpt.wait()  # retention has run after each commit
    return ckpt


def test_keeps_the_best_and_the_newest(tmp_path: Path) -> None:
    losses = {1: 5.0, 2: 1.0, 3: 4.0, 4: 3.0, 5: 6.0, 6: 7.0}
    with run(tmp_path, losses, keep_best=2, best_metric="val_loss"):
        pass
    assert on_disk(tmp_path) == [2, 4, 6]  # the two lowest losses, and the newest
    assert fastpersist.load(tmp_path / "step-00000002")["step"] == 2
    assert (tmp_path / "latest").read_text().strip() == "step-00000006"


def test_max_mode(tmp_path: Path) -> None:
    losses = {1: 5.0, 2: 1.0, 3: 4.0, 4: 3.0, 5: 6.0, 6: 0.5}
    with run(tmp_path, losses, keep_best=2, best_metric="acc", best_mode="max"):
        pass
    assert on_disk(tmp_path) == [2, 6]  # the highest acc (= -loss): steps 6 (newest), 2


def test_ties_go_to_the_earlier_step_and_nan_ranks_last(tmp_path: Path) -> None:
    losses = {1: math.nan, 2: 1.0, 3: 1.0, 4: 1.0, 5: 2.0, 6: math.nan}
    with run(tmp_path, losses, keep_best=2, best_metric="val_loss"):
        pass
    assert on_disk(tmp_path) == [2, 3, 6]
    with run(tmp_path / "nan", {1: math.nan, 2: math.nan, 3: 9.0}, keep_best=2,
             best_metric="val_loss"):
        pass
    assert on_disk(tmp_path / "nan") == [1, 3]  # a number before NaN; then the earlier NaN


def test_with_keep_last_and_keep_every(tmp_path: Path) -> None:
    losses = {1: 0.5, 2: 3.0, 3: 2.0, 4: 5.0, 5: 6.0, 6: 7.0, 7: 8.0, 8: 9.0}
    with run(tmp_path, losses, keep_last=2, keep_every=4, keep_best=2, best_metric="val_loss"):
        pass
    # best: 1 and 3; newest two: 7 and 8; multiples of 4: 4 and 8.
    assert on_disk(tmp_path) == [1, 3, 4, 7, 8]


def test_retention_across_a_restart_sees_past_metrics(tmp_path: Path) -> None:
    with run(tmp_path, {1: 0.1, 2: 5.0, 3: 4.0}, keep_best=1, best_metric="val_loss"):
        pass
    assert on_disk(tmp_path) == [1, 3]
    recorded = json.loads((tmp_path / "metrics.json").read_text())["steps"]
    assert set(recorded) == {"1", "2", "3"}
    # A restarted job: a new Checkpointer, worse metrics; step 1 stays the best.
    with run(tmp_path, {4: 3.0, 5: 2.0}, keep_best=1, best_metric="val_loss") as again:
        assert again.metrics.metrics()[1] == {"val_loss": 0.1, "acc": -0.1}
    assert on_disk(tmp_path) == [1, 5]
    recorded = json.loads((tmp_path / "metrics.json").read_text())["steps"]
    assert set(recorded) == {"1", "4", "5"}  # steps 2 and 3, deleted, dropped at a write
    # Steps saved before keep_best (no metrics) are never among the best.
    with run(tmp_path / "late", {1: 0.0}):
        pass
    with Checkpointer(tmp_path / "late") as ckpt:
        ckpt.save(2, state(2))
    with run(tmp_path / "late", {3: 9.0, 4: 8.0}, keep_best=1, best_metric="val_loss"):
        pass
    assert on_disk(tmp_path / "late") == [1, 4]  # step 1 had metrics; 2 had none


def test_a_missing_metric_is_refused_before_anything_is_written(tmp_path: Path) -> None:
    with Checkpointer(tmp_path, keep_best=2, best_metric="val_loss") as ckpt:
        ckpt.save(1, state(1), metrics={"val_loss": 1.0})
        with pytest.raises(ValueError, match=r"step 2: keep_best ranks checkpoints by "
                           r"'val_loss', which its metrics= do not give \(given: none\)"):
            ckpt.save(2, state(2))
        with pytest.raises(ValueError, match=r"\(given: acc, loss\)"):
            ckpt.save(2, state(2), metrics={"loss": 1.0, "acc": 0.5})
        with pytest.raises(TypeError, match=r"metric 'val_loss' is not a number: 'low'"):
            ckpt.save(2, state(2), metrics={"val_loss": "low"})
        ckpt.save(2, state(2), metrics={"val_loss": torch.tensor(0.5)})  # a 0-d tensor
    assert on_disk(tmp_path) == [1, 2]
    assert json.loads((tmp_path / "metrics.json").read_text())["steps"]["2"] == {
        "val_loss": 0.5}
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no leftovers


def test_settings_that_cannot_work(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="keep_best= and best_metric= go together"):
        Checkpointer(tmp_path, keep_best=2)
    with pytest.raises(ValueError, match="keep_best must be a whole number >= 1"):
        Checkpointer(tmp_path, keep_best=0, best_metric="loss")
    with pytest.raises(ValueError, match="best_mode must be 'min' or 'max'"):
        Checkpointer(tmp_path, keep_best=1, best_metric="loss", best_mode="lowest")
    with pytest.raises(ValueError, match=r"not through fastpersistd \(daemon=\)"):
        Checkpointer(tmp_path, keep_best=1, best_metric="loss", daemon="unix:/nonexistent")
    (tmp_path / "metrics.json").write_text("{not json")
    with pytest.raises(fastpersist.CheckpointError, match=r"metrics.json \(the metrics "
                       r"keep_best ranks checkpoints by\) cannot be read"):
        Checkpointer(tmp_path, keep_best=1, best_metric="loss")


def test_should_save_with_save_every(tmp_path: Path) -> None:
    with Checkpointer(tmp_path, save_every=5) as ckpt:
        assert [s for s in range(12) if ckpt.should_save(s)] == [0, 5, 10]
        ckpt.save(5, state(5))
        assert not ckpt.should_save(5)  # saved (or in flight) already
        ckpt.save(7, state(7))  # save() itself takes any step
    with Checkpointer(tmp_path, save_every=5) as again:  # a restarted job
        assert [s for s in range(12) if again.should_save(s)] == [0, 10]
    with Checkpointer(tmp_path / "every") as ckpt:  # no interval: every step not saved
        ckpt.save(1, state(1))
        assert [s for s in range(4) if ckpt.should_save(s)] == [0, 2, 3]


def test_should_save_agrees_with_the_cadence(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="save_every= is the interval of should_save"):
        Checkpointer(tmp_path, save_every=5, disk_every=10)
    with Checkpointer(tmp_path, disk_every=3) as ckpt:
        for step in range(10):
            if ckpt.should_save(step):
                ckpt.save(step, state(step))
            else:  # save() refuses what should_save() says no to
                with pytest.raises(ValueError, match="on neither cadence"):
                    ckpt.save(step, state(step))
        assert [s for s in range(10) if ckpt.should_save(s)] == []
    assert on_disk(tmp_path) == [0, 3, 6, 9]


def test_with_a_tier_the_best_stay_after_the_uploads(s3: Any, tmp_path: Path) -> None:
    """Retention after each upload (the uploader's thread) keeps the best too."""
    from test_tier_checkpointer import Gate

    from fastpersist.tier.client import client_for

    gate = Gate(client_for().client)
    root = tmp_path / "run"
    ckpt = Checkpointer(root, keep_best=1, best_metric="val_loss", tier=s3.url)
    try:
        for step, loss in ((1, 0.1), (2, 0.5), (3, 0.9)):
            ckpt.save(step, state(step), metrics={"val_loss": loss}).result(timeout=30)
        assert on_disk(root) == [1, 2, 3]  # none uploaded yet: all kept
    finally:
        gate.open()
    assert ckpt.wait_for_tier(60)
    ckpt.close()
    assert on_disk(root) == [1, 3]  # uploaded: the best and the newest stay


def test_a_failed_overwrite_keeps_the_checkpoints_own_metric(tmp_path: Path) -> None:
    """save(overwrite=True, metrics=...) over the best step, failing: the
    checkpoint that stayed is ranked by its own metric (the new one was
    recorded before the save, and used to re-rank it: a later save then
    deleted the best checkpoint). A restarted Checkpointer agrees."""
    ckpt = run(tmp_path, {1: 5.0, 2: 1.0, 3: 4.0}, keep_last=1, keep_best=1,
               best_metric="val_loss")
    assert on_disk(tmp_path) == [2, 3]
    with pytest.raises(fastpersist.UnsupportedValueError):
        ckpt.save(2, {"w": torch.ones(4), "bad": object()}, overwrite=True,
                  metrics={"val_loss": 9.0})
    ckpt.save(4, state(4), metrics={"val_loss": 3.0})
    ckpt.wait()
    assert on_disk(tmp_path) == [2, 4]  # step 2 (val_loss 1.0) is still the best
    ckpt.close()
    again = Checkpointer(tmp_path, keep_last=1, keep_best=1, best_metric="val_loss")
    again.save(5, state(5), metrics={"val_loss": 2.0})
    again.wait()
    assert on_disk(tmp_path) == [2, 5]
    # An overwrite that lands is ranked by its new metric.
    again.save(2, state(2), overwrite=True, metrics={"val_loss": 9.0})
    again.save(6, state(6), metrics={"val_loss": 8.0})
    again.wait()
    assert on_disk(tmp_path) == [5, 6]
    again.close()
