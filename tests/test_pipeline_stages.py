"""Pipeline stages (ranks that hold different tensors) saved with union=True:
real gloo ranks, 2 stages x 2 data-parallel replicas."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from dist_support import ok, run_ranks, worker_module

import fastpersist
from fastpersist.cli import main as fpctl
from fastpersist.tensors.checkpoint import read_manifest

WORKER = Path(__file__).parent / "helpers" / "stage_worker.py"


def test_stages_save_their_union_and_each_loads_its_own_part(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    reports = run_ranks(WORKER, "save", tmp_path / "out", 4, {"path": str(ckpt),
                                                              "root": str(tmp_path)})
    ok(reports)
    assert [r["differs"] for r in reports] == [[]] * 4  # each rank got its state back, exactly
    assert [r["async_differs"] for r in reports] == [[]] * 4
    assert [r["checkpointer_differs"] for r in reports] == [[]] * 4
    assert [r["extra"] for r in reports] == [["stage1"]] * 2 + [["stage0"]] * 2
    # Stages hold values of their own ("stage0", "stage1"): not a difference
    # between replicas, so nothing is warned of.
    assert [r["warnings"] for r in reports] == [[]] * 4
    whole = fastpersist.load(ckpt)
    layers = [f"layers.{n}.{p}" for n in range(4) for p in ("weight", "bias")]
    assert sorted(whole["model"]) == sorted(["embed.weight", *layers])
    assert whole["step"] == 7 and whole["stage0"]["micro_batches"] == 4
    assert whole["stage1"]["lr"] == 2e-3
    # Each stage's optimizer state, under its parameters' names; the tied
    # embedding's (both stages hold it: their replicas) once.
    optim_keys = [k for k in whole["optim"] if k.startswith("state.layers.")]
    assert len(optim_keys) == 8 * 3, sorted(whole["optim"])
    manifest = read_manifest(ckpt)
    assert manifest.schema_version == 3
    writers = {t.file.split("-")[1] for t in manifest.tensors}
    assert writers == {"r00000", "r00001", "r00002", "r00003"}, writers


def test_replicas_of_a_stage_that_differ_are_warned_of_once(tmp_path: Path) -> None:
    # Rank 3 holds another "step" than rank 2, the first rank of its stage:
    # rank 0 warns, naming the key and whose values are kept; the checkpoint
    # holds rank 2's, and stage 0's replicas, which agree, are not named.
    ckpt = tmp_path / "ckpt"
    reports = run_ranks(WORKER, "diverged", tmp_path / "out", 4, {"path": str(ckpt)})
    ok(reports)
    assert [len(r["warnings"]) for r in reports] == [1, 0, 0, 0], reports
    warned = reports[0]["warnings"][0]
    assert "different values for 1 key(s)" in warned and ": step." in warned, warned
    assert "It keeps each stage's first rank's non-tensor values" in warned, warned
    assert [r["differs"] for r in reports] == [[]] * 3 + [[".step"]]
    assert fastpersist.load(ckpt)["step"] == 7


def test_tensor_parallel_stages_reshard_on_load(tmp_path: Path) -> None:
    # 2 stages x 2 tensor-parallel ranks: each stage's weights are DTensors
    # sharded by rows over its own ranks; each rank loads its stage's part
    # sharded by columns (like=), and a whole load gives every layer.
    ckpt = tmp_path / "ckpt"
    reports = run_ranks(WORKER, "tp", tmp_path / "out", 4, {"path": str(ckpt)})
    ok(reports)
    assert [r["wrong"] for r in reports] == [[]] * 4
    whole = fastpersist.load(ckpt)
    model = worker_module("stage_worker").whole_model().state_dict()
    layers = {k: v for k, v in model.items() if k.startswith("layers.")}
    assert sorted(whole["model"]) == sorted(layers)
    assert all(torch.equal(whole["model"][k], v) for k, v in layers.items())


def test_a_stage_killed_as_its_tree_is_joined_loses_nothing_committed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The second save of the same path loses rank 2 (stage 1's first rank) at
    # the step only union saves have: every survivor fails naming it, and the
    # first save's checkpoint stays, whole.
    ckpt = tmp_path / "ckpt"
    monkeypatch.setenv("FASTPERSIST_DIST_TIMEOUT", "5")
    reports = run_ranks(WORKER, "die_joining", tmp_path / "out", 4, {"path": str(ckpt)})
    assert not (tmp_path / "out" / "rank-2.json").exists()  # killed before it reported
    for r in (reports[0], reports[1], reports[3]):
        assert "DistributedCheckpointError" in r.get("error", "") and "rank 2 died" in r["error"]
        assert "nothing was committed" in r["error"], r
    kept = fastpersist.load(ckpt)
    assert kept["step"] == 7 and len(kept["model"]) == 9
    assert fpctl(["verify", str(ckpt)]) == 0  # every file and CRC32C of it
    assert list(tmp_path.glob(".ckpt.fp-*")) == [], "staging directory left behind"


def test_node_local_stages_gather_into_their_union(tmp_path: Path) -> None:
    # Each node keeps the files its ranks wrote (one replica of each stage on
    # each node); fpctl gather makes one checkpoint of the stages' union.
    base = tmp_path / "disks"
    reports = run_ranks(WORKER, "node_local", tmp_path / "out", 4,
                        {"path": str(base / "{node}" / "ckpt")})
    ok(reports)
    assert fpctl(["gather", str(base / "a" / "ckpt"), str(base / "b" / "ckpt"),
                  "--to", str(tmp_path / "gathered")]) == 0
    held = worker_module("stage_worker").digests(fastpersist.load(tmp_path / "gathered"))
    for r in reports:  # every value of every rank's state, as that rank held it
        assert {k: held.get(k) for k in r["digests"]} == r["digests"], r["rank"]


def test_an_index_keyed_optimizer_on_each_stage_is_refused_on_every_rank(tmp_path: Path
                                                                        ) -> None:
    ckpt = tmp_path / "ckpt"
    reports = run_ranks(WORKER, "indexed", tmp_path / "out", 4, {"path": str(ckpt)})
    for r in reports:
        assert "keyed by parameter index" in r.get("error", ""), r
    assert not ckpt.exists() and [p.name for p in tmp_path.iterdir()] == ["out"]


def test_stages_without_union_are_refused_with_a_hint(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    reports = run_ranks(WORKER, "no_union", tmp_path / "out", 4, {"path": str(ckpt)})
    for r in reports:
        assert "disagree" in r.get("error", "") and "union=True" in r["error"], r
    assert not ckpt.exists()


def test_stages_save_their_union_through_the_daemon(daemon: Any, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    # Each rank hands its part to fastpersistd, which checks the job manifest
    # (the stages' union) against the parts before it commits.
    ckpt = daemon.root / "pp" / "ckpt"
    monkeypatch.setenv("FASTPERSIST_DAEMON", daemon.address)
    reports = run_ranks(WORKER, "save", tmp_path / "out", 4, {"path": str(ckpt)})
    ok(reports)
    assert [r["differs"] for r in reports] == [[]] * 4
    assert sorted(e["rank"] for e in daemon.events("part-written")) == [0, 1, 2, 3]
    assert len(daemon.events("committed-job")) == 1
    assert sorted(fastpersist.load(ckpt)["model"])[0] == "embed.weight"
