"""The kill soak: savers and fastpersistd SIGKILLed at random moments, over and
over, each outcome checked (issue 33).

    python tests/kill_soak.py --kills 1000 [--pressure] [--seed N] [--json OUT]

Each round starts one victim, a child process that saves checkpoints of a
state derived from the step alone (so any checkpoint can be checked bit for
bit) and reports each step the moment fastpersist's contract makes a promise
about it:

  kind          how it saves                                  promise reported
  save          fastpersist.save, in-process                  durable (returned)
  async         fastpersist.async_save, in-process            durable (result())
  ckpt          Checkpointer, in-process                      durable (result())
  ckpt-zstd     Checkpointer(compression="zstd"), in-process  durable (result())
  daemon        Checkpointer through fastpersistd             handed (save returned:
  daemon-zstd   the same, compressed by the daemon              the daemon commits it)
  daemon-kill   a daemon client; the daemon is SIGKILLed      durable (result())
                instead of the client, then restarted
                (the client is killed too; if it was told first
                that the daemon is gone, DaemonUnavailableError,
                it exits with DAEMON_GONE: an expected outcome)

and SIGKILLs it (or the daemon) after a random delay. Then, once the daemon has
settled: every step-N directory visible under the run's root loads (every
CRC32C checked) exactly the state of step N; nothing half-written is visible
(a directory without a manifest); every step reported durable is there, and
every step handed to a daemon that was not killed is there; the dead victim's
shared-memory segments are gone (the daemon reclaims them); the daemon holds
no more descriptors than it did at its first settled moment. Every failure is
counted and described; the exit status is 1 if any count is not 0.

--pressure runs, for the whole soak, niced processes that load the CPU,
hold memory, hold descriptors (and victims run with a low RLIMIT_NOFILE), fill
most of the shared-memory directory's filesystem, and save, load and start
daemons of their own. tests/test_kill_soak.py runs a short soak in CI.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parent))
from daemon_support import Daemon

import fastpersist
from fastpersist.errors import CheckpointError, DaemonUnavailableError
from fastpersist.protocol.shm import PREFIX

KINDS = ["save", "async", "ckpt", "ckpt-zstd", "daemon", "daemon-zstd", "daemon-kill"]
DAEMON_KINDS = {"daemon", "daemon-zstd", "daemon-kill"}
# A daemon-kill victim's exit status when its save failed because the daemon
# was gone (an expected outcome, not an error of the victim).
DAEMON_GONE = 17
# Small data files (several per checkpoint) and a staging budget below one
# state: kills land between files, and staging waits for room.
VICTIM_ENV = {"FASTPERSIST_FILE_BYTES": str(1 << 20), "FASTPERSIST_STAGING_BUDGET": str(3 << 20),
              "OMP_NUM_THREADS": "1"}


def make_state(step: int) -> dict[str, Any]:
    """A state that depends on the step alone: 4.5 MiB in tensors of several
    dtypes and sizes (one larger than a data file), and plain values."""
    g = torch.Generator().manual_seed(step)
    return {
        "step": step,
        "model": {f"w{i}": torch.randn(64 << 10 >> (i % 3), generator=g) for i in range(6)},
        "big": torch.randint(-(2 ** 31), 2 ** 31 - 1, (1 << 20,), generator=g, dtype=torch.int32)
        .view(torch.float32),
        "half": torch.randn(4096, generator=g).to(torch.bfloat16),
        "ids": torch.arange(1000, dtype=torch.int64) * step,
        "meta": {"name": f"step-{step}", "lr": 0.5 / (step + 1)},
    }


def mismatch(loaded: Any, step: int) -> str | None:
    """What differs between a loaded state and make_state(step); None if nothing."""
    want = make_state(step)

    def walk(a: Any, b: Any, where: str) -> str | None:
        if isinstance(b, torch.Tensor):
            if not isinstance(a, torch.Tensor) or a.dtype != b.dtype or a.shape != b.shape:
                return f"{where}: {type(a).__name__} differs in type, dtype or shape"
            if not torch.equal(a.view(torch.uint8), b.view(torch.uint8)):
                return f"{where}: bytes differ"
            return None
        if isinstance(b, dict):
            if not isinstance(a, dict) or set(a) != set(b):
                return f"{where}: keys differ"
            for k in b:
                problem = walk(a[k], b[k], f"{where}.{k}")
                if problem:
                    return problem
            return None
        return None if a == b else f"{where}: {a!r} != {b!r}"

    return walk(loaded, want, "state")


# -- the victim --------------------------------------------------------------------------


def emit(msg: str) -> None:
    os.write(1, f"{msg}\n".encode())


def victim(kind: str, root: Path, start: int, address: str) -> None:
    """Save steps start, start+1, ... under root until killed; "ready" first,
    once torch and fastpersist are imported and the first state is made."""
    step = start
    make_state(step)
    emit("ready")
    if kind in ("save", "async"):
        while True:
            target = root / f"step-{step:08d}"
            if kind == "save":
                fastpersist.save(make_state(step), target, daemon="")
            else:
                fastpersist.async_save(make_state(step), target, daemon="").result()
            emit(f"durable {step}")
            step += 1
    compression = "zstd" if kind.endswith("zstd") else None
    through = address if kind in DAEMON_KINDS else ""
    ckpt = fastpersist.Checkpointer(root, daemon=through, compression=compression, keep_last=3)
    try:
        while True:
            future = ckpt.save(step, make_state(step))
            if through:
                emit(f"handed {step}")
            future.result()
            emit(f"durable {step}")
            step += 1
    except DaemonUnavailableError as exc:
        if kind != "daemon-kill":
            raise
        # The daemon was killed: the save in flight fails with this clear
        # error (a file not yet handed over has no one to write it), possibly
        # before the driver's SIGKILL arrives. The step was never reported.
        emit(f"daemon gone {step}: {exc}")
        os._exit(DAEMON_GONE)


# -- the driver --------------------------------------------------------------------------


@dataclass
class Tally:
    kills: int = 0
    rounds_by_kind: Counter[str] = field(default_factory=Counter)
    checked: int = 0  # checkpoints loaded and compared
    durable_reported: int = 0
    lost: list[str] = field(default_factory=list)
    not_exact: list[str] = field(default_factory=list)
    half_written: list[str] = field(default_factory=list)
    leaked_segments: list[str] = field(default_factory=list)
    leaked_fds: list[str] = field(default_factory=list)
    victim_errors: list[str] = field(default_factory=list)
    daemon_gone_errors: int = 0  # daemon-kill victims told "not answering" before their kill

    def failures(self) -> int:
        return (len(self.lost) + len(self.not_exact) + len(self.half_written)
                + len(self.leaked_segments) + len(self.leaked_fds))

    def summary(self) -> dict[str, Any]:
        return {"kills": self.kills, "rounds": dict(self.rounds_by_kind),
                "checkpoints_checked": self.checked, "durable_reported": self.durable_reported,
                "lost": len(self.lost), "not_exact": len(self.not_exact),
                "half_written": len(self.half_written),
                "leaked_segments": len(self.leaked_segments),
                "leaked_descriptors": len(self.leaked_fds),
                "victim_errors": len(self.victim_errors),
                "daemon_gone_errors": self.daemon_gone_errors,
                "details": (self.lost + self.not_exact + self.half_written
                            + self.leaked_segments + self.leaked_fds)[:50],
                "victim_error_samples": self.victim_errors[:10]}


def _fd_count(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def _settled(d: Daemon) -> bool:
    client = d.client()
    try:
        info = client.info()
    finally:
        client.close()
    return info.checkpoints_in_flight == 0 and info.staging_in_use == 0


def _wait(what: str, check: Any, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if check():
                return True
        except Exception:  # a daemon restarting: ask again
            pass
        time.sleep(0.05)
    return False


class Soak:
    def __init__(self, work: Path, seed: int, pressure: bool, log: Any) -> None:
        self.work = work
        self.rng = random.Random(seed)
        self.pressure = pressure
        self.log = log
        self.tally = Tally()
        self.daemon = Daemon(work / "daemon", "--idle-timeout", "30")
        (work / "daemon").mkdir(parents=True, exist_ok=True)
        self.daemon.start()
        self.fd_baseline: int | None = None
        self.round = 0

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.daemon.stop(30)
        self.daemon.cleanup()

    def run_round(self) -> None:
        kind = self.rng.choice(KINDS)
        self.round += 1
        self.tally.rounds_by_kind[kind] += 1
        # Daemon clients save under the daemon's root; in-process savers beside it.
        base = self.daemon.root if kind in DAEMON_KINDS else self.work / "local"
        root = base / f"run-{self.round:05d}"
        env = dict(os.environ, **VICTIM_ENV, FASTPERSIST_SHM_DIR=str(self.daemon.shm_dir))
        cmd = [sys.executable, __file__, "--victim", kind, str(root), "0",
               self.daemon.address]
        preexec = _low_nofile if self.pressure else None
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                env=env, preexec_fn=preexec)
        assert proc.stdout is not None
        first = proc.stdout.readline()  # "ready" (or nothing: it died)
        # A moment spread over the first few saves: before the first commit,
        # mid-save, between saves.
        delay = self.rng.uniform(0.0, 1.5 if not self.pressure else 4.0)
        time.sleep(delay)
        daemon_killed = kind == "daemon-kill"
        if daemon_killed:
            self.daemon.kill()
        else:
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGKILL)
        self.tally.kills += 1
        if daemon_killed:
            # The client finds its daemon gone; it is killed too, then the
            # daemon starts again on its root (its own recovery runs there).
            time.sleep(self.rng.uniform(0.0, 0.5))
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGKILL)
        out, err = proc.communicate(timeout=60)
        if daemon_killed:
            self._restart_daemon()
        lines = (first + out).decode(errors="replace").splitlines()
        durable = {int(x.split()[1]) for x in lines if x.startswith("durable ")}
        handed = {int(x.split()[1]) for x in lines if x.startswith("handed ")}
        self.tally.durable_reported += len(durable)
        gone = [x for x in lines if x.startswith("daemon gone ")]
        if daemon_killed and proc.returncode == DAEMON_GONE and gone:
            self.tally.daemon_gone_errors += 1
        elif proc.returncode != -signal.SIGKILL:
            self.tally.victim_errors.append(
                f"round {self.round} ({kind}): exit {proc.returncode}: "
                f"{err.decode(errors='replace')[-600:]}")
        self._check(kind, root, durable, handed if not daemon_killed else set(), proc.pid)
        shutil.rmtree(root, ignore_errors=True)
        print(f"round {self.round} {kind}: killed after {delay:.2f} s, durable {sorted(durable)}"
              f", handed {sorted(handed)}", file=self.log, flush=True)

    def _restart_daemon(self) -> None:
        assert self.daemon.proc is not None
        self.daemon.proc.wait(30)  # the lock on the root goes with the process
        self.daemon.start()
        self.fd_baseline = None  # a new process: a new baseline

    def _check(self, kind: str, root: Path, durable: set[int], handed: set[int],
               pid: int) -> None:
        t = self.tally
        where = f"round {self.round} ({kind})"
        if not _wait("settle", lambda: _settled(self.daemon), 60):
            t.leaked_fds.append(f"{where}: the daemon did not settle in 60 s")
        visible: set[int] = set()
        if root.is_dir():
            for entry in sorted(root.iterdir()):
                if not entry.name.startswith("step-"):
                    continue
                step = int(entry.name.removeprefix("step-"))
                if not (entry / "manifest.json").is_file():
                    t.half_written.append(f"{where}: {entry.name} is visible without a manifest")
                    continue
                visible.add(step)
                try:
                    problem = mismatch(fastpersist.load(entry, verify=True), step)
                except CheckpointError as exc:
                    problem = f"does not load: {exc}"
                t.checked += 1
                if problem:
                    t.not_exact.append(f"{where}: {entry.name}: {problem}")
        # Retention (keep_last=3) may have deleted older steps: only those
        # above the retained window must all be there.
        floor = max(visible, default=-1) - 2 if kind not in ("save", "async") else -1
        for step in sorted((durable | handed) - visible):
            if step >= floor:
                t.lost.append(f"{where}: step {step} was reported "
                              f"{'durable' if step in durable else 'handed over'} but is gone")
        # The dead victim's segments: reclaimed by the daemon.
        def mine() -> list[str]:
            return [n for n in os.listdir(self.daemon.shm_dir) if n.startswith(f"{PREFIX}{pid}-")]
        if not _wait("segments reclaimed", lambda: not mine(), 30):
            t.leaked_segments.append(f"{where}: segments of pid {pid} left: {mine()}")
        assert self.daemon.proc is not None
        fds = _fd_count(self.daemon.proc.pid)
        if self.fd_baseline is None:
            self.fd_baseline = fds
        elif not _wait("descriptors", lambda: _fd_count(self.daemon.proc.pid)  # type: ignore[union-attr]
                       <= self.fd_baseline, 10):
            t.leaked_fds.append(f"{where}: the daemon holds {_fd_count(self.daemon.proc.pid)} "
                                f"descriptors, {self.fd_baseline} at its first settled moment")


def _low_nofile() -> None:
    """Victims under pressure run near their descriptor limit."""
    os.nice(0)
    resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256))


# -- pressure ----------------------------------------------------------------------------


def pressure_process(name: str, work: Path, shm: str) -> None:
    """One source of pressure, until killed (`--pressure-process NAME WORK SHM`)."""
    if name == "cpu":
        while True:
            pass
    if name == "memory":
        total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        held = bytearray(min(4 << 30, total // 4))
        for i in range(0, len(held), 4096):
            held[i] = 1
    elif name == "fds":
        _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        fds = []
        with contextlib.suppress(OSError):
            while len(fds) < min(hard, 60000) - 16:
                fds.append(os.open("/dev/null", os.O_RDONLY))
    elif name == "shm":  # most of the segments' filesystem taken
        st = os.statvfs(shm)
        left = int(st.f_bavail * st.f_frsize * 0.85)
        with open(os.path.join(shm, "soak-pressure-fill"), "wb") as f:
            while left > 0:
                n = min(left, 64 << 20)
                f.write(b"\1" * n)
                left -= n
    elif name == "neighbour":  # another user of the machine: daemons, saves, loads
        i = 0
        while True:
            home = work / f"n{i % 2}"
            home.mkdir(parents=True, exist_ok=True)
            d = Daemon(home)
            d.start()
            s = {"x": torch.randn(1 << 20), "i": i}
            fastpersist.save(s, d.root / "a", daemon=d.address)
            fastpersist.save(s, home / "local", daemon="")
            assert torch.equal(fastpersist.load(d.root / "a")["x"], s["x"])
            assert torch.equal(fastpersist.load(home / "local")["x"], s["x"])
            d.stop(30)
            d.cleanup()
            i += 1
    while True:
        time.sleep(3600)


def start_pressure(work: Path, shm_dir: str) -> list[subprocess.Popen[bytes]]:
    procs = []
    for name in ("cpu", "cpu", "memory", "fds", "shm", "neighbour"):
        procs.append(subprocess.Popen(
            [sys.executable, __file__, "--pressure-process", name, str(work / "neighbour"),
             shm_dir],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            # A session of its own: stop_pressure kills it with what it started
            # (a neighbour's daemons), whenever it is stopped.
            start_new_session=True, preexec_fn=lambda: os.nice(10)))
    return procs


def stop_pressure(procs: list[subprocess.Popen[bytes]], shm_dir: str) -> None:
    for p in procs:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGKILL)
        p.wait()
    with contextlib.suppress(FileNotFoundError):
        os.unlink(os.path.join(shm_dir, "soak-pressure-fill"))


def soak(kills: int, seed: int, pressure: bool, log: Any = sys.stderr,
         work: Path | None = None) -> Tally:
    own = work is None
    work = work or Path(tempfile.mkdtemp(prefix="fp-soak-"))
    s = Soak(work, seed, pressure, log)
    procs = start_pressure(work, str(Path(s.daemon.shm_dir).parent)) if pressure else []
    try:
        while s.tally.kills < kills:
            s.run_round()
    finally:
        stop_pressure(procs, str(Path(s.daemon.shm_dir).parent))
        s.close()
        if own:
            shutil.rmtree(work, ignore_errors=True)
    return s.tally


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--victim":
        _, _, kind, root, start, address = sys.argv
        victim(kind, Path(root), int(start), address)
        return 0
    if len(sys.argv) > 1 and sys.argv[1] == "--pressure-process":
        _, _, name, work, shm = sys.argv
        pressure_process(name, Path(work), shm)
        return 0
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kills", type=int, default=100)
    p.add_argument("--seed", type=int, default=int(time.time()))
    p.add_argument("--pressure", action="store_true")
    p.add_argument("--json", type=Path, help="write the summary here too")
    args = p.parse_args()
    t0 = time.monotonic()
    tally = soak(args.kills, args.seed, args.pressure)
    summary = {"seed": args.seed, "pressure": args.pressure,
               "seconds": round(time.monotonic() - t0), **tally.summary()}
    text = json.dumps(summary, indent=1)
    print(text)
    if args.json:
        args.json.write_text(text)
    return 1 if tally.failures() else 0


if __name__ == "__main__":
    sys.exit(main())
