"""Distributed saves through fastpersistd: each rank hands its part to its node's
daemon, and the job is committed there once (proto/fastpersist.proto: BeginJob,
Begin with a job_id, CommitJob, AbortJob).

The jobs are real gloo processes (dist_support.run_job) and the daemons real
daemon processes (daemon_support.Daemon); the job-manifest checks are driven
from this process with the storage layer the ranks use.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from daemon_support import Daemon, is_lock_file, root_entries
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

import fastpersist
from fastpersist._version import __version__
from fastpersist.cli import main as fpctl
from fastpersist.distributed.storage import Records, ThroughDaemon
from fastpersist.errors import CheckpointNotFoundError, DaemonError
from fastpersist.format.manifest import (
    DISTRIBUTED_SCHEMA_VERSION,
    Chunk,
    FileRecord,
    GlobalTensor,
    Manifest,
    TensorRecord,
)
from fastpersist.saving.files import StagedFiles
from fastpersist.saving.snapshot import stage_file
from fastpersist.tensors import state
from fastpersist.tensors.checkpoint import read_manifest
from fastpersist.tensors.plan import StoredTensor

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(),
                                reason="torch without distributed")


def _daemon(workdir: Path, *args: str, **kwargs: Any) -> Daemon:
    workdir.mkdir(parents=True, exist_ok=True)
    return Daemon(workdir, *args, **kwargs).start()


def _node_env(daemons: dict[str, Daemon]) -> dict[str, dict[str, str]]:
    """Each simulated node's ranks talk to that node's daemon."""
    return {n: {"FASTPERSIST_DAEMON": d.address, "FASTPERSIST_SHM_DIR": str(d.shm_dir)}
            for n, d in daemons.items()}


def _hidden(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir()
                  if p.name.startswith(".") and not is_lock_file(p.name))


def _segments(d: Daemon) -> list[str]:
    return sorted(p.name for p in d.shm_dir.iterdir())


def test_dp4_through_the_daemon_writes_parts_and_commits_once(daemon: Daemon,
                                                              tmp_path: Path) -> None:
    ckpt = daemon.root / "shared" / "ckpt"
    reports = run_job(tmp_path, "save", ["n0", "n0", "n1", "n1"],
                      {"path": str(ckpt), "saves": 2},
                      env={"FASTPERSIST_DAEMON": daemon.address})
    ok(reports)
    # The daemon wrote every rank's part, twice, and committed each job once.
    assert sorted(e["rank"] for e in daemon.events("part-written")) == [0, 0, 1, 1, 2, 2, 3, 3]
    assert len(daemon.events("committed-job")) == 2
    assert daemon.events("committed") == []  # no part was published on its own
    per_rank = data_bytes_by_rank(ckpt)
    unique = unique_bytes(tp=False)
    assert sum(per_rank.values()) == unique and sorted(per_rank) == [0, 1, 2, 3]
    assert all(abs(n - unique / 4) / (unique / 4) < 0.05 for n in per_rank.values()), per_rank
    assert _hidden(ckpt.parent) == [], "staging left"
    assert _segments(daemon) == [], "the ranks left shared-memory segments"
    check_loaded(describe_here(fastpersist.load(ckpt)), tp=False)
    assert fpctl(["verify", str(ckpt)]) == 0


def test_parts_the_daemon_has_no_staging_room_for_are_streamed(tmp_path: Path) -> None:
    """Each rank's part is over what the daemon lets one client stage: Open
    refuses it (RESOURCE_EXHAUSTED) and the rank streams the same bytes from
    its staging buffers instead of failing the job."""
    d = _daemon(tmp_path / "daemon", "--client-budget", "64K")
    try:
        ckpt = d.root / "ckpt"
        reports = run_job(tmp_path, "save", ["n0", "n0"], {"path": str(ckpt)},
                          env={"FASTPERSIST_DAEMON": d.address,
                               "FASTPERSIST_SHM_DIR": str(d.shm_dir)})
        ok(reports)
        assert sorted(e["rank"] for e in d.events("part-written")) == [0, 1]
        check_loaded(describe_here(fastpersist.load(ckpt)), tp=False)
        assert fpctl(["verify", str(ckpt)]) == 0
        assert _segments(d) == [], "the ranks left shared-memory segments"
    finally:
        d.cleanup()


@pytest.mark.parametrize("compression", [None, "zstd"])
def test_a_part_over_the_staging_budget_goes_through_in_windows(
        daemon: Daemon, tmp_path: Path, compression: str | None) -> None:
    # Each rank staged its whole part in shared memory (about 1.8 MB here),
    # whatever FASTPERSIST_STAGING_BUDGET and the daemon's budgets said (issue 37).
    budget = 256 << 10
    ckpt = daemon.root / "shared" / "w"
    reports = run_job(tmp_path, "windowed", ["n0", "n0"],
                      {"path": str(ckpt), "compression": compression},
                      env={"FASTPERSIST_DAEMON": daemon.address,
                           "FASTPERSIST_STAGING_BUDGET": str(budget)})
    ok(reports)
    assert unique_bytes(tp=False) // 2 > 4 * budget
    for r in reports:
        assert r["staging_peak"] <= budget, (r["rank"], r["staging_peak"])
    # Compressed, a piece over a third of the budget goes unstaged (as in
    # test_distributed): a rank whose run of the plan is all such stages nothing.
    staged = [r["staging_peak"] > 0 for r in reports]
    assert all(staged) if compression is None else any(staged), reports
    for name in ("async", "blocking"):
        check_loaded(describe_here(fastpersist.load(ckpt / name)), tp=False)
        assert fpctl(["verify", str(ckpt / name)]) == 0
    assert _hidden(ckpt) == [] and _segments(daemon) == []


def test_a_compressed_job_is_packed_by_the_daemon(daemon: Daemon, tmp_path: Path) -> None:
    ckpt = daemon.root / "shared" / "ckpt"
    ok(run_job(tmp_path, "save", ["n0", "n0", "n1", "n1"],
               {"path": str(ckpt), "compression": "zstd"},
               env={"FASTPERSIST_DAEMON": daemon.address}))
    assert sorted(e["rank"] for e in daemon.events("part-written")) == [0, 1, 2, 3]
    data = sorted(p.name for p in ckpt.iterdir() if p.name != "manifest.json")
    assert len(data) >= 4 and all(n.endswith(".fpz") for n in data), data
    assert sum(data_bytes_by_rank(ckpt).values()) == unique_bytes(tp=False)
    assert _hidden(ckpt.parent) == [] and _segments(daemon) == []
    check_loaded(describe_here(fastpersist.load(ckpt)), tp=False)
    assert fpctl(["verify", str(ckpt)]) == 0


def test_a_copy_failing_mid_part_fails_the_job_everywhere(daemon: Daemon,
                                                          tmp_path: Path) -> None:
    """Rank 1's third file cannot be copied into shared memory: every rank
    fails the save, nothing is committed, no segment stays."""
    ckpt = daemon.root / "shared" / "ckpt"
    ckpt.parent.mkdir(parents=True)
    reports = run_job(tmp_path, "fail_copy", ["n0", "n0"],
                      {"path": str(ckpt), "fail_rank": 1, "call": 3},
                      env={"FASTPERSIST_DAEMON": daemon.address,
                           "FASTPERSIST_FILE_BYTES": str(256 << 10)})
    assert {r.get("error_type") for r in reports} == {"DistributedCheckpointError"}, reports
    assert "rank 1 (write)" in reports[0]["error"] and "Bad address" in reports[0]["error"], (
        reports[0]["error"])
    assert not ckpt.exists() and _hidden(ckpt.parent) == []
    assert daemon.events("aborted-job")
    assert _segments(daemon) == [], "the ranks left shared-memory segments"


def test_shared_storage_with_a_daemon_per_node(tmp_path: Path) -> None:
    """Two nodes' daemons on one (shared) root: node n1's daemon joins the job
    that rank 0's daemon began, writes its ranks' parts, and only rank 0's
    daemon commits."""
    root = tmp_path / "shared"
    # Each node's daemon locks the root for its node (rootlock.py).
    daemons = {n: _daemon(tmp_path / f"daemon-{n}", root=root, env={"FASTPERSIST_NODE": n})
               for n in ("n0", "n1")}
    try:
        ckpt = root / "ckpt"
        ok(run_job(tmp_path, "save", ["n0", "n0", "n1", "n1"], {"path": str(ckpt)},
                   env_by_node=_node_env(daemons)))
        for n, ranks in (("n0", [0, 1]), ("n1", [2, 3])):
            assert sorted(e["rank"] for e in daemons[n].events("part-written")) == ranks
        assert len(daemons["n0"].events("committed-job")) == 1
        assert daemons["n1"].events("committed-job") == []
        assert sum(data_bytes_by_rank(ckpt).values()) == unique_bytes(tp=False)
        check_loaded(describe_here(fastpersist.load(ckpt)), tp=False)
        assert _hidden(root) == [] and sorted(p.name for p in ckpt.iterdir() if
                                              p.name.startswith(".")) == []
    finally:
        for d in daemons.values():
            d.cleanup()


def test_node_local_each_node_through_its_own_daemon(tmp_path: Path) -> None:
    daemons = {n: _daemon(tmp_path / f"daemon-{n}", root=tmp_path / "disks" / n)
               for n in ("a", "b")}
    try:
        reports = run_job(
            tmp_path, "save", ["a", "a", "b", "b"],
            {"path": str(tmp_path / "disks" / "{node}" / "ckpt"), "node_local": True},
            env_by_node=_node_env(daemons))
        ok(reports)
        held = {}
        for node, d in daemons.items():
            assert len(d.events("part-written")) == 2  # its own node's two ranks
            # Rank 0's node commits the job; b prepares its part, then publishes it.
            if node == "a":
                assert len(d.events("committed-job")) == 1
            else:
                assert [e["path"] for e in d.events("prepared-job")] == ["ckpt"]
                assert [e["path"] for e in d.events("published-prepared")] == ["ckpt"]
            ck = d.root / "ckpt"
            mine = {f.name for f in read_manifest(ck).files if f.node == node}
            assert {p.name for p in ck.iterdir()} == mine | {"manifest.json"}
            held[node] = sum(f.stat().st_size for f in ck.iterdir() if f.name in mine)
        unique = unique_bytes(tp=False)
        assert all(abs(n - unique / 2) / (unique / 2) < 0.06 for n in held.values()), held
        assert fpctl(["gather", str(daemons["a"].root / "ckpt"), str(daemons["b"].root / "ckpt"),
                      "--to", str(tmp_path / "gathered")]) == 0
        check_loaded(describe_here(fastpersist.load(tmp_path / "gathered")), tp=False)
    finally:
        for d in daemons.values():
            d.cleanup()


@pytest.mark.parametrize("fail_rank", [2, 0], ids=["other-node-first", "rank0-last"])
def test_a_failed_job_commit_leaves_nothing_on_any_node(tmp_path: Path, fail_rank: int) -> None:
    """Node-local through two daemons: node b prepares its part of the job
    before rank 0's node commits. If b's prepare fails, a's job is aborted; if
    rank 0's commit fails after b prepared, b's daemon discards the part."""
    daemons = {n: _daemon(tmp_path / f"daemon-{n}", root=tmp_path / "disks" / n)
               for n in ("a", "b")}
    try:
        reports = run_job(
            tmp_path, "fail_commit", ["a", "a", "b", "b"],
            {"path": str(tmp_path / "disks" / "{node}" / "ckpt"), "node_local": True,
             "fail_rank": fail_rank},
            env_by_node=_node_env(daemons))
        assert {r.get("error_type") for r in reports} == {"DistributedCheckpointError"}, reports
        step = "commit" if fail_rank == 0 else "prepare"
        assert f"rank {fail_rank} ({step})" in reports[0]["error"], reports[0]["error"]
        for node, d in daemons.items():
            assert root_entries(d.root) == [], f"node {node}: {os.listdir(d.root)}"
        if fail_rank == 0:
            assert daemons["b"].events("prepared-job")
            assert daemons["b"].events("discarded-prepared")
        else:
            assert daemons["a"].events("aborted-job")
    finally:
        for d in daemons.values():
            d.cleanup()


def test_the_torchrun_example_runs_through_the_daemon(daemon: Daemon, tmp_path: Path) -> None:
    """docs/guides/distributed.md: FASTPERSIST_DAEMON=... torchrun ... dist_train.py (2 ranks)."""
    example = Path(__file__).parent.parent / "examples" / "dist_train.py"
    out = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
         "--master-port", str(free_port()), str(example), "--root", str(daemon.root / "ck"),
         "--steps", "4", "--every", "2"],
        capture_output=True, text=True, timeout=300,
        env=dict(os.environ, OMP_NUM_THREADS="1", FASTPERSIST_DAEMON=daemon.address))
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "bit-exact on all: True" in out.stdout, out.stdout
    assert "checkpoints kept: [2, 3]" in out.stdout, out.stdout
    assert len(daemon.events("committed-job")) == 3  # steps 0, 2 and the last, 3
    assert _segments(daemon) == []


def test_async_save_and_checkpointer_through_the_daemon(daemon: Daemon, tmp_path: Path) -> None:
    root = daemon.root
    reports = run_job(tmp_path, "async", ["n0", "n0", "n1", "n1"], {"path": str(root)},
                      env={"FASTPERSIST_DAEMON": daemon.address})
    ok(reports)
    assert all(r["steps"] == [1, 2] for r in reports), reports
    assert len(daemon.events("committed-job")) == 4  # single + three steps
    # The Checkpointer's `latest` and retention went with each job's commit, and
    # the daemon applied them (it owns its root; the ranks need read access only).
    applied = daemon.events("after-commit")
    assert [e["path"] for e in applied] == [f"run/step-{s:08d}" for s in range(3)], applied
    assert all(e["latest"] for e in applied) and applied[-1]["deleted"] == ["step-00000000"]
    assert (root / "run" / "latest").read_text() == "step-00000002\n"
    # The state when each call returned, not the later scribbles.
    check_loaded(describe_here(fastpersist.load(root / "single")), tp=False)
    loaded = fastpersist.load(root / "run" / "step-00000002")
    expected = full_tensors()
    for k, t in expected.items():
        assert torch.equal(loaded["model"][k], t + 2), k
    assert _segments(daemon) == []


def test_a_rank_killed_after_its_hand_over_fails_the_job_and_leaves_nothing(
        daemon: Daemon, tmp_path: Path) -> None:
    """Rank 1 dies once the daemon holds its part: the daemon finishes the part,
    rank 0 fails after the timeout and drops the job; nothing is visible."""
    ckpt = daemon.root / "ckpt"
    reports = run_job(tmp_path, "die_handed_over", ["n0", "n0"],
                      {"path": str(ckpt), "die_ranks": [1]},
                      env={"FASTPERSIST_DAEMON": daemon.address,
                           "FASTPERSIST_DIST_TIMEOUT": "5"})
    assert reports[1].get("missing") and reports[1]["returncode"] == -9
    assert reports[0]["error_type"] == "DistributedCheckpointError", reports[0]
    assert "rank 1 died" in reports[0]["error"], reports[0]
    assert list(reports[0]["failures"]) == ["1"], reports[0]
    assert not ckpt.exists() and _hidden(daemon.root) == []
    assert [e["job"] for e in daemon.events("aborted-job")], daemon.log[-2000:]


def test_one_rank_aborting_drops_the_job_in_the_daemon(daemon: Daemon, tmp_path: Path) -> None:
    reports = run_job(tmp_path, "abort", ["n0", "n0"],
                      {"path": str(daemon.root / "run"), "abort_rank": 1},
                      env={"FASTPERSIST_DAEMON": daemon.address})
    ok(reports)
    assert reports[1]["error_type"] == "CheckpointAbortedError", reports[1]
    assert reports[0]["error_type"] == "DistributedCheckpointError", reports[0]
    assert list(reports[0]["failures"]) == ["1"], reports[0]
    assert "aborted the save" in reports[0]["failures"]["1"], reports[0]
    assert daemon.events("aborted-job") and not daemon.events("committed-job")
    assert not (daemon.root / "run").exists() and _hidden(daemon.root) == []


def test_a_job_whose_ranks_all_died_is_dropped_after_the_idle_timeout(tmp_path: Path) -> None:
    """Every rank dies after handing its part over: no rank is left to commit
    the job (only the ranks together have its manifest), so the daemon finishes
    the parts, then removes the job's directory after --idle-timeout."""
    d = _daemon(tmp_path / "daemon", "--idle-timeout", "1")
    try:
        ckpt = d.root / "ckpt"
        reports = run_job(tmp_path, "die_handed_over", ["n0", "n0"],
                          {"path": str(ckpt), "die_ranks": [0, 1]},
                          env={"FASTPERSIST_DAEMON": d.address,
                               "FASTPERSIST_SHM_DIR": str(d.shm_dir)})
        assert all(r.get("missing") and r["returncode"] == -9 for r in reports), reports
        deadline = time.monotonic() + 30
        while _hidden(d.root) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert _hidden(d.root) == [] and not ckpt.exists()
        assert len(d.events("part-written")) == 2  # handed over: finished all the same
        assert d.events("idle-abort-job"), d.log[-2000:]
        # The dead ranks' segments are reclaimed too (nobody holds their locks).
        deadline = time.monotonic() + 10
        while _segments(d) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert _segments(d) == []
    finally:
        d.cleanup()


