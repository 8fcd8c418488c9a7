"""torchtitan's CheckpointManager through fastpersist (integrations/torchtitan.py):
real gloo ranks, an FSDP2 model, torchtitan's own optimizer and LR-scheduler
containers (tests/helpers/torchtitan_worker.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torchtitan.components.checkpointer")

from dist_support import run_example, run_ranks

import fastpersist
from fastpersist.cli import main as fpctl
from fastpersist.integrations.torchtitan import committed_steps
from fastpersist.storage.commit import find_leftovers

HELPERS = Path(__file__).parent / "helpers"
WORLD = 2


def run_job(tmp_path: Path, scenario: str, args: dict[str, Any]) -> list[dict[str, Any]]:
    return run_ranks(HELPERS / "torchtitan_worker.py", scenario, tmp_path / scenario, WORLD,
                     args, timeout=240)


# ("async_with_pinned_mem" uses torchtitan's DefaultStager, which needs CUDA.)
@pytest.mark.parametrize("async_mode", ["disabled", "async"])
def test_train_save_every_step_keep_two_and_resume_bit_exactly(
        tmp_path: Path, async_mode: str) -> None:
    args = {"base": str(tmp_path / "job"), "async_mode": async_mode}
    for report in run_job(tmp_path, "train", args):
        assert report.get("ok"), report
        # keep_latest_k=2 after four saves; torchtitan's purge thread removed the rest.
        assert report["folder"] == ["step-3", "step-4"]
    folder = tmp_path / "job" / "checkpoint"
    assert not find_leftovers(folder)
    assert sorted(committed_steps(str(folder))) == [3, 4]
    # A fastpersist checkpoint: fpctl verifies it, fastpersist.load reads it.
    assert fpctl(["verify", str(folder / "step-4")]) == 0
    flat = fastpersist.load(folder / "step-4")
    assert int(flat["train_state.step"]) == 4

    for report in run_job(tmp_path, "resume", args):
        assert report.get("ok"), report
        assert report["loaded"] and report["step"] == 4
        assert report["compared"] >= 12  # weights, biases, exp_avg(_sq), step of 4 params
        assert report["differ"] == []
        assert report["lr_equal"]


@pytest.mark.parametrize("ranks", [1, 2])
def test_example_runs(tmp_path: Path, ranks: int) -> None:
    """docs/guides/dcp.md: examples/torchtitan_example.py, and under torchrun with 2 ranks."""
    out = run_example("torchtitan_example.py", tmp_path, ranks)
    assert "resumed from step 8 bit-exactly; trained to step 10" in out
    assert sorted(p.name for p in (tmp_path / "checkpoint").iterdir()) == ["step-10", "step-8"]
