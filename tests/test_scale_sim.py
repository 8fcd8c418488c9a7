"""benchmarks/scale_sim.py at a toy size: the simulation still drives the
real planner and commit code, the plan balances, and the store round trips
per rank do not grow with the number of ranks (the benchmark's O(1) claim).
The figures at 1,024-16,384 ranks are the benchmark's (docs/benchmarks.md)."""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

from _scale_model import Model
from scale_sim import Job, report, run_size

TOY = Model("toy", hidden=256, layers=4, ffn=512, heads=8, kv_heads=4, vocab=1024, tp=2, pp=1,
            fsdp_max=4)


@pytest.mark.slow
def test_the_simulation_runs_the_real_protocol_at_two_sizes() -> None:
    small, large = (run_size(TOY, world, repeats=1, dcp_repeats=1, dcp_timeout=120)
                    for world in (16, 64))
    for r in (small, large):
        assert r["balance_max_over_mean"] <= 1.05, r
        assert r["dcp_s"] and r["dcp_s"][0] is not None  # DCP's planner ran on the same boxes
        assert r["pieces"] > 0 and r["manifest_bytes"] > 0
    # 64 ranks are 8 layouts (TP 2 x FSDP 4) with 8 replicas each: the same boxes.
    assert large["unique_bytes"] == small["unique_bytes"]
    assert large["store"]["calls_per_rank_max"] == small["store"]["calls_per_rank_max"]
    assert large["store"]["calls_per_rank_max"] <= 4
    lines = report([small, large])
    assert any("toy | 64 |" in line for line in lines), lines


@pytest.mark.slow
def test_pipeline_stages_plan_the_same_bytes_and_join_their_trees() -> None:
    # The toy model in 2 stages (union=True): the same unique bytes as in one,
    # each planned once, and a job manifest whose tree holds every stage's keys.
    one = run_size(TOY, 16, repeats=1, dcp_repeats=1, dcp_timeout=120)
    two = run_size(replace(TOY, pp=2), 16, repeats=1, dcp_repeats=1, dcp_timeout=120)
    assert two["union"] and two["mesh"]["pp"] == 2 and not one["union"]
    assert two["unique_bytes"] == one["unique_bytes"]
    assert two["balance_max_over_mean"] <= 1.05, two
    assert two["dcp_s"] and two["dcp_s"][0] is not None
    job = Job(replace(TOY, pp=2), 16)
    keys = tuple(dict.fromkeys(i.key for items, _ in job.layouts.values() for i in items))
    tree = job.job_tree(keys)
    assert len(tree["k"]) == len(keys) and len(job.stages) == 2
    assert any("toy | 16 | 2x2x" in line for line in report([two]))