def test_a_job_stays_while_other_daemons_write_into_it(tmp_path: Path) -> None:
    """On shared storage the parts of other nodes are written by their daemons:
    files changing in the job's directory keep it alive past --idle-timeout."""
    d = _daemon(tmp_path / "daemon", "--idle-timeout", "1")
    storage = ThroughDaemon(d.address)
    try:
        name = storage.stage(d.root / "ckpt").rpartition(":")[0]
        elsewhere = d.root / name / "data-r00001-000.safetensors"  # another node's part
        end = time.monotonic() + 5  # two and a half reaper rounds
        while time.monotonic() < end:
            elsewhere.write_bytes(b"x")
            time.sleep(0.2)
        assert (d.root / name).is_dir() and not d.events("idle-abort-job")
        deadline = time.monotonic() + 15
        while (d.root / name).exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not (d.root / name).exists() and d.events("idle-abort-job")
        assert _hidden(d.root) == []
    finally:
        storage.close()
        d.cleanup()


# --- the job manifest is checked against what the daemon wrote ------------------------------


def _part(storage: ThroughDaemon, target: Path, job: str, rank: int,
          tensors: dict[str, torch.Tensor]) -> Records:
    stored = [StoredTensor(k, "F32", tuple(t.shape), t, t.nbytes) for k, t in tensors.items()]
    nbytes = sum(t.numel() * 4 for t in tensors.values())
    buffer = storage.pool.acquire(nbytes, 0, False)
    return storage.write(target, job, rank,
                         StagedFiles.copied([stage_file(stored, buffer, False)]), None)


