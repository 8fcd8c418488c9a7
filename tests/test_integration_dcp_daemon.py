"""FastPersistWriter through fastpersistd (FASTPERSIST_DAEMON or daemon=): each
rank hands its items to the daemon, the coordinator commits the job there
with dcp_metadata.json beside the manifest (CommitJob's files), and the
checkpoint is the one an in-process save writes. Real daemons, real gloo
ranks; SIGKILL of the trainer at each moment of a save leaves the old
checkpoint or the new one, and the daemon clears what a killed save left.
"""

from __future__ import annotations

import errno
import gc
import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from daemon_support import Daemon, is_lock_file, root_entries
from dist_support import run_ranks
from support import kill_at_hooks
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.planner import WriteItem

import fastpersist
from fastpersist.cli import main as fpctl
from fastpersist.distributed import external
from fastpersist.distributed.storage import ThroughDaemon
from fastpersist.errors import DaemonError
from fastpersist.integrations.dcp import FastPersistReader, FastPersistWriter
from fastpersist.integrations.dcp.blocks import CRC_BLOCK
from fastpersist.integrations.dcp.metadata_json import DCP_METADATA_NAME
from fastpersist.tensors.checkpoint import read_manifest

HELPERS = Path(__file__).parent / "helpers"


@pytest.fixture
def through(daemon: Daemon, monkeypatch: pytest.MonkeyPatch) -> Any:
    """The daemon, as FASTPERSIST_DAEMON: every FastPersistWriter's default."""
    monkeypatch.setenv("FASTPERSIST_DAEMON", daemon.address)
    yield daemon
    external.forget(daemon.address)


