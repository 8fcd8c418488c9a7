"""A real fastpersistd process for tests: temporary root, socket and shared-memory
directory; started, health-checked, stopped (SIGTERM) or killed (SIGKILL).

Imported as `daemon_support` (tests/ is on sys.path). The `daemon` fixture in
conftest.py starts one per test. With `gate=PATH` the daemon's data-file writes
wait until the test calls open_gate() (tests/helpers/gated_daemon.py), so a test
decides when the daemon reads a client's segments.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from fastpersist.errors import CheckpointError
from fastpersist.protocol.client import DaemonClient

GATED_DAEMON = Path(__file__).parent / "helpers" / "gated_daemon.py"


class Daemon:
    def __init__(self, workdir: Path, *args: str, root: Path | None = None,
                 shm_dir: Path | None = None, gate: Path | None = None, umask: int = -1,
                 prelude: str = "", env: dict[str, str] | None = None) -> None:
        self.root = root or workdir / "root"
        self.root.mkdir(parents=True, exist_ok=True)
        # Socket paths are limited to 107 bytes; pytest's tmp_path can be longer.
        self._sockdir = Path(tempfile.mkdtemp(prefix="fpd-"))
        self.socket = self._sockdir / "fpd.sock"
        # Segments live on a tmpfs as in production, in a directory of this test's own.
        self.shm_dir = shm_dir or Path(tempfile.mkdtemp(prefix="fpt-", dir=_shm_base()))
        self.args = list(args)
        # With a gate: each data-file write waits until the gate file exists
        # (tests/helpers/gated_daemon.py; open_gate()).
        self.gate = gate
        self.umask = umask  # the daemon process's (-1: this process's)
        # Python run in the daemon's process before it starts (fault injection)
        self.prelude = prelude
        # Set in the daemon's environment: FASTPERSIST_NODE for two simulated
        # nodes' daemons on one shared root (each node's daemon locks the root).
        self.env = env or {}
        self.log_path = workdir / f"fastpersistd-{time.monotonic_ns()}.log"
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def address(self) -> str:
        return f"unix://{self.socket}"

    def start(self, timeout: float = 30.0) -> Daemon:
        log = open(self.log_path, "ab")  # noqa: SIM115 (the process owns it)
        if self.gate is not None:
            program = [sys.executable, str(GATED_DAEMON), str(self.gate)]
        elif self.prelude:
            program = [sys.executable, "-c", self.prelude + "\nimport sys\n"
                       "from fastpersist.daemon.cli import main\nsys.exit(main(sys.argv[1:]))"]
        else:
            program = [sys.executable, "-m", "fastpersist.daemon"]
        self.proc = subprocess.Popen(
            [*program, "--root", str(self.root),
             "--socket", str(self.socket), "--shm-dir", str(self.shm_dir), *self.args],
            stdout=log, stderr=log, env={**os.environ, **self.env}, umask=self.umask,
        )
        log.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"fastpersistd exited with {self.proc.returncode}:\n{self.log}")
            if self.socket.exists():
                client = DaemonClient(self.address)
                try:
                    if client.health(timeout=2.0) == "SERVING":
                        return self
                except CheckpointError:
                    pass
                finally:
                    client.close()
            time.sleep(0.05)
        self.kill()
        raise RuntimeError(f"fastpersistd did not become ready in {timeout} s:\n{self.log}")

    def stop(self, timeout: float = 60.0) -> int:
        """SIGTERM and wait; returns the exit status."""
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout)

    def open_gate(self) -> None:
        """Let a gated daemon's writes go ahead (all of them, from now on)."""
        assert self.gate is not None
        self.gate.touch()

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def client(self) -> DaemonClient:
        return DaemonClient(self.address)

    @property
    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def events(self, name: str | None = None) -> list[dict[str, Any]]:
        """The JSON log lines (the daemon's default format), optionally of one event."""
        out = []
        for line in self.log.splitlines():
            with contextlib.suppress(ValueError):
                doc = json.loads(line)
                if isinstance(doc, dict) and (name is None or doc.get("event") == name):
                    out.append(doc)
        return out

    def cleanup(self) -> None:
        if self.gate is not None:
            self.open_gate()
        self.kill()
        shutil.rmtree(self._sockdir, ignore_errors=True)
        shutil.rmtree(self.shm_dir, ignore_errors=True)


@contextlib.contextmanager
def serving(d: Daemon, monkeypatch: Any) -> Iterator[Daemon]:
    """d started (unless it is), with this process's saves pointed at its
    shared memory (FASTPERSIST_SHM_DIR); on the way out, this process's
    shared staging dropped (what is in flight aborted) and the daemon gone."""
    from fastpersist.saving.registry import close_shared

    if d.proc is None:
        d.start()
    monkeypatch.setenv("FASTPERSIST_SHM_DIR", str(d.shm_dir))
    try:
        yield d
    finally:
        close_shared(abort=True)
        d.cleanup()


def root_entries(root: Path) -> list[str]:
    """The names in a daemon's root, but for its lock file (rootlock.py)."""
    return sorted(p.name for p in root.iterdir() if not is_lock_file(p.name))


def is_lock_file(name: str) -> bool:
    return name.startswith(".fastpersistd@") and name.endswith(".lock")


def _shm_base() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