def _manifest(records: Records, full: torch.Tensor, rows: list[tuple[str, int]]) -> Manifest:
    """A job manifest for one global tensor `w` stored as row chunks."""
    tree, leaves = state.encode({"w": full}, sharded=True)
    leaves[0].node["e"] = 0
    files = tuple(f for f, _ in records)
    tensors = tuple(t for _, ts in records for t in ts)
    index = {t.name: i for i, t in enumerate(tensors)}
    chunks = tuple(Chunk(index[name], (row, 0)) for name, row in rows)
    return Manifest(files=files, tensors=tensors, tree=tree, fastpersist_version=__version__,
                    created_unix=time.time(), schema_version=DISTRIBUTED_SCHEMA_VERSION,
                    globals=(GlobalTensor("w", "F32", tuple(full.shape), chunks),))


def _retouched(m: Manifest, **changes: Any) -> bytes:
    return Manifest(**{**vars(m), **changes}).to_json()


def test_job_manifests_that_do_not_match_the_directory_are_refused(daemon: Daemon,
                                                                   tmp_path: Path) -> None:
    """Two daemons on one root stand for two nodes on shared storage: the second
    joins the job the first began, by its id; the first checks and commits it."""
    other = _daemon(tmp_path / "other", root=daemon.root, shm_dir=daemon.shm_dir,
                    env={"FASTPERSIST_NODE": "other"})
    first, second = ThroughDaemon(daemon.address), ThroughDaemon(other.address)
    try:
        target = daemon.root / "ckpt"
        full = torch.arange(32, dtype=torch.float32).reshape(8, 4)
        job = first.stage(target)
        records = _part(first, target, job, 0, {"w.0": full[:4].clone()})
        records += _part(second, target, job, 1, {"w.1": full[4:].clone()})
        assert [f.name for f, _ in records] == ["data-r00000-000.safetensors",
                                                 "data-r00001-000.safetensors"]
        good = _manifest(records, full, [("w.0", 0), ("w.1", 4)])
        t0 = good.tensors[0]
        bad_crc = TensorRecord(**{**vars(t0), "crc32c": t0.crc32c ^ 1})
        f0 = good.files[0]
        refused = [
            (b"{not json", "not valid JSON"),
            (_retouched(good, tensors=(bad_crc, *good.tensors[1:])),
             "differs from the one this daemon wrote"),
            (_retouched(good, files=(FileRecord(f0.name, f0.size + 1, f0.data_start,
                                                f0.header_crc32c), good.files[1])),
             "bytes; the manifest says"),
            (_retouched(good, schema_version=1, globals=None), "not a distributed"),
        ]
        for manifest, message in refused:
            with pytest.raises(DaemonError, match=message) as caught:
                first.publish(job, manifest, None)
            assert caught.value.code == "INVALID_ARGUMENT"
        with pytest.raises(DaemonError, match="commit it there"):
            second.publish(job, good.to_json(), None)  # only the daemon that began it
        assert not target.exists()  # nothing refused was published
        first.publish(job, good.to_json(), None)
        assert torch.equal(fastpersist.load(target)["w"], full)
        assert _hidden(daemon.root) == []
        # The joining daemon does not hold the path: the next save of it may start there.
        second.abort(second.stage(target))
    finally:
        first.close()
        second.close()
        other.cleanup()


