"""A distributed save has one outcome on every rank that survives it, and a
node-local save becomes visible only with the job's commit (in-process; the
same through fastpersistd: test_distributed_daemon_outcomes.py).

Real gloo ranks (dist_support.run_job) are SIGKILLed at the bad moments: the
whole job just before or just after rank 0 publishes (the commit point), and
rank 0 alone just after it. The job's c10d store lives either in rank 0's
process (init_process_group's default), so that it dies with rank 0, or
outside every rank, as torchrun's agent hosts it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from dist_support import check_loaded, describe_here, ok, run_job

import fastpersist
from fastpersist.cli import main as fpctl
from fastpersist.distributed import settling
from fastpersist.distributed.outcome import (
    ABANDONED,
    COMMITTED,
    PUBLISHING,
    Ballot,
    ProcessId,
    SaveStore,
    check_in,
    post_mortem,
    this_process,
)
from fastpersist.storage.commit import Staging
from fastpersist.storage.prepared import prepare

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(),
                                reason="torch without distributed")

NODES = ["a", "b"]


def _visible(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if not p.name.startswith(".")) if (
        directory.exists()) else []


def _ls(directory: Path, capsys: pytest.CaptureFixture[str]) -> list[dict[str, Any]]:
    capsys.readouterr()
    assert fpctl(["ls", str(directory), "--json"]) == 0
    return json.loads(capsys.readouterr().out)  # type: ignore[no-any-return]


def _survivors(reports: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in reports if not r.get("missing")]


# --- the pieces, in one process ---------------------------------------------------------


def _store(prefix: str = "t") -> SaveStore:
    return SaveStore(torch.distributed.HashStore(), prefix)


def test_the_first_claim_of_the_ballot_wins() -> None:
    store = _store()
    ballot, other = Ballot(store), Ballot(SaveStore(store.store, "t"))
    assert ballot.claim(PUBLISHING) == PUBLISHING
    assert other.claim(ABANDONED) == PUBLISHING  # rank 0 got there first
    assert other.settle(0) == PUBLISHING  # and is still publishing
    assert other.decide(COMMITTED) == COMMITTED  # found on its storage
    assert ballot.decide(ABANDONED) == COMMITTED  # decided once
    gone = SaveStore(None, "t")
    assert Ballot(gone).claim(ABANDONED) is None and Ballot(gone).settle(1) is None


def test_post_mortem_names_the_dead_rank_or_else_the_silent_one(tmp_path: Path) -> None:
    """Rank 0 (this process) and rank 1 check in; rank 2 exited (a zombie,
    not reaped yet: gone all the same); rank 3 lives but never answers. With
    a dead rank, rank 3 is taken for a survivor still waiting in an exchange
    that the others left; without one, it is the one that hung."""
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    hung = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        deadline = time.monotonic() + 30
        while _proc_state(dead.pid) != "Z" and time.monotonic() < deadline:
            time.sleep(0.05)
        me = this_process()
        # (The dead one's start time does not matter: a zombie has none.)
        processes = [me, me, ProcessId(me.machine, dead.pid, "1"),
                     ProcessId(me.machine, hung.pid, _proc_start(hung.pid))]
        assert processes[2].gone() and processes[3].gone() is False
        store = _store("with-dead")
        check_in(store, "save", 1)
        verdict = post_mortem(store, "save", 0, 4, "commit", "peer closed", processes, 5, 60)
        assert verdict.lost == {2: "died"}
        assert "rank 2 died (noticed in the commit exchange)" in verdict.describe()
        # Every other survivor repeats it.
        again = post_mortem(SaveStore(store.store, "with-dead"), "save", 1, 4, "write", "",
                            processes, 5, 60)
        assert again == verdict

        processes[2] = me  # now nobody died
        store = _store("hung")
        check_in(store, "save", 1)
        check_in(store, "save", 2)
        verdict = post_mortem(store, "save", 0, 4, "write", "timeout", processes, 0.2, 1)
        assert verdict.lost == {3: "is alive but did not answer within 1 s (hung)"}

        # Without a store, what this process sees itself.
        processes[2] = ProcessId(me.machine, dead.pid, "1")
        alone = post_mortem(SaveStore(None, "t"), "save", 0, 4, "write", "", processes, 5, 60)
        assert alone.lost == {2: "died"} and alone.store_gone
    finally:
        hung.kill()
        hung.wait()
        dead.wait()


def _proc_fields(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def _proc_state(pid: int) -> str:
    return _proc_fields(pid)[0]


def _proc_start(pid: int) -> str:
    return _proc_fields(pid)[19]


@pytest.mark.parametrize("by_node, decision", [
    ({"a": {"ckpt": "d"}, "b": {"ckpt": ""}}, "publish"),  # committed on rank 0's node
    ({"a": {"ckpt": "d"}, "b": {"ckpt": "d"}}, "discard"),  # published here already
    ({"a": {"ckpt": ""}, "b": {"ckpt": ""}}, "discard"),  # rank 0's node never committed
    ({"a": {"ckpt": "e"}, "b": {"ckpt": "e"}}, "discard"),  # replaced by a later one
    ({"b": {"ckpt": ""}}, "in doubt"),  # rank 0's node is not in this job
    ({"a": {"ckpt": "?"}, "b": {"ckpt": ""}}, "in doubt"),  # it cannot read its copy
])
def test_settling_decides_a_prepared_part(by_node: dict[str, dict[str, str]],
                                          decision: str) -> None:
    part = settling.Part(".ckpt.fp-prep-1-00@h", "ckpt", "a", "d")
    assert settling.decide(part, by_node, "b") == decision


def test_ls_shows_a_prepared_part_in_doubt_and_gc_keeps_it(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    prepared = prepare(Staging.create(tmp_path / "ckpt"), b"{}", "node-a")
    assert prepared.name.startswith(".ckpt.fp-prep-")
    (entry,) = _ls(tmp_path, capsys)
    assert entry["state"].startswith("in doubt") and "node node-a's copy" in entry["state"]
    capsys.readouterr()
    assert fpctl(["gc", str(tmp_path), "--json"]) == 0
    (result,) = json.loads(capsys.readouterr().out)
    assert result["action"] == "skipped" and prepared.is_dir()


# --- defect 9: a whole-job crash between the other nodes' part and rank 0's commit -----------


@pytest.mark.parametrize("when", ["before", "after"])
def test_a_whole_job_crash_at_the_commit_leaves_nothing_uncommitted_visible(
        tmp_path: Path, when: str, capsys: pytest.CaptureFixture[str]) -> None:
    """Node-local on nodes a (rank 0) and b: every rank is killed just before
    (or just after) rank 0 publishes. Node b's part is durable but hidden (in
    doubt) until the job's next run settles it: removed if rank 0 never
    committed, published if it did."""
    base = tmp_path / "disks"
    args = {"path": str(base / "{node}" / "ckpt"), "node_local": True, "when": when,
            "everyone": True}
    reports = run_job(tmp_path, "die_at_commit", NODES, args)
    assert all(r.get("missing") and r["returncode"] == -9 for r in reports), reports
    assert _visible(base / "a") == ([] if when == "before" else ["ckpt"])
    assert _visible(base / "b") == [], "node b shows a checkpoint the job may not have committed"
    # b holds its part prepared; ls says so, and gc leaves it alone.
    (entry,) = _ls(base / "b", capsys)
    assert entry["state"].startswith("in doubt"), entry
    assert fpctl(["gc", str(base / "b")]) == 0
    assert (base / "b" / entry["name"]).is_dir()

    settled = run_job(tmp_path, "settle", NODES, args)
    ok(settled)
    assert settled[1]["in_doubt"] == []
    if when == "before":
        assert settled[1]["removed"] == ["ckpt"] and settled[1]["promoted"] == []
        assert _visible(base / "b") == [] and os.listdir(base / "b") == []
    else:
        assert settled[1]["promoted"] == ["ckpt"] and settled[1]["removed"] == []
        assert _visible(base / "b") == ["ckpt"]
        assert fpctl(["gather", str(base / "a" / "ckpt"), str(base / "b" / "ckpt"),
                      "--to", str(tmp_path / "gathered")]) == 0
        check_loaded(describe_here(fastpersist.load(tmp_path / "gathered")), tp=False)
    assert all(not e["state"].startswith("in doubt") for e in _ls(base / "b", capsys))


def test_a_failed_commit_keeps_the_other_nodes_previous_checkpoint(tmp_path: Path) -> None:
    """Rank 0's publish fails after node b prepared its part: b's checkpoint of
    the same name from the save before is still there, unchanged."""
    base = tmp_path / "disks"
    args = {"path": str(base / "{node}" / "ckpt"), "node_local": True}
    ok(run_job(tmp_path, "save", NODES, args))
    before = (base / "b" / "ckpt" / "manifest.json").read_bytes()
    reports = run_job(tmp_path, "fail_commit", NODES, {**args, "fail_rank": 0})
    assert {r.get("error_type") for r in reports} == {"DistributedCheckpointError"}, reports
    assert "rank 0 (commit)" in reports[1]["error"]
    assert (base / "b" / "ckpt" / "manifest.json").read_bytes() == before
    assert os.listdir(base / "b") == ["ckpt"]  # and nothing else left


# --- defect 12: lost ranks are named; rank 0 dies right after its commit ------------------


def test_a_hung_rank_is_named(tmp_path: Path) -> None:
    """Rank 1 is stuck in its writes past FASTPERSIST_DIST_TIMEOUT: the others
    give up on it, name it as alive but hung, and commit nothing."""
    ckpt = tmp_path / "ckpt"
    reports = run_job(tmp_path, "hang", ["n0", "n0", "n1"],
                      {"path": str(ckpt), "hang_rank": 1, "seconds": 6},
                      env={"FASTPERSIST_DIST_TIMEOUT": "2"})
    survivors = [reports[0], reports[2]]
    assert len({r.get("error") for r in survivors}) == 1, survivors
    assert survivors[0]["error_type"] == "DistributedCheckpointError", survivors[0]
    assert "rank 1 is alive but did not answer within 2 s (hung)" in survivors[0]["error"]
    assert "nothing was committed" in survivors[0]["error"]
    assert not ckpt.exists()



@pytest.mark.parametrize("store", ["in-rank0", "agent"])
def test_rank0_killed_right_after_its_commit_no_survivor_reports_failure(
        tmp_path: Path, store: str) -> None:
    """Shared storage: the job committed, so every survivor returns (and warns
    that rank 0 died), whether the store died with rank 0 or not."""
    ckpt = tmp_path / "ckpt"
    reports = run_job(tmp_path, "die_at_commit", ["n0", "n0", "n1"],
                      {"path": str(ckpt), "when": "after"}, agent_store=store == "agent")
    assert reports[0].get("missing") and reports[0]["returncode"] == -9
    survivors = _survivors(reports)
    ok(survivors)
    for r in survivors:
        assert any("rank 0 died" in w and "committed" in w for w in r["warnings"]), r
    check_loaded(describe_here(fastpersist.load(ckpt)), tp=False)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".ckpt")]


@pytest.mark.parametrize("store", ["in-rank0", "agent"])
def test_node_local_rank0_killed_right_after_its_commit(tmp_path: Path, store: str) -> None:
    """Node-local: with the store alive every survivor learns that the job
    committed and node b publishes its part; with the store gone with rank
    0, nobody can learn it on node b: every survivor reports the same in-doubt
    error, node b keeps its part hidden, and settling publishes it."""
    base = tmp_path / "disks"
    args = {"path": str(base / "{node}" / "ckpt"), "node_local": True, "when": "after"}
    reports = run_job(tmp_path, "die_at_commit", ["a", "a", "b"], args,
                      agent_store=store == "agent")
    assert reports[0].get("missing") and reports[0]["returncode"] == -9
    survivors = _survivors(reports)
    assert _visible(base / "a") == ["ckpt"]
    if store == "agent":
        ok(survivors)
        assert all(any("rank 0 died" in w for w in r["warnings"]) for r in survivors)
        assert _visible(base / "b") == ["ckpt"]
        return
    assert {r.get("error_type") for r in survivors} == {"DistributedCheckpointError"}, survivors
    assert len({r["error"] for r in survivors}) == 1, survivors
    assert "in doubt" in survivors[0]["error"] and "rank 0 died" in survivors[0]["error"]
    assert _visible(base / "b") == []
    settled = run_job(tmp_path, "settle", NODES, args)
    ok(settled)
    assert settled[1]["promoted"] == ["ckpt"]
    assert _visible(base / "b") == ["ckpt"]
