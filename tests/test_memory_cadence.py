"""Memory-only checkpoints and a Checkpointer's cadences (fastpersist/cadence.py,
daemon/memory.py copy_only, tensors/memory_only.py), with real daemons, real
new interpreters for restarted trainers, and real SIGKILLs.

A memory-only checkpoint is kept by fastpersistd's memory tier alone: nothing
of it is on disk, a restarted trainer on the node restores it, and without the
daemon the newest disk checkpoint is what is left.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from daemon_raw import file_header
from daemon_support import Daemon, root_entries, serving
from test_memory_tier import copies, copy_bytes, digests, state
from tier_support import keys

import fastpersist
from fastpersist import Checkpointer
from fastpersist.cadence import Cadence
from fastpersist.errors import (
    CheckpointExistsError,
    CheckpointNotFoundError,
    DaemonError,
    MemoryTierError,
)

MIB = 1 << 20
REPO = Path(__file__).resolve().parent.parent


@pytest.fixture
def tier(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Daemon]:
    with serving(Daemon(tmp_path, "--memory-tier-count", "32", "--memory-tier-bytes", "256M"),
                 monkeypatch) as d:
        yield d


def run_python(d: Daemon, code: str, *, check: bool = True) -> subprocess.CompletedProcess[str]:
    """`code` in a fresh interpreter (a trainer, or a restarted one)."""
    env = {**os.environ, "FASTPERSIST_SHM_DIR": str(d.shm_dir), "PYTHONPATH": str(REPO)}
    env.pop("FASTPERSIST_DAEMON", None)
    done = subprocess.run([sys.executable, "-W", "error::RuntimeWarning", "-c",
                           "import sys; sys.path.insert(0, 'tests')\n" + code],
                          env=env, cwd=REPO, capture_output=True, text=True, timeout=180)
    if check:
        assert done.returncode == 0, done.stderr
    return done


def restore_code(root: Path, address: str) -> str:
    """A restarted trainer: load_latest, print the step and the digests."""
    return ("import json\nfrom fastpersist import Checkpointer\n"
            "from test_memory_tier import digests\n"
            f"ck = Checkpointer({str(root)!r}, daemon={address!r}, memory_every=1, "
            "disk_every=3)\n"
            "out = ck.load_latest()\n"
            "print(json.dumps({'step': out['step'], 'digests': digests(out)}))\n")


def trainer_code(root: Path, address: str, steps: int, then: str = "ck.close()") -> str:
    return ("from fastpersist import Checkpointer\nfrom test_memory_tier import state\n"
            f"ck = Checkpointer({str(root)!r}, daemon={address!r}, memory_every=1, "
            "disk_every=3)\n"
            f"for s in range({steps}):\n"
            "    f = ck.save(s, state(s))\n"
            f"    if s < {steps - 1}:\n"
            "        f.result()\n"
            f"{then}\n")


# -- the cadences, without a daemon ------------------------------------------------


def test_the_schedule_of_each_step() -> None:
    c = Cadence(memory_every=1, disk_every=4)
    assert [c.durability(s) for s in range(9)] == [
        "disk", "memory", "memory", "memory", "disk", "memory", "memory", "memory", "disk"]
    assert Cadence().durability(7) == "disk"  # no cadence: every save to disk
    sparse = Cadence(memory_every=2, disk_every=6, tier_every=12)
    assert sparse.durability(6) == "disk" and sparse.durability(4) == "memory"
    with pytest.raises(ValueError, match="step 3 is on neither cadence"):
        sparse.durability(3)
    assert sparse.durability(3, "disk") == "disk"  # said explicitly: saved anyway
    assert [s for s in range(0, 40, 6) if sparse.uploads(s)] == [0, 12, 24, 36]


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"memory_every": 1}, "pass daemon="),
    ({"memory_every": 0, "daemon": "unix:///nowhere"}, "memory_every must be"),
    ({"disk_every": -2}, "disk_every must be"),
    ({"disk_every": 2.5}, "disk_every must be"),
    ({"tier_every": 4}, "tier_every= says which disk checkpoints"),
    ({"tier_every": 10, "disk_every": 4, "daemon": "unix:///nowhere"},
     r"tier_every \(10\) must be a multiple of disk_every \(4\)"),
])
def test_settings_that_cannot_work_are_refused(tmp_path: Path, kwargs: dict[str, object],
                                               message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Checkpointer(tmp_path / "ck", **kwargs)  # type: ignore[arg-type]


def test_a_save_says_where_it_cannot_go(tmp_path: Path) -> None:
    with Checkpointer(tmp_path / "ck", disk_every=2) as ck:
        with pytest.raises(ValueError, match="neither cadence"):
            ck.save(1, {"x": torch.ones(2)})
        with pytest.raises(ValueError, match="needs memory_every"):
            ck.save(1, {"x": torch.ones(2)}, durability="memory")
        ck.save(1, {"x": torch.ones(2)}, durability="disk").result()
        assert ck.steps() == [1]


# -- with a daemon ------------------------------------------------------------------


@pytest.mark.slow
def test_each_step_goes_where_its_cadence_says(tier: Daemon) -> None:
    """memory_every=1, disk_every=4: the multiples of 4 on disk (retention
    keep_last=2 counts them only), the rest memory-only with nothing on disk;
    `latest` names the newest disk step; load_latest the newest step of all."""
    root = tier.root / "run"
    with Checkpointer(root, daemon=tier.address, memory_every=1, disk_every=4,
                      keep_last=2) as ck:
        for s in range(11):
            ck.save(s, state(s, mib=0.25)).result()
        assert ck.steps() == [4, 8]  # 0 went by retention; memory saves deleted nothing
        assert ck.memory_steps() == [s for s in range(11) if s % 4]
        # Nothing of a memory-only step is on disk: no directory, no leftover.
        assert root_entries(root) == ["latest", "step-00000004", "step-00000008"]
        assert (root / "latest").read_text().strip() == "step-00000008"
        assert ck.latest() == ck.path_for(10)
        out = ck.load_latest()
        assert out["step"] == 10 and digests(out) == digests(state(10, mib=0.25))
        # fastpersist.load of a memory-only path through the daemon; without it, nothing.
        assert fastpersist.load(ck.path_for(9), daemon=tier.address)["step"] == 9
        with pytest.raises(CheckpointNotFoundError):
            fastpersist.load(ck.path_for(9), daemon="")
    kinds = {e["path"]: e.get("memory_only", False) for e in tier.events("memory-copy")}
    assert kinds == {f"run/step-{s:08d}": s % 4 != 0 for s in range(11)}


@pytest.mark.slow
def test_a_restarted_process_restores_the_newest_memory_only_step(tier: Daemon) -> None:
    root = tier.root / "run"
    run_python(tier, trainer_code(root, tier.address, 5))  # 0, 3 on disk; 1, 2, 4 in memory
    assert root_entries(root) == ["latest", "step-00000000", "step-00000003"]
    out = json.loads(run_python(tier, restore_code(root, tier.address)).stdout)
    assert out == {"step": 4, "digests": digests(state(4))}


@pytest.mark.slow
def test_a_trainer_sigkilled_right_after_a_memory_only_save(tier: Daemon) -> None:
    """save() returned (the daemon owns the snapshot): the trainer kills itself
    with SIGKILL before it learns the outcome; the daemon still holds it."""
    root = tier.root / "run"
    killed = run_python(tier, trainer_code(
        root, tier.address, 5, then="import os, signal; os.kill(os.getpid(), signal.SIGKILL)"),
        check=False)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    out = json.loads(run_python(tier, restore_code(root, tier.address)).stdout)
    assert out == {"step": 4, "digests": digests(state(4))}


@pytest.mark.slow
def test_the_daemon_gone_leaves_the_newest_disk_step(tier: Daemon) -> None:
    """SIGKILL the daemon: its memory-only steps go with it; a restarted
    trainer restores the newest disk step, whole, with the daemon down and
    with a new daemon on the same root (its memory empty)."""
    root = tier.root / "run"
    run_python(tier, trainer_code(root, tier.address, 5))
    tier.kill()
    out = json.loads(run_python(tier, restore_code(root, tier.address)).stdout)
    assert out == {"step": 3, "digests": digests(state(3))}
    again = Daemon(tier.root.parent, "--memory-tier-count", "4", root=tier.root,
                   shm_dir=tier.shm_dir).start()
    try:
        assert not copies(again)  # the dead daemon's copies were swept
        out = json.loads(run_python(again, restore_code(root, again.address)).stdout)
        assert out == {"step": 3, "digests": digests(state(3))}
        assert root_entries(root) == ["latest", "step-00000000", "step-00000003"]
    finally:
        again.kill()


def test_memory_only_needs_the_memory_tier(daemon: Daemon) -> None:
    """The fixture's daemon runs without --memory-tier-count: a memory-only
    save is refused at once, saying how to turn the tier on."""
    with Checkpointer(daemon.root / "run", daemon=daemon.address, memory_every=1,
                      disk_every=2) as ck:
        with pytest.raises(DaemonError, match="--memory-tier-count") as info:
            ck.save(1, state(1, mib=0.1))
        assert info.value.code == "FAILED_PRECONDITION"
        ck.save(2, state(2, mib=0.1)).result()  # disk saves go on
        assert ck.steps() == [2] and ck.memory_steps() == []
    assert root_entries(daemon.root / "run") == ["latest", "step-00000002"]


@pytest.mark.slow
def test_budgets_are_respected(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """--memory-tier-bytes 3M: memory-only copies of 1 MiB evict the oldest
    and never hold more than the budget; one larger than the budget fails
    (MemoryTierError) and leaves the newest disk checkpoint and the copies
    before it as they were."""
    budget = 3 * MIB
    d = Daemon(tmp_path, "--memory-tier-count", "100", "--memory-tier-bytes",
               str(budget)).start()
    monkeypatch.setenv("FASTPERSIST_SHM_DIR", str(d.shm_dir))
    try:
        with Checkpointer(d.root / "run", daemon=d.address, memory_every=1,
                          disk_every=5) as ck:
            for s in range(10):
                ck.save(s, state(s, mib=1)).result()
                assert copy_bytes(d) <= budget
            assert ck.steps() == [0, 5]
            assert ck.memory_steps() == [8, 9]  # two 1 MiB copies (and headers) fit
            with pytest.raises(MemoryTierError, match="--memory-tier-bytes"):
                ck.save(11, state(11, mib=4)).result()
            assert copy_bytes(d) <= budget
            assert ck.steps() == [0, 5]
            out = ck.load_latest()
            assert out["step"] == 9 and digests(out) == digests(state(9, mib=1))
    finally:
        from fastpersist.saving.registry import close_shared

        close_shared(abort=True)
        d.cleanup()


def test_what_the_daemon_refuses_and_lists(tier: Daemon) -> None:
    """Protocol level: no compression, no job, no shadowing a disk checkpoint;
    List lists memory-only checkpoints apart; Delete drops one; a disk save
    at its path replaces it."""
    client = tier.client()
    try:
        with pytest.raises(DaemonError, match="kept raw"):
            client.open("a/x", 4096, 1, compression="zstd", durability="memory")
        # A streamed file is written to disk as it comes: refused for memory-only.
        header, n = file_header([("w", 4)])
        ident, stream = client.open("a/streamed", 0, 1, durability="memory")
        with pytest.raises(DaemonError, match="shared memory only"):
            client.submit_stream(ident, 0, header, n, [b"\x03" * n])
        stream.cancel()
        fastpersist.save(state(1, mib=0.1), tier.root / "a" / "disk", daemon=tier.address)
        with pytest.raises(CheckpointExistsError, match="may not shadow it"):
            client.open("a/disk", 4096, 1, durability="memory")
        ck = Checkpointer(tier.root / "a", daemon=tier.address, memory_every=1, disk_every=10)
        ck.save(3, state(3, mib=0.1)).result()
        ck.save(4, state(4, mib=0.1)).result()
        listed = client.list("a")
        assert [e.name for e in listed.memory_only] == ["step-00000003", "step-00000004"]
        assert {e.state for e in listed.memory_only} == {"memory"}
        assert "step-00000003" not in [e.name for e in listed.entries]
        reply = client.memory_copy("a/step-00000003", timeout=10)
        assert reply.memory_only and reply.directory
        client.delete("a/step-00000003")
        assert ck.memory_steps() == [4]
        ck.save(4, state(40, mib=0.1), durability="disk", overwrite=True).result()
        assert ck.memory_steps() == [] and ck.steps() == [4]
        assert ck.load_latest()["step"] == 40
        ck.close()
    finally:
        client.close()


# -- the object store every M steps -------------------------------------------------


def _stored_steps(s3: object) -> list[str]:
    return sorted(k.split("/")[-2] for k in keys(s3.client, s3.bucket)  # type: ignore[attr-defined]
                  if k.endswith("/manifest.json"))


@pytest.mark.slow
def test_tier_every_uploads_the_multiples_in_process(tmp_path: Path, s3: object) -> None:
    """disk_every=2, tier_every=4: every disk step is local, the multiples
    of 4 alone in the store; a Checkpointer started again on the root (which
    queues what is not uploaded) does not upload the others either."""
    root = tmp_path / "ck"
    url = s3.url  # type: ignore[attr-defined]
    with Checkpointer(root, tier=url, disk_every=2, tier_every=4) as ck:
        for s in range(0, 10, 2):
            ck.save(s, state(s, mib=0.1)).result()
        assert ck.wait_for_tier(60)
    assert [p.name for p in sorted(root.glob("step-*"))] == [
        f"step-{s:08d}" for s in (0, 2, 4, 6, 8)]
    with Checkpointer(root, tier=url, disk_every=2, tier_every=4) as again:
        assert again.wait_for_tier(60)
    assert _stored_steps(s3) == [f"step-{s:08d}" for s in (0, 4, 8)]


@pytest.mark.slow
def test_tier_every_through_the_daemon(tmp_path: Path, s3: object,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """fastpersistd --tier: the Checkpointer's commits say which steps to
    upload (AfterCommit.skip_tier); memory-only steps never go."""
    d = Daemon(tmp_path, "--tier", s3.url, "--memory-tier-count", "8",  # type: ignore[attr-defined]
               "--memory-tier-bytes", "64M").start()
    monkeypatch.setenv("FASTPERSIST_SHM_DIR", str(d.shm_dir))
    try:
        with Checkpointer(d.root / "run", daemon=d.address, memory_every=1, disk_every=2,
                          tier_every=4) as ck:
            for s in range(9):
                ck.save(s, state(s, mib=0.1)).result()
        deadline = time.monotonic() + 60
        while len(d.events("tier-uploaded")) < 3 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert _stored_steps(s3) == [f"step-{s:08d}" for s in (0, 4, 8)]
        assert sorted(e["path"] for e in d.events("tier-not-asked")) == [
            "run/step-00000002", "run/step-00000006"]
    finally:
        from fastpersist.saving.registry import close_shared

        close_shared(abort=True)
        d.cleanup()


# -- memory-only runs, and the spare copy's pages (daemon/memory_copies.py) --------


def test_a_run_kept_in_memory_only_is_listed_and_restored(tier: Daemon) -> None:
    """No disk step yet: the run's directory does not exist, and List still
    lists its memory-only checkpoints."""
    root = tier.root / "fresh"
    with Checkpointer(root, daemon=tier.address, memory_every=1, disk_every=100) as ck:
        for s in range(1, 4):
            ck.save(s, state(s, mib=0.1)).result()
        assert not root.exists()
        assert ck.memory_steps() == [1, 2, 3]
        out = ck.load_latest()
        assert out["step"] == 3 and digests(out) == digests(state(3, mib=0.1))
