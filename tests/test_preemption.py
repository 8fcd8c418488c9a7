"""Preemption (fastpersist.exit_on_preemption, hand_off): SIGTERM at random
points of a training loop that checkpoints every step, through fastpersistd and
in-process. The trainer must exit within the grace time, and the newest
committed step must never be older than the last save that returned before the
signal; a save the signal interrupted is finished and handed off too.

FASTPERSIST_PREEMPTION_DRILLS (default 4 per mode here) sets the number of
signals; the issue's drill is 200:
    FASTPERSIST_PREEMPTION_DRILLS=200 pytest tests/test_preemption.py -k drill
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import fastpersist
from fastpersist.format.manifest import MANIFEST_NAME

HELPER = Path(__file__).parent / "helpers" / "preempted_trainer.py"
GRACE = 5.0
# Teardown of the process after its os._exit (and a loaded machine's
# scheduling) on top of the grace; the handler itself keeps to the grace.
SLACK = 3.0
DRILLS = int(os.environ.get("FASTPERSIST_PREEMPTION_DRILLS", "4"))


def _committed_steps(root: Path) -> list[int]:
    return sorted(int(p.name.removeprefix("step-")) for p in root.glob("step-*")
                  if (p / MANIFEST_NAME).is_file())


def _markers(path: Path, kind: str) -> list[int]:
    if not path.exists():
        return []
    return [int(line.split()[1]) for line in path.read_text().splitlines()
            if line.startswith(kind + " ") and len(line.split()) == 2]


def _settle(daemon: Any) -> None:
    """Until the daemon has finished every checkpoint it was handed."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        client = daemon.client()
        try:
            if client.info().checkpoints_in_flight == 0:
                return
        finally:
            client.close()
        time.sleep(0.05)
    raise AssertionError("the daemon did not finish its checkpoints")


def _drill(tmp: Path, env: dict[str, str], rng: random.Random, daemon: Any) -> tuple[int, int]:
    """One trainer, one SIGTERM: (the last step that returned, the newest committed)."""
    root = (daemon.root if daemon is not None else tmp) / f"run-{rng.randrange(1 << 30)}"
    markers = tmp / f"{root.name}.markers"
    child = subprocess.Popen([sys.executable, str(HELPER), str(root), str(markers), str(GRACE)],
                             env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert child.stdout is not None
        assert child.stdout.readline().strip() == b"ready", child.stderr
        time.sleep(rng.uniform(0.05, 1.5))  # somewhere in the loop: a save, or between
        child.send_signal(signal.SIGTERM)
        sent = time.monotonic()
        _, err = child.communicate(timeout=GRACE + 30)
        took = time.monotonic() - sent
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    assert child.returncode == 128 + signal.SIGTERM, err.decode()[-2000:]
    assert took <= GRACE + SLACK, f"exited {took:.2f} s after SIGTERM"
    assert b"NOT safe" not in err, err.decode()[-2000:]
    if daemon is not None:
        _settle(daemon)
    returned = max(_markers(markers, "returned"), default=0)
    entered = max(_markers(markers, "entered"), default=0)
    committed = _committed_steps(root)
    newest = committed[-1] if committed else 0
    assert newest >= returned, (returned, committed, err.decode()[-2000:])
    assert newest <= entered
    if b"a signal during a save" in err:
        # The signal interrupted save(`entered`): it finished its snapshot, was
        # handed off, and committed. (A signal between the marker and save()'s
        # start is handled outside a save: then only `returned` is promised.)
        assert newest == entered, (entered, committed, err.decode()[-2000:])
    if newest:
        loaded = fastpersist.load(root / f"step-{newest:08d}")
        assert loaded["step"] == newest
        assert all(torch.equal(t, torch.full_like(t, float(newest)))
                   for t in loaded["model"].values())
    return returned, newest


def _report(results: list[tuple[int, int]]) -> None:
    interrupted = sum(1 for returned, newest in results if newest > returned)
    print(f"{len(results)} signals; {interrupted} landed in a save that then committed")


@pytest.mark.slow
def test_preemption_drill_through_the_daemon(daemon: Any, tmp_path: Path) -> None:
    env = {**os.environ, "FASTPERSIST_DAEMON": daemon.address,
           "FASTPERSIST_SHM_DIR": str(daemon.shm_dir)}
    rng = random.Random(20261204)
    _report([_drill(tmp_path, env, rng, daemon) for _ in range(DRILLS)])


@pytest.mark.slow
def test_preemption_drill_in_process(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "FASTPERSIST_DAEMON"}
    rng = random.Random(4)
    _report([_drill(tmp_path, env, rng, None) for _ in range(DRILLS)])


def test_hand_off_reports_saves_safe_once_the_daemon_owns_them(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Through a gated daemon (its data-file writes wait for a gate): the save is
    safe as soon as the daemon owns it, before it is durable; a SIGKILLed
    trainer then loses nothing."""
    from daemon_support import Daemon

    daemon = Daemon(tmp_path, gate=tmp_path / "gate").start()
    try:
        code = (
            "import sys, os, signal, torch, fastpersist\n"
            "f = fastpersist.async_save({'w': torch.ones(1 << 20)}, sys.argv[1])\n"
            "report = fastpersist.hand_off(timeout=10)\n"
            "print(report.ok, len(report.safe), os.path.exists(sys.argv[1]), flush=True)\n"
            "os.kill(os.getpid(), signal.SIGKILL)\n"
        )
        target = daemon.root / "ck"
        env = {**os.environ, "FASTPERSIST_DAEMON": daemon.address,
               "FASTPERSIST_SHM_DIR": str(daemon.shm_dir)}
        out = subprocess.run([sys.executable, "-c", code, str(target)], env=env,
                             capture_output=True, timeout=120)
        assert out.returncode == -signal.SIGKILL, out.stderr.decode()[-2000:]
        assert out.stdout.split() == [b"True", b"1", b"False"]  # safe, not yet durable
        daemon.open_gate()
        _settle(daemon)
        assert torch.equal(fastpersist.load(target)["w"], torch.ones(1 << 20))
    finally:
        daemon.cleanup()


def test_hand_off_keeps_its_deadline_for_an_in_process_save(tmp_path: Path) -> None:
    """An in-process save is safe only once durable: with a deadline shorter than
    the write, hand_off returns at the deadline and names it unsafe."""
    code = (
        "import sys, time, torch, fastpersist\n"
        "state = {f'w{i}': torch.ones(16 << 20) for i in range(4)}\n"
        "f = fastpersist.async_save(state, sys.argv[1])\n"
        "t = time.monotonic(); report = fastpersist.hand_off(timeout=0.05)\n"
        "waited = time.monotonic() - t\n"
        "print(report.ok, len(report.unsafe), f.done(), flush=True)\n"
        "print(fastpersist.hand_off().ok, flush=True)\n"
        "assert waited < 5, waited\n"
    )
    # One writer thread of 4 KiB blocks: the 256 MiB write takes seconds.
    env = {**os.environ, "FASTPERSIST_THREADS": "1", "FASTPERSIST_BLOCK_SIZE": "4096"}
    env.pop("FASTPERSIST_DAEMON", None)
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "ck")], env=env,
                         capture_output=True, timeout=300)
    assert out.returncode == 0, out.stderr.decode()[-2000:]
    first, second = out.stdout.decode().splitlines()
    assert first.split() == ["False", "1", "False"]
    assert second == "True"


def test_grace_must_be_positive() -> None:
    with pytest.raises(ValueError, match="grace"):
        fastpersist.exit_on_preemption(grace=0)