def test_jobs_refuse_bad_ids_and_calls_out_of_order(daemon: Daemon) -> None:
    storage = ThroughDaemon(daemon.address)
    client = storage.client
    try:
        target = daemon.root / "ckpt"

        def refused(code: str, fn: Any, match: str | None = None) -> None:
            with pytest.raises(DaemonError if code != "NOT_FOUND" else CheckpointNotFoundError,
                               match=match) as caught:
                fn()
            assert code == "NOT_FOUND" or caught.value.code == code

        refused("INVALID_ARGUMENT", lambda: client.begin("ckpt", 4096, 1, job_id="../../etc"),
                "DIRECTORY:SECRET")
        refused("NOT_FOUND", lambda: client.begin(
            "ckpt", 4096, 1, job_id=".ckpt.fp-tmp-1-00000000@nohost:00"))
        refused("NOT_FOUND", lambda: client.commit_job("no-such-job:00", b"{}", ""))
        # Another save's staging directory is not a job, whatever the id says.
        (daemon.root / ".other.fp-tmp-1-abcd1234@elsewhere").mkdir()
        refused("INVALID_ARGUMENT", lambda: client.begin(
            "other", 4096, 1, job_id=".other.fp-tmp-1-abcd1234@elsewhere:00"),
            "not a distributed checkpoint")
        (daemon.root / ".other.fp-tmp-1-abcd1234@elsewhere").rmdir()

        job = storage.stage(target)
        name = job.rpartition(":")[0]
        # The directory's name is visible to all; without the secret it is no job.
        for call in (lambda: client.commit_job(f"{name}:0000", b"{}", ""),
                     lambda: client.abort_job(f"{name}:0000"),
                     lambda: client.begin("ckpt", 4096, 1, job_id=f"{name}:0000")):
            refused("NOT_FOUND", call)
        refused("FAILED_PRECONDITION", lambda: client.begin_job("ckpt"), "in flight")
        refused("INVALID_ARGUMENT", lambda: client.begin("other", 4096, 1, job_id=job),
                "saves ckpt, not")
        # Nested deeper than a JSON parser goes: refused, and the job is still ours.
        refused("INVALID_ARGUMENT", lambda: client.commit_job(job, b"[" * 100_000, ""),
                "nested too deeply|not valid JSON")
        client.begin("ckpt", 4096, 1, job_id=job, rank=3)
        refused("INVALID_ARGUMENT", lambda: client.begin("ckpt", 4096, 1, job_id=job, rank=3),
                "rank 3 already has a part")
        storage.abort(job)
        assert _hidden(daemon.root) == []
        refused("FAILED_PRECONDITION", lambda: client.commit_job(job, b"{}", ""), "aborted")
    finally:
        storage.close()