def sample(version: float = 0.0) -> dict[str, Any]:
    g = torch.Generator().manual_seed(7)
    return {
        "big": torch.randn(3 * CRC_BLOCK // 4 + 123, generator=g) + version,  # 4 CRC blocks
        "w": torch.randn(64, 32, generator=g).to(torch.bfloat16),
        "steps": torch.arange(10) + int(version),
        "empty": torch.empty(0, 3),
        "meta": {"epoch": int(version), "note": "hi"},
    }


def blank() -> dict[str, Any]:
    return {"big": torch.zeros(3 * CRC_BLOCK // 4 + 123), "w": torch.zeros(64, 32,
                                                                          dtype=torch.bfloat16),
            "steps": torch.zeros(10, dtype=torch.long), "empty": torch.zeros(0, 3),
            "meta": {"epoch": -1, "note": ""}}


def assert_loads_as(path: Path, want: dict[str, Any]) -> None:
    got = blank()
    dcp.load(got, storage_reader=FastPersistReader(path))
    for k, v in want.items():
        assert torch.equal(got[k], v) if isinstance(v, torch.Tensor) else got[k] == v, k


def assert_same_checkpoint(ours: Path, local: Path) -> None:
    """The same files, records and per-block CRC32Cs (computed in the trainer
    from what the daemon reads, checked against its CRC32C of each item)."""
    assert sorted(os.listdir(ours)) == sorted(os.listdir(local))
    fields = sorted((t.name, t.file, t.offset, t.length, t.crc32c)
                    for t in read_manifest(ours).tensors)
    assert fields == sorted((t.name, t.file, t.offset, t.length, t.crc32c)
                            for t in read_manifest(local).tensors)
    info = FastPersistReader(ours).read_metadata().storage_data
    assert info == FastPersistReader(local).read_metadata().storage_data
    assert len(info[next(i for i in info if i.fqn == "big")].block_crcs) == 4


def hidden(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir()
                  if p.name.startswith(".") and not is_lock_file(p.name))


def wait_until(check: Any, timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def test_a_save_through_the_daemon_is_the_checkpoint_an_in_process_save_writes(
        through: Daemon, tmp_path: Path) -> None:
    sd = sample()
    ours, local = through.root / "ckpt", through.root / "local"
    dcp.save(sd, storage_writer=FastPersistWriter(ours))
    dcp.save(sd, storage_writer=FastPersistWriter(local, daemon=""))
    assert [e["path"] for e in through.events("committed-job")] == ["ckpt"]  # the daemon's
    assert sorted(os.listdir(ours)) == [
        "data-r00000-000.safetensors", DCP_METADATA_NAME, "manifest.json"]
    assert_same_checkpoint(ours, local)
    assert_loads_as(ours, sd)
    loaded = fastpersist.load(ours)
    assert torch.equal(loaded["big"], sd["big"]) and torch.equal(loaded["w"], sd["w"])
    assert fpctl(["verify", str(ours)]) == 0
    assert hidden(through.root) == []


def test_files_over_the_staging_limit_are_streamed(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """A rank's items beyond what the daemon lets one client stage (here 8 MiB
    of a 12 MiB file and a small one) go to it over SubmitStream instead of
    being refused; the checkpoint is the same."""
    d = Daemon(tmp_path, "--client-budget", "8M").start()
    monkeypatch.setenv("FASTPERSIST_SHM_DIR", str(d.shm_dir))
    monkeypatch.setenv("FASTPERSIST_FILE_BYTES", str(4 << 20))
    try:
        sd = sample()
        dcp.save(sd, storage_writer=FastPersistWriter(d.root / "ckpt", daemon=d.address))
        dcp.save(sd, storage_writer=FastPersistWriter(d.root / "local", daemon=""))
        assert 0 < external.daemon_jobs(d.address).storage.pool.allocated_bytes <= 8 << 20
        assert len([n for n in os.listdir(d.root / "ckpt") if n.startswith("data-")]) == 2
        assert_same_checkpoint(d.root / "ckpt", d.root / "local")
        assert_loads_as(d.root / "ckpt", sd)
    finally:
        external.forget(d.address)
        d.cleanup()


def test_a_part_the_node_has_no_room_for_is_streamed(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Other clients hold most of the node's staging budget: the daemon refuses
    the part's staged files at Open (RESOURCE_EXHAUSTED), and the rank streams
    them instead."""
    d = Daemon(tmp_path, "--staging-budget", "16M", "--client-budget", "12M").start()
    monkeypatch.setenv("FASTPERSIST_SHM_DIR", str(d.shm_dir))
    monkeypatch.setenv("FASTPERSIST_FILE_BYTES", str(4 << 20))
    other = ThroughDaemon(d.address)
    try:
        _, held = other.client.open("held", 8 << 20, 1)  # 8 of the node's 16 MiB
        sd = {f"t{i}": torch.full((3 << 18,), float(i)) for i in range(3)}  # 3 x 3 MiB
        dcp.save(sd, storage_writer=FastPersistWriter(d.root / "ckpt", daemon=d.address))
        assert external.daemon_jobs(d.address).storage.pool.allocated_bytes >= 9 << 20  # staged
        got = {k: torch.zeros_like(v) for k, v in sd.items()}
        dcp.load(got, storage_reader=FastPersistReader(d.root / "ckpt"))
        assert all(torch.equal(got[k], v) for k, v in sd.items())
        held.cancel()
    finally:
        other.close()
        external.forget(d.address)
        d.cleanup()


def test_files_shared_memory_has_no_room_for_are_streamed(through: Daemon,
                                                          monkeypatch: pytest.MonkeyPatch
                                                          ) -> None:
    """A full shared-memory file system (ENOSPC making a segment) streams the
    file instead of failing the save."""
    pool = external.daemon_jobs(through.address).storage.pool

    def full(nbytes: int, budget: int, pinned: bool, timeout: float | None = None) -> Any:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(pool, "acquire", full)
    target = through.root / "ckpt"
    dcp.save(sample(), storage_writer=FastPersistWriter(target))
    assert pool.allocated_bytes == 0
    assert_loads_as(target, sample())
    assert_same_checkpoint(target, _local_copy(through.root / "local"))


def _local_copy(path: Path) -> Path:
    dcp.save(sample(), storage_writer=FastPersistWriter(path, daemon=""))
    return path


def test_items_that_change_during_the_save_fail_it(through: Daemon,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """The CRC32Cs a rank computes of its large items are checked against the
    daemon's: a difference (here made up) fails the save, which commits nothing."""
    target = through.root / "ckpt"
    dcp.save(sample(1), storage_writer=FastPersistWriter(target))
    real = external.block_crcs

    def skewed(file: Any, block: int) -> dict[str, list[int]]:
        return {name: [c ^ 1 for c in crcs] for name, crcs in real(file, block).items()}

    monkeypatch.setattr(external, "block_crcs", skewed)
    with pytest.raises(CheckpointException, match="differs from this process's"):
        dcp.save(sample(2), storage_writer=FastPersistWriter(target))
    assert_loads_as(target, sample(1))


def test_async_saves_reuse_the_shared_memory_and_leave_nothing(through: Daemon) -> None:
    target = through.root / "ckpt"
    writer = FastPersistWriter(target)
    for version in range(3):
        dcp.async_save(sample(version), storage_writer=writer).result()
        assert_loads_as(target, sample(version))
    pool = external.daemon_jobs(through.address).storage.pool
    assert pool.allocations == 1 and pool.quarantined == 0  # one segment, reused
    assert len(through.events("committed-job")) == 3
    external.forget(through.address)
    assert wait_until(lambda: not list(through.shm_dir.iterdir()))
    assert wait_until(lambda: hidden(through.root) == [])


def test_four_ranks_save_through_the_daemon_and_two_load(through: Daemon,
                                                         tmp_path: Path) -> None:
    path, ref = through.root / "ckpt", tmp_path / "reference.pt"
    args = {"path": str(path), "reference": str(ref), "async": True}
    for report in run_ranks(HELPERS / "dcp_worker.py", "save", tmp_path / "save", 4, args):
        assert report.get("ok"), report
    assert len(through.events("part-written")) == 4  # every rank's part, by the daemon
    assert [e["path"] for e in through.events("committed-job")] == ["ckpt"]
    for report in run_ranks(HELPERS / "dcp_worker.py", "load", tmp_path / "load", 2, args):
        assert report.get("ok"), report
        assert report["bytes_read"] < 0.6 * 8192 * 1024 * 4  # resharded: blocks, not items
    assert fpctl(["verify", str(path)]) == 0
    assert wait_until(lambda: hidden(through.root) == [])


def test_refusals_are_clear_and_leave_nothing(through: Daemon, tmp_path: Path) -> None:
    outside = tmp_path / "elsewhere" / "ckpt"
    with pytest.raises(CheckpointException, match="outside fastpersistd's root"):
        dcp.save(sample(), storage_writer=FastPersistWriter(outside))
    assert not outside.parent.exists()

    target = through.root / "ckpt"
    dcp.save(sample(1), storage_writer=FastPersistWriter(target))
    with pytest.raises(CheckpointException, match="overwrite=False"):
        dcp.save(sample(2), storage_writer=FastPersistWriter(target, overwrite=False))

    # A cached plan would carry the first save's job id: the second save is refused.
    planner = DefaultSavePlanner(enable_plan_caching=True)
    other = through.root / "cached"
    dcp.save(sample(1), storage_writer=FastPersistWriter(other), planner=planner)
    with pytest.raises(CheckpointException, match="cannot use cached plans"):
        dcp.save(sample(2), storage_writer=FastPersistWriter(other), planner=planner)
    assert_loads_as(target, sample(1))
    assert_loads_as(other, sample(1))
    assert hidden(through.root) == []


class _FailingPlanner(DefaultSavePlanner):
    def resolve_data(self, write_item: WriteItem) -> Any:
        if write_item.index.fqn == "w":
            raise RuntimeError("the state cannot be read")
        return super().resolve_data(write_item)


def _save_that_fails(target: Path, address: str) -> None:
    try:
        dcp.save(sample(2), storage_writer=FastPersistWriter(target, daemon=address),
                 planner=_FailingPlanner())
    except CheckpointException as exc:
        assert "the state cannot be read" in str(exc)
    else:
        pytest.fail("the save did not fail")
    gc.collect()  # (the failed writer is gone, as a caller's usually is)


@pytest.mark.parametrize("daemon_mode", [True, False], ids=["daemon", "in-process"])
def test_after_a_failed_save_the_next_one_of_the_path_works(
        daemon: Daemon, daemon_mode: bool) -> None:
    """DCP calls nothing on the writer when a save fails; a new writer of the
    same path clears what the failed one left (the daemon's job, or the
    staging directory) instead of refusing the path for the life of the
    process: from the same thread, and from another (dcp.async_save's) while
    the failed save's thread goes on."""
    address = daemon.address if daemon_mode else ""
    target = daemon.root / "ckpt"
    try:
        dcp.save(sample(1), storage_writer=FastPersistWriter(target, daemon=address))
        _save_that_fails(target, address)
        assert len(hidden(daemon.root)) == 1  # the failed save's job or staging directory
        dcp.save(sample(3), storage_writer=FastPersistWriter(target, daemon=address))
        assert_loads_as(target, sample(3))
        _save_that_fails(target, address)
        dcp.async_save(sample(4), storage_writer=FastPersistWriter(target, daemon=address)
                       ).result()
        assert_loads_as(target, sample(4))
        assert wait_until(lambda: hidden(daemon.root) == [])
    finally:
        external.forget(daemon.address)


class _GatedPlanner(DefaultSavePlanner):
    """Holds the save in write_data until `go` is set."""

    def __init__(self, writing: threading.Event, go: threading.Event) -> None:
        super().__init__()
        self.writing, self.go = writing, go

    def resolve_data(self, write_item: WriteItem) -> Any:
        self.writing.set()
        self.go.wait(60)
        return super().resolve_data(write_item)


def test_a_save_in_progress_keeps_its_path(daemon: Daemon) -> None:
    """While a save of a path runs on another thread, another save of it in
    this process is refused, and the running one is not disturbed."""
    target = daemon.root / "ckpt"
    writing, go = threading.Event(), threading.Event()
    errors: list[BaseException] = []

    def first() -> None:
        try:
            dcp.save(sample(1), storage_writer=FastPersistWriter(target, daemon=""),
                     planner=_GatedPlanner(writing, go))
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=first)
    thread.start()
    try:
        assert writing.wait(60)
        with pytest.raises(CheckpointException, match="is in progress in this process"):
            dcp.save(sample(2), storage_writer=FastPersistWriter(target, daemon=""))
    finally:
        go.set()
        thread.join(60)
    assert not errors, errors
    assert_loads_as(target, sample(1))
    assert hidden(daemon.root) == []


def test_a_job_commit_refuses_files_it_must_not_write(daemon: Daemon) -> None:
    storage = external.daemon_jobs(daemon.address).storage
    try:
        job = storage.stage(daemon.root / "other")
        for files, message in [({"../escape": b"x"}, "cannot write a file named"),
                               ({".hidden": b"x"}, "cannot write a file named"),
                               ({"manifest.json": b"{}"}, "cannot write a file named"),
                               ({"MANIFEST.JSON": b"{}"}, "cannot write a file named"),
                               ({"dcp_metadata.json\n": b"{}"}, "cannot write a file named"),
                               ({"data-r00000-000.safetensors": b""},
                                "cannot write a file named"),
                               ({f"f{i}": b"" for i in range(9)}, "at most 8 files")]:
            with pytest.raises(DaemonError, match=message) as caught:
                storage.publish(job, b"{}", None, files=files)
            assert caught.value.code == "INVALID_ARGUMENT"
        storage.abort(job)
        assert not (daemon.root / "other").exists()
        assert hidden(daemon.root) == []
    finally:
        external.forget(daemon.address)


# A daemon from before CommitJob's files: it would commit without dcp_metadata.json.
_NO_COMMIT_FILES = "import fastpersist.daemon.server as s\ns.FEATURES = []\n"


def test_a_daemon_that_cannot_write_the_metadata_is_refused(tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch
                                                            ) -> None:
    d = Daemon(tmp_path, prelude=_NO_COMMIT_FILES).start()
    monkeypatch.setenv("FASTPERSIST_SHM_DIR", str(d.shm_dir))
    try:
        with pytest.raises(CheckpointException, match="cannot write a DCP checkpoint's metadata"):
            dcp.save(sample(), storage_writer=FastPersistWriter(d.root / "ckpt", daemon=d.address))
        assert root_entries(d.root) == []
        assert not d.events("begin-job")
    finally:
        external.forget(d.address)
        d.cleanup()


# --- SIGKILL of the trainer ---------------------------------------------------------------

# hook -> the version the target holds after the kill
KILLS = {"before_write": 1, "mid_part": 1, "after_write": 1, "before_commit_job": 1,
         "after_commit_job": 2}


def test_sigkill_of_the_trainer_leaves_the_old_or_the_new_checkpoint(tmp_path: Path) -> None:
    d = Daemon(tmp_path / "daemon", "--idle-timeout", "1").start()
    try:
        targets = {hook: d.root / hook / "ckpt" for hook in KILLS}
        for target in targets.values():
            target.parent.mkdir()
        kill_at_hooks({hook: [str(HELPERS / "dcp_kill_saver.py"), str(target), hook, d.address]
                       for hook, target in targets.items()},
                      env=dict(os.environ, FASTPERSIST_SHM_DIR=str(d.shm_dir)))
        for hook, target in targets.items():
            version = KILLS[hook]
            out = {"w": torch.zeros(1 << 20), "big": torch.zeros(3 << 20),
                   "meta": {"version": 0}}
            dcp.load(out, storage_reader=FastPersistReader(target))
            assert out["meta"]["version"] == version, hook
            assert bool((out["w"] == version).all()) and bool((out["big"] == version).all())
            assert fpctl(["verify", str(target)]) == 0
            # The daemon drops the killed save's job (its part's stream broke, or
            # nobody touched it for --idle-timeout): nothing is left beside it.
            assert wait_until(lambda t=target: [p.name for p in t.parent.iterdir()] == [
                "ckpt"]), (hook, list(target.parent.iterdir()))
        assert wait_until(lambda: not list(d.shm_dir.iterdir()))  # the dead's segments too
        assert d.events("idle-abort-job"), d.log[-2000:]
    finally:
        d.cleanup()


def test_async_save_with_the_process_executor_through_the_daemon(through: Daemon,
                                                                   tmp_path: Path) -> None:
    """DCP's save process begins, writes and commits the job itself (the pickled
    writer keeps the daemon's address); each save replaces the last."""
    path, ref = through.root / "ckpt", tmp_path / "reference.pt"
    args = {"path": str(path), "reference": str(ref), "executor": "process", "saves": 2}
    for report in run_ranks(HELPERS / "dcp_worker.py", "save", tmp_path / "save", 2, args):
        assert report.get("ok"), report
    assert [e["path"] for e in through.events("committed-job")] == ["ckpt", "ckpt"]
    loaded, reference = fastpersist.load(path), torch.load(ref, weights_only=False)
    for k, v in reference.items():
        if isinstance(v, torch.Tensor):
            assert torch.equal(loaded[k], v), k
    assert wait_until(lambda: hidden(through.root) == [])
    assert wait_until(lambda: not list(through.shm_dir.iterdir()))  # the save processes' too
