"""Saves larger than fastpersistd's staging budgets go through in windows.

The daemon here accepts 64 MiB of staging in all and 32 MiB per client (half,
its default); every state saved is 256 MiB, or one 128 MiB tensor. The client
cuts the save into files that fit half its window (segments.staging_limit),
reuses each shared-memory buffer once the daemon reported its file written,
and waits while other clients hold the budget (segments.open_when_room). The
daemon's Info reports the most staging it ever had reserved and mapped, which
must stay within the budget.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from daemon_support import Daemon, root_entries, serving

import fastpersist
from fastpersist._proto import fastpersist_pb2 as pb
from fastpersist.errors import DaemonError

MIB = 1 << 20
BUDGET = 64 * MIB
CLIENT_BUDGET = BUDGET // 2  # the daemon's default: half of --staging-budget

pytestmark = pytest.mark.slow


@pytest.fixture
def small_daemon(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Daemon]:
    yield from _started(Daemon(tmp_path, "--staging-budget", "64MiB"), monkeypatch)


@pytest.fixture
def gated_daemon(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Daemon]:
    yield from _started(Daemon(tmp_path, "--staging-budget", "64MiB", gate=tmp_path / "gate"),
                        monkeypatch)


def _started(d: Daemon, monkeypatch: pytest.MonkeyPatch) -> Iterator[Daemon]:
    with serving(d, monkeypatch):
        yield d


def state_256(seed: int = 0) -> dict[str, torch.Tensor]:
    """256 MiB in 64 tensors of 4 MiB (each fits a window's half)."""
    g = torch.Generator().manual_seed(seed)
    return {f"layer{i}.w": torch.randn(MIB, generator=g) for i in range(64)}


def assert_same(path: Path, state: dict[str, torch.Tensor]) -> None:
    back = fastpersist.load(path)
    assert back.keys() == state.keys()
    for k, v in state.items():
        assert torch.equal(back[k], v), k


def assert_within_budget(d: Daemon, limit: int = CLIENT_BUDGET) -> None:
    """The daemon never held more than `limit` (its high-water marks: one
    client's budget, or all of it with other clients), and the save did go
    through its shared memory (not all of it streamed)."""
    info = d.client().info()
    assert info.staging_budget == BUDGET
    assert 0 < info.staging_in_use_peak <= limit, info
    assert 0 < info.staging_mapped_peak <= limit, info
    assert info.staging_in_use == 0 and info.checkpoints_in_flight == 0, info
    # The client's side: the process-wide pipeline's pool kept one window.
    from fastpersist.api import pipeline_for

    assert pipeline_for(d.address).staging_bytes <= CLIENT_BUDGET


@pytest.mark.parametrize("compression", [None, "zstd"])
def test_save_larger_than_the_budget_round_trips(small_daemon: Daemon,
                                                 compression: str | None) -> None:
    """On main: RESOURCE_EXHAUSTED, this client would hold 268435456 bytes."""
    state = state_256()
    target = small_daemon.root / "ckpt"
    fastpersist.save(state, target, daemon=small_daemon.address, compression=compression)
    assert_same(target, state)
    assert_within_budget(small_daemon)


def test_async_save_and_a_second_queued_behind_it(small_daemon: Daemon) -> None:
    first, second = state_256(1), state_256(2)
    f1 = fastpersist.async_save(first, small_daemon.root / "a", daemon=small_daemon.address)
    f2 = fastpersist.async_save(second, small_daemon.root / "b", daemon=small_daemon.address)
    f1.result()
    f2.result()
    assert_same(small_daemon.root / "a", first)
    assert_same(small_daemon.root / "b", second)
    assert_within_budget(small_daemon)


def test_checkpointer_through_the_daemon(small_daemon: Daemon) -> None:
    states = [state_256(10), state_256(11)]
    with fastpersist.Checkpointer(small_daemon.root / "run", daemon=small_daemon.address,
                                  keep_last=2) as ckpt:
        for step, s in enumerate(states):
            ckpt.save(step, s)
        ckpt.wait()
        assert 0 < ckpt.staging_bytes <= CLIENT_BUDGET
        paths = [ckpt.path_for(step) for step in range(len(states))]
    for path, s in zip(paths, states, strict=True):
        assert_same(path, s)
    assert_within_budget(small_daemon)


def test_prepare_staging_stays_within_the_window(small_daemon: Daemon) -> None:
    """prepare_staging takes the daemon's window, not the whole state, in shared memory."""
    from fastpersist.api import pipeline_for

    pipeline = pipeline_for(small_daemon.address)
    assert 0 < pipeline.prepare_staging(state_256()) <= CLIENT_BUDGET


def test_a_tensor_larger_than_the_whole_budget(small_daemon: Daemon) -> None:
    """128 MiB in one tensor, beside small ones: streamed to the daemon, which
    writes it through its bounded stream slots."""
    g = torch.Generator().manual_seed(3)
    state = {"small": torch.randn(1000, generator=g), "huge": torch.randn(32 * MIB, generator=g),
             "after": torch.randn(MIB, generator=g)}
    for name, kwargs in (("plain", {}), ("zstd", {"compression": "zstd"})):
        fastpersist.save(state, small_daemon.root / name, daemon=small_daemon.address, **kwargs)
        assert_same(small_daemon.root / name, state)
    f = fastpersist.async_save(state, small_daemon.root / "async", daemon=small_daemon.address)
    f.result()
    assert_same(small_daemon.root / "async", state)
    info = small_daemon.client().info()
    assert info.staging_in_use_peak <= CLIENT_BUDGET
    assert info.staging_mapped_peak <= CLIENT_BUDGET


def test_a_non_contiguous_tensor_larger_than_the_whole_budget(small_daemon: Daemon) -> None:
    """Streamed in pieces of its rows (segments._host_pieces), in C order."""
    g = torch.Generator().manual_seed(6)
    state = {"t": torch.randn(3072, 8192, generator=g).t(), "v": torch.randn(4, generator=g)}
    assert not state["t"].is_contiguous() and state["t"].nbytes > BUDGET
    fastpersist.save(state, small_daemon.root / "nc", daemon=small_daemon.address)
    assert_same(small_daemon.root / "nc", state)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_tensors_larger_than_the_whole_budget(small_daemon: Daemon) -> None:
    """GPU tensors over the window are copied to the host in pieces of their
    rows and streamed; ones that fit are staged: both come back bit-exact, to
    the GPU, in save and async_save."""
    g = torch.Generator(device="cuda").manual_seed(8)
    state = {"huge": torch.randn(24 * MIB, device="cuda", generator=g),
             "wide": torch.randn(4096, 6144, device="cuda", generator=g).t(),
             **{f"w{i}": torch.randn(MIB, device="cuda", generator=g) for i in range(40)}}
    fastpersist.save(state, small_daemon.root / "gpu", daemon=small_daemon.address)
    f = fastpersist.async_save(state, small_daemon.root / "gpu-async", daemon=small_daemon.address)
    f.result()
    for name in ("gpu", "gpu-async"):
        back = fastpersist.load(small_daemon.root / name, map_location="cuda:0")
        assert back.keys() == state.keys()
        for k, v in state.items():
            assert back[k].is_cuda and torch.equal(back[k], v), (name, k)
    info = small_daemon.client().info()
    assert 0 < info.staging_mapped_peak <= CLIENT_BUDGET, info


def _hold_budget(d: Daemon) -> list[str]:
    """Two other clients' checkpoints, each reserving its whole per-client
    budget: the daemon's budget is full."""
    stub = d.client().stub
    return [stub.Begin(pb.BeginRequest(path=f"other-{i}", client_id=f"other-client-{i}",
                                       staging_bytes=CLIENT_BUDGET, file_count=1)).checkpoint_id
            for i in range(2)]


def test_a_save_waits_while_other_clients_hold_the_budget(small_daemon: Daemon) -> None:
    """On main the save is refused at once (RESOURCE_EXHAUSTED)."""
    held = _hold_budget(small_daemon)
    state = state_256(4)
    outcome: list[BaseException | None] = []

    def save() -> None:
        try:
            fastpersist.save(state, small_daemon.root / "waited", daemon=small_daemon.address)
            outcome.append(None)
        except BaseException as exc:
            outcome.append(exc)

    t = threading.Thread(target=save)
    t.start()
    t.join(2.0)
    assert t.is_alive(), f"the save did not wait for room: {outcome}"
    assert small_daemon.client().info().checkpoints_in_flight == 2  # not begun meanwhile
    stub = small_daemon.client().stub
    for ident in held:
        stub.Abort(pb.AbortRequest(checkpoint_id=ident))
    t.join(120)
    assert outcome == [None]
    assert_same(small_daemon.root / "waited", state)
    assert_within_budget(small_daemon, BUDGET)


def test_waiting_for_room_times_out_naming_the_budget(small_daemon: Daemon,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    _hold_budget(small_daemon)
    monkeypatch.setenv("FASTPERSIST_DAEMON_ROOM_TIMEOUT", "1")
    with pytest.raises(DaemonError) as info:
        fastpersist.save(state_256(5), small_daemon.root / "late", daemon=small_daemon.address)
    message = str(info.value)
    assert info.value.code == "RESOURCE_EXHAUSTED"
    assert "FASTPERSIST_DAEMON_ROOM_TIMEOUT" in message and "staging budget" in message
    assert "late" in message
    assert not (small_daemon.root / "late").exists()


TRAINER = """
import sys, torch, fastpersist
address, target = sys.argv[1], sys.argv[2]
state = {f"layer{i}.w": torch.full((1 << 20,), float(i)) for i in range(64)}
print("saving", flush=True)
fastpersist.save(state, target, daemon=address)
print("saved", flush=True)
"""


def _until(what: str, check: Callable[[], Any], proc: subprocess.Popen[bytes] | None = None,
           timeout: float = 120.0) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        if proc is not None and proc.poll() is not None:
            pytest.fail(f"the trainer exited ({proc.returncode}) before {what}: "
                        f"{proc.stderr.read().decode() if proc.stderr else ''}")
        time.sleep(0.05)
    pytest.fail(f"no {what} within {timeout} s")


def test_trainer_killed_mid_windowed_save(gated_daemon: Daemon, tmp_path: Path) -> None:
    """A trainer SIGKILLed after the daemon took the first window of a 256 MiB
    save: the daemon aborts it, the checkpoint committed before at the same
    path is untouched, nothing half-written is left under the root, and the
    budget is free again."""
    d = gated_daemon
    target = d.root / "ckpt"
    before = {"v": torch.arange(10)}
    d.open_gate()
    fastpersist.save(before, target, daemon=d.address)
    (tmp_path / "gate").unlink()  # the daemon's writes wait again
    proc = subprocess.Popen([sys.executable, "-c", TRAINER, d.address, str(target)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env={**os.environ, "FASTPERSIST_SHM_DIR": str(d.shm_dir)})
    try:
        client = d.client()

        def mid_save() -> list[Any]:
            # Begun, and the daemon has the first window's file(s): bytes submitted.
            return [s for s in client.stub.List(pb.ListRequest(path="")).in_flight
                    if s.bytes_total > 0]

        (status,) = _until("the windowed save in the daemon", mid_save, proc)
        assert status.path == "ckpt" and status.state == pb.CheckpointStatus.RECEIVING
        assert status.files_total > 1 and status.files_written == 0  # windows; gated
        assert status.bytes_total < 64 * 4 * MIB  # mid-way
        proc.send_signal(signal.SIGKILL)
        assert proc.wait(30) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    d.open_gate()  # the worker finishes the file it held, then finds the checkpoint gone
    _until("the daemon to abort the save", lambda: client.info().checkpoints_in_flight == 0)
    assert d.events("client-gone")
    _until("the staging directory to be swept", lambda: root_entries(d.root) == ["ckpt"])
    assert_same(target, before)
    info = client.info()
    assert info.staging_in_use == 0 and info.staging_in_use_peak <= CLIENT_BUDGET


def test_a_daemon_restarted_with_smaller_budgets_is_asked_again(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The client asked the daemon's budgets once and kept them: after a restart
    # with a smaller --client-budget, the next save's files were still cut for
    # the old window, and its Open (over the new budget for good) was asked
    # again until FASTPERSIST_DAEMON_ROOM_TIMEOUT ran out.
    monkeypatch.setenv("FASTPERSIST_DAEMON_ROOM_TIMEOUT", "5")
    d = Daemon(tmp_path, "--staging-budget", "64MiB")
    with serving(d, monkeypatch):
        state = {f"t{i}": torch.full((MIB // 2,), float(i)) for i in range(16)}  # 32 MiB
        fastpersist.save(state, d.root / "before", daemon=d.address)
        assert d.stop() == 0
        d.args = ["--staging-budget", "8MiB"]
        d.start()
        fastpersist.save(state, d.root / "after", daemon=d.address)
        loaded = fastpersist.load(d.root / "after")
        assert all(torch.equal(loaded[k], v) for k, v in state.items())
        assert 0 < d.client().info().staging_in_use_peak <= 4 * MIB  # the new client budget


def test_a_daemon_restarted_on_another_root_does_not_get_the_old_roots_paths(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # With the old root kept, the client sent the path relative to it, and the
    # new daemon wrote the checkpoint under its own root: not where asked.
    d = Daemon(tmp_path)
    with serving(d, monkeypatch):
        state = {"w": torch.ones(1000)}
        fastpersist.save(state, d.root / "a", daemon=d.address)
        assert d.stop() == 0
        old_root, d.root = d.root, tmp_path / "other-root"
        d.root.mkdir()
        d.start()
        with pytest.raises(DaemonError, match="outside fastpersistd's root"):
            fastpersist.save(state, old_root / "b", daemon=d.address)
        assert not (d.root / "b").exists() and not (old_root / "b").exists()
        fastpersist.save(state, d.root / "c", daemon=d.address)
        assert torch.equal(fastpersist.load(d.root / "c")["w"], state["w"])