def test_a_job_commit_that_fails_drops_the_job_and_keeps_what_was_there(daemon: Daemon) -> None:
    """A directory that is not a checkpoint appeared under the name while the
    job ran: the commit refuses to replace it, the job is dropped, and the
    directory is left as it was."""
    storage = ThroughDaemon(daemon.address)
    try:
        target = daemon.root / "ckpt"
        full = torch.ones(4, 4)
        job = storage.stage(target)
        manifest = _manifest(_part(storage, target, job, 0, {"w.0": full}), full, [("w.0", 0)])
        target.mkdir()
        (target / "notes.txt").write_text("mine")
        with pytest.raises(fastpersist.CheckpointExistsError, match="not a fastpersist"):
            storage.publish(job, manifest.to_json(), None)
        assert (target / "notes.txt").read_text() == "mine"
        assert _hidden(daemon.root) == []
        with pytest.raises(DaemonError, match="aborted: commit failed"):
            storage.publish(job, manifest.to_json(), None)
    finally:
        storage.close()


def test_sigterm_drops_a_job_its_ranks_have_not_committed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The daemon finishes the parts it holds, but cannot commit a job without
    its ranks' manifest: on SIGTERM the job's directory goes, nothing is published."""
    d = _daemon(tmp_path / "daemon")
    monkeypatch.setenv("FASTPERSIST_SHM_DIR", str(d.shm_dir))
    storage = ThroughDaemon(d.address)
    try:
        target = d.root / "ckpt"
        job = storage.stage(target)
        _part(storage, target, job, 0, {"w.0": torch.ones(4, 4)})  # durable, not committed
        assert d.stop() == 0
        assert not target.exists() and _hidden(d.root) == []
        assert [e["reason"] for e in d.events("aborted-job")] == ["fastpersistd is shutting down"]
    finally:
        storage.close()
        d.cleanup()


# --- a part's progress stream breaks after its Commit (staging.py's buffer rule) ------------


def _loaded_is(path: Path, n: int) -> None:
    """Holds the state of the scenario's save n: full + 1 + n."""
    loaded = fastpersist.load(path)
    for k, t in full_tensors().items():
        assert torch.equal(loaded["model"][k], t + 1 + n), (path, k)


