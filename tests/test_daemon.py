"""Saving through fastpersistd: the same checkpoint as in-process, every API, several
clients, the daemon's errors, its operations surface (health, metrics, fpctl).

Each test talks to a real daemon process (the `daemon` fixture). Crash behaviour
is in test_daemon_crash.py, hostile input in test_daemon_security.py.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import torch
from daemon_support import Daemon, root_entries
from support import Mounter

import fastpersist
from fastpersist import Checkpointer, DiskFullError
from fastpersist.errors import DaemonError, DaemonUnavailableError
from fastpersist.format.manifest import MANIFEST_NAME

MIB = 1 << 20


def sample_state(seed: int = 0, mib: int = 4) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(mib * MIB // 4, generator=g)
    return {
        "model": {"w": w.view(-1, 256), "b": torch.arange(300, dtype=torch.int64),
                  "h": torch.randn(17, generator=g).to(torch.bfloat16),
                  "tied": w.view(-1, 256)[:4]},
        "opt": {"step": 7, "lr": 1e-3, "betas": (0.9, 0.99), "name": "adamw"},
        "empty": torch.empty(0, 3), "scalar": torch.tensor(2.5),
    }


def assert_same(a: Any, b: Any) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(a, b)
    elif isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b)
        for k in a:
            assert_same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            assert_same(x, y)
    else:
        assert a == b


def manifest_without_time(path: Path) -> dict[str, Any]:
    doc = json.loads((path / MANIFEST_NAME).read_bytes())
    doc.pop("created_unix")
    return dict(doc)


def same_files(a: Path, b: Path) -> None:
    """Same data files byte for byte, same manifest but for its time stamp."""
    names = sorted(p.name for p in a.iterdir())
    assert names == sorted(p.name for p in b.iterdir())
    for name in names:
        if name != MANIFEST_NAME:
            assert (a / name).read_bytes() == (b / name).read_bytes(), name
    assert manifest_without_time(a) == manifest_without_time(b)


def test_save_through_the_daemon_matches_in_process(daemon: Daemon, tmp_path: Path) -> None:
    state = sample_state()
    fastpersist.save(state, daemon.root / "ck", daemon=daemon.address)
    fastpersist.save(state, tmp_path / "local", daemon="")
    same_files(daemon.root / "ck", tmp_path / "local")
    out = fastpersist.load(daemon.root / "ck")
    assert_same(state, out)
    assert out["model"]["tied"].data_ptr() == out["model"]["w"].data_ptr()  # a view stays one
    assert [e["event"] for e in daemon.events()].count("committed") == 1


def test_environment_variable_selects_the_daemon(daemon: Daemon,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FASTPERSIST_DAEMON", daemon.address)
    fastpersist.save({"x": torch.ones(3)}, daemon.root / "a" / "b")
    assert daemon.events("committed")[0]["path"] == "a/b"
    assert torch.equal(fastpersist.load(daemon.root / "a" / "b")["x"], torch.ones(3))


def test_async_save_owns_a_snapshot(daemon: Daemon) -> None:
    state = sample_state(1)
    expected = {k: v.clone() for k, v in state["model"].items()}
    future = fastpersist.async_save(state, daemon.root / "ck", daemon=daemon.address)
    for t in state["model"].values():
        t.add_(1) if t.dtype != torch.int64 else t.mul_(3)  # right after the return
    future.result(timeout=60)
    assert future.snapshot_seconds is not None and future.persist_seconds is not None
    assert_same(expected, fastpersist.load(daemon.root / "ck")["model"])


def test_small_staging_budget_streams_through_several_files(
        daemon: Daemon, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # 4 MiB budget: 2 MiB files, and an 8 MiB tensor too large for any: it goes
    # over SubmitStream while the caller waits.
    monkeypatch.setenv("FASTPERSIST_STAGING_BUDGET", str(4 * MIB))
    state = {f"t{i}": torch.full((MIB // 4,), float(i)) for i in range(6)}
    state["big"] = torch.arange(2 * MIB, dtype=torch.float32)
    fastpersist.async_save(state, daemon.root / "ck", daemon=daemon.address).result(60)
    fastpersist.async_save(state, tmp_path / "local", daemon="").result(60)
    same_files(daemon.root / "ck", tmp_path / "local")
    assert len(list((daemon.root / "ck").glob("data-*"))) >= 4
    assert_same(state, fastpersist.load(daemon.root / "ck"))


def test_checkpointer_through_the_daemon(daemon: Daemon) -> None:
    root = daemon.root / "run"
    with_daemon = Checkpointer(root, keep_last=2, daemon=daemon.address)
    try:
        for step in range(4):
            with_daemon.save(step, {"step": step, "w": torch.full((1000,), float(step))})
        with_daemon.wait()
    finally:
        with_daemon.close()
    assert with_daemon.steps() == [2, 3]
    assert with_daemon.latest() == root / "step-00000003"
    assert with_daemon.load_latest()["step"] == 3


def test_concurrent_clients_all_commit(daemon: Daemon) -> None:
    """Four processes (as four ranks of a node) save at once."""
    code = (
        "import sys, torch, fastpersist\n"
        "r = int(sys.argv[1])\n"
        "for i in range(3):\n"
        "    s = {'w': torch.full((512 * 1024,), float(r * 10 + i)), 'r': r, 'i': i}\n"
        "    fastpersist.async_save(s, sys.argv[2] + f'/rank{r}/ck{i}').result(60)\n"
    )
    env = dict(os.environ, FASTPERSIST_DAEMON=daemon.address,
               FASTPERSIST_SHM_DIR=str(daemon.shm_dir))
    procs = [subprocess.Popen([sys.executable, "-c", code, str(r), str(daemon.root)], env=env)
             for r in range(4)]
    assert [p.wait(120) for p in procs] == [0, 0, 0, 0]
    for r in range(4):
        for i in range(3):
            out = fastpersist.load(daemon.root / f"rank{r}" / f"ck{i}")
            assert (out["r"], out["i"]) == (r, i)
            assert torch.equal(out["w"], torch.full((512 * 1024,), float(r * 10 + i)))
    clients = {e["client"] for e in daemon.events("begin")}
    assert len(clients) == 4


def test_threads_of_one_process_share_the_saver(daemon: Daemon) -> None:
    errors: list[BaseException] = []

    def save(i: int) -> None:
        try:
            fastpersist.save({"i": i, "w": torch.full((1000,), float(i))},
                             daemon.root / f"t{i}", daemon=daemon.address)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=save, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    for i in range(4):
        assert fastpersist.load(daemon.root / f"t{i}")["i"] == i


def test_replacing_a_checkpoint_through_the_daemon(daemon: Daemon) -> None:
    fastpersist.save({"v": 1}, daemon.root / "ck", daemon=daemon.address)
    fastpersist.save({"v": 2}, daemon.root / "ck", daemon=daemon.address)
    assert fastpersist.load(daemon.root / "ck") == {"v": 2}
    assert root_entries(daemon.root) == ["ck"]


def test_refuses_a_path_outside_the_root(daemon: Daemon, tmp_path: Path) -> None:
    with pytest.raises(DaemonError, match="outside fastpersistd's root"):
        fastpersist.save({"x": 1}, tmp_path / "elsewhere", daemon=daemon.address)
    assert not (tmp_path / "elsewhere").exists()


def test_refuses_to_replace_a_foreign_directory(daemon: Daemon) -> None:
    (daemon.root / "mine").mkdir()
    (daemon.root / "mine" / "notes.txt").write_text("keep me")
    with pytest.raises(fastpersist.CheckpointExistsError):
        fastpersist.save({"x": 1}, daemon.root / "mine", daemon=daemon.address)
    assert (daemon.root / "mine" / "notes.txt").read_text() == "keep me"


def test_full_disk_fails_cleanly_and_keeps_the_previous(tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    mounter = Mounter([])
    try:
        root = mounter.tmpfs(tmp_path / "small", "12m")
        d = Daemon(tmp_path, root=root).start()
        monkeypatch.setenv("FASTPERSIST_SHM_DIR", str(d.shm_dir))
        try:
            fastpersist.save({"w": torch.ones(MIB)}, root / "ck", daemon=d.address)  # 4 MiB
            with pytest.raises(DiskFullError):
                fastpersist.save({"w": torch.zeros(4 * MIB)}, root / "ck", daemon=d.address)
            assert torch.equal(fastpersist.load(root / "ck")["w"], torch.ones(MIB))
            assert root_entries(root) == ["ck"]  # no leftovers
            assert d.client().info().staging_in_use == 0
        finally:
            _close_remote_savers()
            d.cleanup()
    finally:
        mounter.unmount_all()


def _close_remote_savers() -> None:
    from fastpersist.saving.registry import close_shared

    close_shared(abort=True)


def test_unreachable_daemon_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(DaemonUnavailableError, match="not answering"):
        fastpersist.save({"x": 1}, tmp_path / "ck", daemon=f"unix://{tmp_path}/none.sock")


def test_health_info_and_fpctl_status(daemon: Daemon) -> None:
    client = daemon.client()
    assert client.health() == "SERVING"
    info = client.info()
    assert Path(info.root) == daemon.root.resolve() and info.version == fastpersist.__version__
    fpctl = [sys.executable, "-m", "fastpersist.cli", "daemon", "status", "--daemon",
             daemon.address]
    r = subprocess.run([*fpctl, "--json"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["health"] == "SERVING" and doc["checkpoints_in_flight"] == 0
    daemon.stop()
    r = subprocess.run(fpctl, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "not reachable" in r.stderr


def test_sigterm_stops_cleanly_and_removes_the_socket(daemon: Daemon) -> None:
    assert daemon.stop() == 0
    assert not daemon.socket.exists()
    assert daemon.events("stopped")[0]["finished"] is True


def test_a_second_daemon_on_the_same_socket_is_refused(daemon: Daemon, tmp_path: Path) -> None:
    (tmp_path / "other").mkdir()
    r = subprocess.run(
        [sys.executable, "-m", "fastpersist.daemon", "--root", str(tmp_path / "other"),
         "--socket", str(daemon.socket), "--shm-dir", str(daemon.shm_dir)],
        capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "another daemon is serving" in r.stderr
    assert daemon.client().health() == "SERVING"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_prometheus_metrics(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    port = _free_port()
    d = Daemon(tmp_path, "--metrics-listen", f"127.0.0.1:{port}").start()
    monkeypatch.setenv("FASTPERSIST_SHM_DIR", str(d.shm_dir))
    try:
        fastpersist.save({"w": torch.ones(MIB)}, d.root / "ck", daemon=d.address)
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read()
        metrics = {}
        for line in text.decode().splitlines():
            if line and not line.startswith("#"):
                name, value = line.rsplit(" ", 1)
                metrics[name] = float(value)
        assert metrics["fastpersist_bytes_written_total"] >= 4 * MIB
        assert metrics['fastpersist_checkpoints_total{result="committed"}'] == 1
        assert metrics["fastpersist_checkpoints_in_flight"] == 0
        assert metrics["fastpersist_staging_reserved_bytes"] == 0
        assert metrics["fastpersist_last_checkpoint_throughput_bytes_per_second"] > 0
        assert metrics["fastpersist_after_commit_failures_total"] == 0
    finally:
        _close_remote_savers()
        d.cleanup()


def test_daemon_runs_without_torch(tmp_path: Path) -> None:
    """The daemon image has no torch: importing the daemon must not pull it in."""
    code = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, *a):\n"
        "        if name.split('.')[0] in ('torch', 'safetensors', 'numpy'):\n"
        "            raise ImportError('blocked ' + name)\n"
        "sys.meta_path.insert(0, Block())\n"
        "import fastpersist.daemon.cli, fastpersist.protocol.client, fastpersist.cli.daemon\n"
        "print('ok')\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr


def test_segments_are_reused_across_saves(daemon: Daemon) -> None:
    for i in range(5):
        fastpersist.save({"w": torch.full((MIB,), float(i))}, daemon.root / "ck",
                         daemon=daemon.address)
    # (The daemon's memory tier keeps its copy beside them: memory.py.)
    segments = [p for p in daemon.shm_dir.iterdir() if p.name.startswith("fastpersist-")]
    assert len(segments) == 1  # allocated once, reused
    assert os.stat(segments[0]).st_mode & 0o777 == 0o640


def test_delete_and_list_through_the_client(daemon: Daemon) -> None:
    fastpersist.save({"x": 1}, daemon.root / "runs" / "a", daemon=daemon.address)
    client = daemon.client()
    listing = client.list("runs")
    assert [(e.name, e.state) for e in listing.entries] == [("a", "committed")]
    client.delete("runs/a")
    assert not (daemon.root / "runs" / "a").exists()
    with pytest.raises(fastpersist.CheckpointNotFoundError):
        client.delete("runs/a")


def test_long_idle_client_is_not_aborted_while_watching(tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """--idle-timeout only ends checkpoints nobody watches; a live client's slow
    snapshot (here: a pause between two files) is not cut off."""
    d = Daemon(tmp_path, "--idle-timeout", "1").start()
    monkeypatch.setenv("FASTPERSIST_SHM_DIR", str(d.shm_dir))
    monkeypatch.setenv("FASTPERSIST_STAGING_BUDGET", str(2 * MIB))
    import fastpersist.saving.pipeline as remote

    real = remote.stage_file
    calls = []

    def slow_stage(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        if len(calls) == 2:
            time.sleep(3)
        return real(*args, **kwargs)

    monkeypatch.setattr(remote, "stage_file", slow_stage)
    try:
        state = {f"t{i}": torch.full((MIB // 8,), float(i)) for i in range(4)}
        fastpersist.save(state, d.root / "ck", daemon=d.address)
        assert_same(state, fastpersist.load(d.root / "ck"))
    finally:
        _close_remote_savers()
        d.cleanup()


def test_a_daemon_without_open_is_used_through_begin_and_watch(
        daemon: Daemon, monkeypatch: pytest.MonkeyPatch) -> None:
    """A daemon older than the client (a rolling update) answers Open with
    UNIMPLEMENTED: the client begins with Begin and watches at once."""
    import grpc

    from fastpersist._proto import fastpersist_pb2_grpc as pb_grpc

    class Unimplemented(grpc.RpcError):
        def code(self) -> grpc.StatusCode:
            return grpc.StatusCode.UNIMPLEMENTED

        def details(self) -> str:
            return "Method not found!"

    class OldDaemonsOpen:
        def __next__(self) -> Any:
            raise Unimplemented()

        def cancel(self) -> None:
            pass

    real_init = pb_grpc.FastPersistStub.__init__

    def stub_init(self: Any, channel: Any) -> None:
        real_init(self, channel)
        self.Open = lambda request: OldDaemonsOpen()

    monkeypatch.setattr(pb_grpc.FastPersistStub, "__init__", stub_init)
    state = {"w": torch.arange(1000, dtype=torch.float32)}
    fastpersist.save(state, daemon.root / "old", daemon=daemon.address)
    assert_same(state, fastpersist.load(daemon.root / "old"))
    assert [e["path"] for e in daemon.events("begin")] == ["old"]
