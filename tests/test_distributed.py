"""Distributed save and load across torch.distributed (gloo) processes on this machine.

Each test starts real rank processes (tests/helpers/dist_worker.py); "nodes"
are simulated with FASTPERSIST_NODE, and node-local storage with a directory
per node.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from dist_support import (
    check_loaded,
    data_bytes_by_rank,
    describe_here,
    free_port,
    full_tensors,
    ok,
    run_job,
    unique_bytes,
)
from support import assert_loaded_into, zeros_like_state

import fastpersist
from fastpersist.cli import main as fpctl
from fastpersist.tensors.checkpoint import read_manifest

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(),
                                reason="torch without distributed")


# --- pure data parallelism on shared storage ----------------------------------------------


def test_dp4_writes_each_unique_byte_once_balanced_and_restores_anywhere(tmp_path: Path) -> None:
    ckpt = tmp_path / "shared" / "ckpt"
    reports = run_job(tmp_path, "save", ["n0", "n0", "n1", "n1"],
                      {"path": str(ckpt), "saves": 2})
    ok(reports)
    # The second save reused the cached plan on every rank.
    assert [r["plans_made"] for r in reports] == [1, 1, 1, 1]
    per_rank = data_bytes_by_rank(ckpt)
    unique = unique_bytes(tp=False)
    assert sum(per_rank.values()) == unique  # each unique byte exactly once
    assert sorted(per_rank) == [0, 1, 2, 3]
    quarter = unique / 4
    assert all(abs(n - quarter) / quarter < 0.05 for n in per_rank.values()), per_rank
    nodes = {0: per_rank[0] + per_rank[1], 1: per_rank[2] + per_rank[3]}
    assert all(abs(n - unique / 2) / (unique / 2) < 0.05 for n in nodes.values()), nodes
    # The plan's bytes are what landed on disk.
    assert {int(k): v for k, v in reports[0]["plan_bytes"].items()} == per_rank
    # Ranks other than 0 get their share of the plan, not the plan, and no
    # manifest: what each receives stays small however many ranks and tensors.
    assert [r["cached"] for r in reports] == ["Plan", "Share", "Share", "Share"], reports
    assert all(r["largest_received"] < 2048 for r in reports[1:]), \
        [r["largest_received"] for r in reports]
    # One layout (pure data parallelism): rank 0 plans from its own items, and
    # no other rank sends it theirs.
    assert [r["items_sent"] for r in reports] == [0, 0, 0, 0], reports
    assert not any("different values" in r["log"] for r in reports)  # replicas agreed
    on_disk = sum(f.stat().st_size for f in ckpt.iterdir())
    assert on_disk - unique < 64 << 10, "more than data + headers + manifest on disk"
    assert not [p for p in ckpt.parent.iterdir() if p.name.startswith(".")], "staging left"

    # Restore: one process (full tensors), and jobs of 2 and 4 ranks.
    loaded = fastpersist.load(ckpt)
    check_loaded(describe_here(loaded), tp=False)
    into = zeros_like_state(loaded)  # into=: the same values, in the caller's tensors
    assert_loaded_into(loaded, fastpersist.load(ckpt, into=into), into)
    for world in (2, 4):
        for report in run_job(tmp_path, "load", ["n0"] * world, {"path": str(ckpt)}):
            check_loaded(report, tp=False)
    assert fpctl(["verify", str(ckpt)]) == 0
    from fastpersist.cli.inspecting import describe
    info = describe(ckpt, read_manifest(ckpt))
    assert [g["name"] for g in info["globals"]] == [f"model.{k}" for k in (
        "embed", "big", "w1", "b1", "scalar", "empty", "ids")]
    assert info["totals"]["tensors"] > len(info["globals"])  # big ones cut into chunks
    _check_partial_reads(ckpt)
    # fpctl restore: one full torch.save file.
    assert fpctl(["restore", str(ckpt), "--to", str(tmp_path / "full.pt")]) == 0
    check_loaded(describe_here(torch.load(tmp_path / "full.pt")), tp=False)


def _check_partial_reads(ckpt: Path) -> None:
    """A box of a global tensor is built from the chunks that overlap it, and
    only those are read."""
    from fastpersist.distributed import restore
    from fastpersist.tensors import checkpoint
    from fastpersist.tensors.source import LocalSource

    m = read_manifest(ckpt)
    assert m.globals is not None
    index = next(i for i, g in enumerate(m.globals) if g.name == "model.embed")
    g = m.globals[index]
    rows = sorted((c.offsets[0], m.tensors[c.tensor].shape[0], c.tensor) for c in g.chunks)
    assert len(rows) >= 4
    # Rows from inside the second chunk to inside the third.
    lo, hi = rows[1][0] + 1, rows[2][0] + 2
    box = ((lo, 0), (hi - lo, g.shape[1]))
    read: list[str] = []
    original = checkpoint.read_tensors

    def spy(path: Path, manifest: Any, *a: Any, **k: Any) -> Any:
        read.extend(t.name for t in manifest.tensors)
        return original(path, manifest, *a, **k)

    checkpoint.read_tensors = spy  # type: ignore[assignment]
    try:
        got = restore.read_boxes(LocalSource(Path(ckpt)), m, {index: box}, verify=True)[index]
    finally:
        checkpoint.read_tensors = original  # type: ignore[assignment]
    assert sorted(read) == sorted(m.tensors[r[2]].name for r in rows[1:3]), read
    assert torch.equal(got, full_tensors()["embed"][lo:hi])


# --- two nodes with node-local disks -------------------------------------------------------


def test_node_local_two_nodes_each_write_half_then_gather(tmp_path: Path) -> None:
    base = tmp_path / "disks"
    reports = run_job(tmp_path, "save", ["a", "a", "b", "b"],
                      {"path": str(base / "{node}" / "ckpt"), "node_local": True})
    ok(reports)
    unique = unique_bytes(tp=False)
    held = {}
    for node in ("a", "b"):
        d = base / node / "ckpt"
        m = read_manifest(d)  # every node's directory carries the job manifest
        mine = [f for f in m.files if f.node == node]
        assert sorted(p.name for p in d.iterdir() if p.name != "manifest.json") == sorted(
            f.name for f in mine)
        held[node] = sum(t.length for t in m.tensors if t.file in {f.name for f in mine})
    assert sum(held.values()) == unique
    assert all(abs(n - unique / 2) / (unique / 2) < 0.05 for n in held.values()), held

    # One node's directory alone cannot give whole tensors: a clear error.
    with pytest.raises(fastpersist.CheckpointNotFoundError, match="fpctl gather"):
        fastpersist.load(base / "a" / "ckpt")
    assert fpctl(["gather", str(base / "a" / "ckpt"), str(base / "b" / "ckpt"),
                  "--to", str(tmp_path / "gathered")]) == 0
    check_loaded(describe_here(fastpersist.load(tmp_path / "gathered")), tp=False)


# --- DP x TP with DTensors, and resharding on load -------------------------------------------


def test_dp2_tp2_dtensors_save_and_reshard(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    reports = run_job(tmp_path, "save", ["n0", "n0", "n1", "n1"],
                      {"path": str(ckpt), "dp": 2, "tp": 2})
    ok(reports)
    # Two layouts (the TP coordinates): rank 0 has one, and only the first
    # rank of the other sends its items; the DP replicas send none.
    assert sum(r["items_sent"] > 0 for r in reports) == 1, [r["items_sent"] for r in reports]
    assert reports[0]["items_sent"] == 0
    per_rank = data_bytes_by_rank(ckpt)
    unique = unique_bytes(tp=True)
    assert sum(per_rank.values()) == unique
    assert all(abs(n - unique / 4) / (unique / 4) < 0.05 for n in per_rank.values()), per_rank
    m = read_manifest(ckpt)
    assert m.globals is not None
    shapes = {g.name: g.shape for g in m.globals}
    assert shapes["tp.rows"] == (64, 48) and shapes["tp.cols"] == (40, 64)

    # One process: every tensor whole, DTensors as their global tensors.
    check_loaded(describe_here(fastpersist.load(ckpt)), tp=True)
    # Two ranks with the opposite sharding (rows column-sharded, cols row-sharded).
    reports = run_job(tmp_path, "load", ["n0", "n0"], {"path": str(ckpt), "like": True})
    for r in reports:
        check_loaded(r, tp=True)
        assert r["tensors"]["tp.rows"]["dtensor"] and r["tensors"]["tp.rows"]["local_equal"]
        assert r["tensors"]["tp.rows"]["local_shape"] == [64, 24]
        assert r["tensors"]["tp.cols"]["local_shape"] == [20, 64]
        assert r["tensors"]["tp.cols"]["local_equal"]
    # And four.
    for r in run_job(tmp_path, "load", ["n0"] * 4, {"path": str(ckpt), "like": True}):
        check_loaded(r, tp=True)
        assert r["tensors"]["tp.rows"]["local_shape"] == [64, 12]


def test_a_compressed_save_packs_each_ranks_files_and_reshards(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    ok(run_job(tmp_path, "save", ["n0", "n0", "n1", "n1"],
                {"path": str(ckpt), "dp": 2, "tp": 2, "compression": "zstd"}))
    data = sorted(p.name for p in ckpt.iterdir() if p.name != "manifest.json")
    assert data and all(n.endswith(".fpz") for n in data), data
    m = read_manifest(ckpt)
    assert any(t.frames is not None for t in m.tensors)
    # Each unique byte still once, counted raw, by the rank that wrote it.
    assert sum(data_bytes_by_rank(ckpt).values()) == unique_bytes(tp=True)
    check_loaded(describe_here(fastpersist.load(ckpt)), tp=True)
    # Resharded: each rank decodes only the frames of the boxes it needs.
    for r in run_job(tmp_path, "load", ["n0", "n0"], {"path": str(ckpt), "like": True}):
        check_loaded(r, tp=True)
        assert r["tensors"]["tp.rows"]["local_equal"] and r["tensors"]["tp.cols"]["local_equal"]
    assert fpctl(["verify", str(ckpt)]) == 0


# --- failures ---------------------------------------------------------------------------


def test_a_failing_rank_fails_the_save_on_every_rank(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    reports = run_job(tmp_path, "fail", ["n0", "n0", "n1", "n1"],
                      {"path": str(ckpt), "fail_rank": 2})
    errors = {r["error"] for r in reports}
    assert len(errors) == 1, errors  # the same error everywhere
    (error,) = errors
    assert all(r["error_type"] == "DistributedCheckpointError" for r in reports)
    assert "rank 2 (write)" in error and "no space left" in error.lower()
    assert all(r["failures"] == {"2": reports[0]["failures"]["2"]} for r in reports)
    assert not ckpt.exists()
    assert list(tmp_path.glob(".ckpt.fp-*")) == [], "staging directory left behind"


def test_a_rank_killed_mid_save_fails_the_others_naming_it(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    # A short timeout: a survivor waiting in an exchange that the others left
    # notices only then (the others do not wait for it).
    reports = run_job(tmp_path, "die", ["n0", "n0", "n1", "n1"],
                      {"path": str(ckpt), "die_rank": 1},
                      env={"FASTPERSIST_DIST_TIMEOUT": "5"}, timeout=120)
    assert reports[1].get("missing") and reports[1]["returncode"] == -9
    survivors = [reports[0], reports[2], reports[3]]
    for r in survivors:
        assert r["ok"] is False and r["error_type"] == "DistributedCheckpointError", r
        assert "rank 1 died" in r["error"] and "nothing was committed" in r["error"], r
        assert list(r["failures"]) == ["1"], r["failures"]
    assert len({r["error"] for r in survivors}) == 1, survivors
    assert not ckpt.exists()
    assert list(tmp_path.glob(".ckpt.fp-*")) == [], "staging directory left behind"


def test_one_rank_aborting_fails_the_save_everywhere_and_leaves_nothing(tmp_path: Path) -> None:
    reports = run_job(tmp_path, "abort", ["n0", "n0", "n1"],
                      {"path": str(tmp_path / "run"), "abort_rank": 1})
    ok(reports)
    assert reports[1]["error_type"] == "CheckpointAbortedError", reports[1]
    for r in (reports[0], reports[2]):
        assert r["error_type"] == "DistributedCheckpointError", r
        assert list(r["failures"]) == ["1"] and "aborted the save" in r["failures"]["1"], r
    assert all(r["steps"] == [] for r in reports)
    # Nothing left: the staging directory went, and with it the parent it had made.
    assert not (tmp_path / "run").exists() and not list(tmp_path.glob(".run*"))


@pytest.mark.parametrize("fail_rank", [2, 0], ids=["other-node-first", "rank0-last"])
def test_a_failed_publish_leaves_nothing_on_any_node(tmp_path: Path, fail_rank: int) -> None:
    """Node-local: node b (rank 2) prepares its part (durable, hidden) before
    rank 0's node commits. If b fails, nothing is published; if rank 0 fails
    after b prepared, b discards its part."""
    base = tmp_path / "disks"
    reports = run_job(tmp_path, "fail_commit", ["a", "a", "b", "b"],
                      {"path": str(base / "{node}" / "ckpt"), "node_local": True,
                       "fail_rank": fail_rank})
    assert {r.get("error_type") for r in reports} == {"DistributedCheckpointError"}, reports
    assert len({r["error"] for r in reports}) == 1
    step = "commit" if fail_rank == 0 else "prepare"
    assert f"rank {fail_rank} ({step})" in reports[0]["error"], reports[0]["error"]
    for node in ("a", "b"):
        left = sorted(os.listdir(base / node)) if (base / node).exists() else []
        assert left == [], f"node {node}: {left}"


def test_ranks_with_different_states_are_refused_on_every_rank(tmp_path: Path) -> None:
    reports = run_job(tmp_path, "mismatch", ["n0", "n0", "n1"],
                      {"path": str(tmp_path / "ckpt"), "odd_rank": 2})
    assert {r.get("error_type") for r in reports} == {"DistributedCheckpointError"}, reports
    assert len({r["error"] for r in reports}) == 1
    assert "rank 0 (plan)" in reports[0]["error"] and "rank 2 and rank 0 disagree" in (
        reports[0]["error"]), reports[0]["error"]
    assert not (tmp_path / "ckpt").exists() and not list(tmp_path.glob(".ckpt.fp-*"))


def test_values_that_differ_between_ranks_are_reported_once(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    reports = run_job(tmp_path, "save", ["n0", "n0", "n1"],
                      {"path": str(ckpt), "saves": 2, "per_rank_values": True})
    ok(reports)
    warning = "the ranks hold different values for 2 key(s) that a job checkpoint stores once"
    assert reports[0]["log"].count(warning) == 1, reports[0]["log"]  # two saves, one report
    assert "rank_note, rng." in reports[0]["log"]
    assert all(warning not in r["log"] for r in reports[1:])
    loaded = fastpersist.load(ckpt)
    assert loaded["rank_note"] == 0  # rank 0's non-tensor values
    assert loaded["rng"].tolist() in ([0, 7], [1, 7], [2, 7])  # one rank's copy


def test_ranks_that_share_storage_must_name_one_path(tmp_path: Path) -> None:
    reports = run_job(tmp_path, "save", ["n0", "n1"], {"path": str(tmp_path / "ck-{node}")})
    assert all(r["ok"] is False for r in reports)
    assert all("shares its storage" in r["error"] for r in reports), reports
    assert not list(tmp_path.glob("ck-*")) and not list(tmp_path.glob(".ck-*"))


# --- async_save and Checkpointer -------------------------------------------------------------


def test_keep_best_over_a_process_group(tmp_path: Path) -> None:
    reports = run_job(tmp_path, "keep_best", ["n0", "n0", "n1", "n1"], {"path": str(tmp_path)})
    ok(reports)
    assert all(r["steps"] == [1, 3] for r in reports), reports  # the best, the newest
    assert all("do not give (given: none)" in r["missing"] for r in reports), reports
    recorded = json.loads((tmp_path / "metrics.json").read_text())["steps"]
    assert recorded["1"] == {"val_loss": 0.1} and set(recorded) <= {"0", "1", "2", "3"}


def test_async_save_and_checkpointer_over_a_process_group(tmp_path: Path) -> None:
    reports = run_job(tmp_path, "async", ["n0", "n0", "n1", "n1"], {"path": str(tmp_path)})
    ok(reports)
    assert all(r["steps"] == [1, 2] for r in reports), reports  # keep_last=2, by rank 0
    assert all(r["latest"] == str(tmp_path / "run" / "step-00000002") for r in reports)
    assert (tmp_path / "run" / "latest").read_text().strip() == "step-00000002"
    # What was saved is the state when each call returned, not the later changes.
    check_loaded(describe_here(fastpersist.load(tmp_path / "single")), tp=False)
    loaded = fastpersist.load(tmp_path / "run" / "step-00000002")
    assert loaded["step"] == 2
    expected = full_tensors()
    expected["tied"] = expected["embed"]
    assert loaded["model"]["tied"] is loaded["model"]["embed"]
    for k, t in loaded["model"].items():
        assert torch.equal(t, expected[k] + 2), k
    assert sum(data_bytes_by_rank(tmp_path / "run" / "step-00000002").values()) == (
        unique_bytes(tp=False))


@pytest.mark.parametrize("compression", [None, "zstd"])
def test_a_share_over_the_staging_budget_is_staged_in_windows(tmp_path: Path,
                                                               compression: str | None) -> None:
    # Each rank's share is about 1.8 MB; every rank staged all of it at once,
    # whatever FASTPERSIST_STAGING_BUDGET said (issue 37).
    budget = 256 << 10
    reports = run_job(tmp_path, "windowed", ["n0", "n0"],
                      {"path": str(tmp_path), "compression": compression},
                      env={"FASTPERSIST_STAGING_BUDGET": str(budget)})
    ok(reports)
    share = unique_bytes(tp=False) // 2
    assert share > 4 * budget
    for r in reports:
        assert r["staging_peak"] <= budget, (r["rank"], r["staging_peak"])
    # Compressed, a piece over a third of the budget is encoded as it is
    # written, unstaged (packed_stream.py): a rank whose run of the plan is
    # all such pieces stages nothing.
    staged = [r["staging_peak"] > 0 for r in reports]
    assert all(staged) if compression is None else any(staged), reports
    for name in ("async", "blocking"):
        check_loaded(describe_here(fastpersist.load(tmp_path / name)), tp=False)
        assert sum(data_bytes_by_rank(tmp_path / name).values()) == unique_bytes(tp=False)


def test_a_rank_killed_mid_window_fails_the_job_and_leaves_nothing(tmp_path: Path) -> None:
    # Rank 1 dies writing its second file while its caller waits for the room
    # that file's write would free; rank 0 has staged and written its share.
    ckpt = tmp_path / "ckpt"
    reports = run_job(tmp_path, "die_windowed", ["n0", "n1"], {"path": str(ckpt), "die_rank": 1},
                      env={"FASTPERSIST_STAGING_BUDGET": str(256 << 10),
                           "FASTPERSIST_DIST_TIMEOUT": "5"}, timeout=120)
    assert reports[1].get("missing") and reports[1]["returncode"] == -9, reports[1]
    r = reports[0]
    assert r["ok"] is False and r["error_type"] == "DistributedCheckpointError", r
    assert "rank 1 died" in r["error"] and "nothing was committed" in r["error"], r
    assert not ckpt.exists()
    assert list(tmp_path.glob(".ckpt.fp-*")) == [], "staging directory left behind"


# --- the schema-3 manifest refuses what does not fit ---------------------------------------


def _embed_record(doc: dict[str, Any]) -> dict[str, Any]:
    """The first tensor record of the global model.embed (its chunks are implied)."""
    return next(t for t in doc["tensors"] if t["name"].startswith("model.embed@"))


@pytest.mark.parametrize("damage, message", [
    (lambda d: _embed_record(d).update(name="model.other@0,0"), "chunks hold"),
    (lambda d: _embed_record(d).update(name="model.embed@10000,0"), "does not fit"),
    (lambda d: d["globals"][0].update(dtype="F16"), "does not fit"),
    (lambda d: d.update(schema_version=2), "may leave it out only from schema version 3"),
    (lambda d: d.update(schema_version=1), "needs schema version 2"),
    (lambda d: d["files"][0].update(node=""), "'node' must be"),
])
def test_malformed_distributed_manifests_are_refused(tmp_path: Path, damage: Any,
                                                     message: str) -> None:
    ckpt = tmp_path / "ckpt"
    ok(run_job(tmp_path, "save", ["n0", "n0"], {"path": str(ckpt)}))
    doc = json.loads((ckpt / "manifest.json").read_text())
    assert doc["schema_version"] == 3 and doc["globals"][0]["name"] == "model.embed"
    assert "chunks" not in doc["globals"][0]  # implied by the records' names
    # cut over the two writers
    assert sum(t["name"].startswith("model.embed@") for t in doc["tensors"]) > 1
    damage(doc)
    (ckpt / "manifest.json").write_text(json.dumps(doc))
    with pytest.raises(fastpersist.ManifestError, match=message):
        fastpersist.load(ckpt)


def test_the_torchrun_example_runs(tmp_path: Path) -> None:
    """docs/guides/distributed.md: torchrun ... examples/dist_train.py (2 ranks here)."""
    example = Path(__file__).parent.parent / "examples" / "dist_train.py"
    out = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
         "--master-port", str(free_port()), str(example), "--root", str(tmp_path / "ck"),
         "--steps", "4", "--every", "2"],
        capture_output=True, text=True, timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "bit-exact on all: True" in out.stdout, out.stdout
    assert "checkpoints kept: [2, 3]" in out.stdout, out.stdout