def test_a_part_whose_stream_broke_after_commit_is_reported_as_the_daemon_ended_it(
        daemon: Daemon, tmp_path: Path) -> None:
    """Rank 1 loses its Watch stream once the daemon holds its part: it asks the
    daemon, learns the part was written, and the job commits; the next save
    (other values) reuses the segments only after that."""
    root = daemon.root / "run"
    reports = run_job(tmp_path, "lost_watch", ["n0", "n0"],
                      {"path": str(root), "lost_rank": 1},
                      env={"FASTPERSIST_DAEMON": daemon.address,
                           "FASTPERSIST_SHM_DIR": str(daemon.shm_dir)})
    ok(reports)
    assert [r["errors"] for r in reports] == [[None, None], [None, None]], reports
    _loaded_is(root / "one", 0)
    _loaded_is(root / "two", 1)


def test_a_part_whose_outcome_nobody_can_tell_quarantines_its_segments(
        daemon: Daemon, tmp_path: Path) -> None:
    """As above, but the daemon cannot be asked: rank 1's part fails with
    DaemonMayStillCommitError, the job fails on every rank and leaves nothing,
    and rank 1's segments of that save are unlinked and never reused."""
    root = daemon.root / "run"
    reports = run_job(tmp_path, "lost_watch", ["n0", "n0"],
                      {"path": str(root), "lost_rank": 1, "unreachable": True},
                      env={"FASTPERSIST_DAEMON": daemon.address,
                           "FASTPERSIST_SHM_DIR": str(daemon.shm_dir)})
    ok(reports)
    for r in reports:
        first, second = r["errors"]
        assert first is not None and "DaemonMayStillCommitError" in first, r
        assert "may still commit" in first, r
        assert second is None, r
    assert not (root / "one").exists() and _hidden(root) == []
    _loaded_is(root / "two", 1)
    lost = reports[1]
    first_segments, second_segments = lost["segments"]
    assert first_segments and second_segments
    assert not set(first_segments) & set(second_segments), "a quarantined segment was reused"
    assert not set(first_segments) & set(lost["segments_left"]), "not unlinked"
