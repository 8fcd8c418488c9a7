"""fastpersistd's crash guarantees, each tested by SIGKILL (or SIGTERM) at a bad moment.

The contract (proto/fastpersist.proto): from Commit's reply on (async_save
returned: the hand-over) the checkpoint is the daemon's and is committed even if
the client dies; a checkpoint whose client dies before that is aborted, leaves
nothing visible and frees its staging; a client's shared-memory segments are
reclaimed once nobody holds them; a daemon killed mid-write leaves no partial
checkpoint visible, its client gets an error instead of a hang, and the daemon
cleans up the leftover when it restarts; SIGTERM finishes what was handed over,
aborts the rest, and exits 0.

The trainers are real processes (tests/helpers/daemon_crash_client.py) that
report on stdout; the test kills them with SIGKILL the moment a report arrives
(or after a random delay). The daemon is a real fastpersistd (the `daemon`
fixture); where a kill must land while the daemon is still writing, it runs
with one I/O thread of 16 KiB blocks (`slow_daemon`), so a few hundred MB take
about a second to write whatever the disk. Each test checks afterwards that its
kill landed where it was aimed (from the daemon's log timestamps or what the
kill left on disk), so a machine too fast for the timing fails loudly instead of
passing vacuously.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import queue
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest
from support import daemon_saver

import fastpersist
from fastpersist import CheckpointAbortedError, CheckpointError, CheckpointNotFoundError
from fastpersist.engine import get_engine
from fastpersist.errors import DaemonUnavailableError
from fastpersist.protocol import shm
from fastpersist.storage.commit import parse_leftover
from fastpersist.tensors import verifying

HELPERS = Path(__file__).parent / "helpers"
CLIENT = HELPERS / "daemon_crash_client.py"


def _load_states() -> Any:
    spec = importlib.util.spec_from_file_location("daemon_crash_state",
                                                  HELPERS / "daemon_crash_state.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


states = _load_states()
make_state, mismatch = states.make_state, states.mismatch

MIB = 1 << 20
# The big state: 4 int32 tensors of 20M elements (320 MB); ~1.2 s for slow_daemon.
BIG = {"tensors": 4, "numel": 20_000_000}
# The split state: 6 tensors of 3 MiB; with an 8 MiB staging budget each is a data
# file of its own (a file may take half the budget), so the snapshot has 6 steps.
SPLIT = {"tensors": 6, "numel": 3 * MIB // 4}
SPLIT_ENV = {"FASTPERSIST_STAGING_BUDGET": str(8 * MIB)}
SMALL = {"tensors": 2, "numel": MIB // 4}
T = TypeVar("T")


# --- polling ----------------------------------------------------------------------------


def wait_until(what: str, fn: Callable[[], T], timeout: float = 20.0, every: float = 0.02) -> T:
    """fn()'s first truthy value, polled until the deadline; fails naming `what`."""
    deadline = time.monotonic() + timeout
    while True:
        value = fn()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout} s waiting for {what}")
        time.sleep(every)


def settled(daemon: Any) -> bool:
    """No checkpoint in flight and no staging reserved."""
    client = daemon.client()
    try:
        info = client.info()
    finally:
        client.close()
    return info.checkpoints_in_flight == 0 and info.staging_in_use == 0


def _rglob(root: Path, pattern: str) -> list[Path]:
    """root.rglob, retried when a directory vanishes under it (an abort's rmtree)."""
    for _ in range(20):
        try:
            return sorted(root.rglob(pattern))
        except FileNotFoundError:
            time.sleep(0.01)
    return sorted(root.rglob(pattern))


def staging_dirs(root: Path) -> list[Path]:
    """Staging directories of unfinished saves (`.NAME.fp-tmp-PID-RAND@HOST`) under root."""
    return [p for p in _rglob(root, ".*.fp-tmp-*") if p.is_dir()]


def manifests(root: Path) -> list[Path]:
    return _rglob(root, "manifest.json")


def events_of(daemon: Any, name: str, path: str) -> list[dict[str, Any]]:
    return [e for e in daemon.events(name) if e.get("path") == path]


def reclaimed_segments(daemon: Any) -> set[str]:
    return {e["segment"] for e in daemon.events("reclaimed-segment")}


def last_run(daemon: Any) -> list[dict[str, Any]]:
    """The log events of the daemon's latest process from its "ready" on (the log
    file is appended to by each process)."""
    events = daemon.events()
    starts = [i for i, e in enumerate(events) if e["event"] == "ready"]
    return events[starts[-1]:] if starts else events


def segments_of(shm_dir: Path, pid: int) -> list[str]:
    return sorted(p.name for p in shm_dir.iterdir() if p.name.startswith(f"fastpersist-{pid}-"))


def data_file(root: Path, name: str) -> Path | None:
    """File 0 of the save of root/name in progress, if there is one."""
    try:
        found = sorted(root.glob(f".{name}.fp-tmp-*/data-00000.safetensors"))
    except FileNotFoundError:  # root not made yet, or a directory vanished under glob
        return None
    return found[0] if found else None


def partly_written(path: Path) -> bool:
    """The data file's header is on disk and its last page is not yet (the engine
    preallocates the file, so unwritten pages read as zeros, and a state's
    tensors have no zero page)."""
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            head = os.pread(f.fileno(), 8, 0)
            tail = os.pread(f.fileno(), 4096, size - 4096) if size >= 8192 else b"x"
    except FileNotFoundError:
        return False
    return head != bytes(8) and tail == bytes(len(tail))


def assert_daemon_healthy(daemon: Any) -> None:
    """Nothing failed in the daemon and nothing raised out of a handler or worker
    (every log line is one of its JSON events)."""
    bad = [e for e in daemon.events() if e["event"] in ("failed", "worker-error")
           or e["level"] == "error"]
    assert not bad, bad
    stray = [line for line in daemon.log.splitlines() if not line.startswith("{")]
    assert not stray, "\n".join(stray[:40])


def assert_loads(path: Path, step: int, shape: dict[str, int]) -> None:
    """The checkpoint loads (every CRC checked) and holds exactly make_state(step)."""
    loaded = fastpersist.load(path, verify=True)
    problem = mismatch(loaded, step, shape["tensors"], shape["numel"])
    assert problem is None, f"{path}: {problem}"
    report = verifying.verify(path, get_engine())
    assert report.ok, report


class Background:
    """fn() (a save) on a thread of its own, so that a hang shows as a timeout."""

    def __init__(self, fn: Callable[[], None]) -> None:
        self.error: BaseException | None = None
        self.finished_at: float | None = None
        self.thread = threading.Thread(target=self._run, args=(fn,), daemon=True)
        self.thread.start()

    def _run(self, fn: Callable[[], None]) -> None:
        try:
            fn()
        except BaseException as exc:
            self.error = exc
        self.finished_at = time.monotonic()


# --- trainer processes --------------------------------------------------------------------


class Client:
    """One tests/helpers/daemon_crash_client.py process and its stdout lines."""

    def __init__(self, daemon: Any, job: dict[str, Any], log: Path,
                 env: dict[str, str] | None = None) -> None:
        self.log = log
        full_env = {**os.environ, "FASTPERSIST_DAEMON": daemon.address,
                    "FASTPERSIST_SHM_DIR": str(daemon.shm_dir), **(env or {})}
        with open(log, "wb") as err:
            self.proc = subprocess.Popen([sys.executable, str(CLIENT), json.dumps(job)],
                                         stdout=subprocess.PIPE, stderr=err, env=full_env)
        self.pid = self.proc.pid
        self.lines: list[str] = []
        self._queue: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        self.killed_at: float | None = None  # time.time() just before the SIGKILL

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._queue.put(line.decode().strip())
        self._queue.put(None)

    def _take(self, timeout: float) -> str | None:
        line = self._queue.get(timeout=timeout)
        if line is not None:
            self.lines.append(line)
        return line

    def wait_for(self, prefix: str, timeout: float = 60.0) -> str:
        """The next line starting with `prefix`; fails if the client exits first."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self._take(max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                pytest.fail(f"client {self.pid}: no {prefix!r} within {timeout} s; "
                            f"said {self.lines}\n{self.stderr}")
            if line is None:
                pytest.fail(f"client {self.pid} exited ({self.proc.wait()}) before {prefix!r}; "
                            f"said {self.lines}\n{self.stderr}")
            if line.startswith(prefix):
                return line
            if line.startswith("handed-over") or line == "gave-up":
                pytest.fail(f"client {self.pid} said {line!r} while we waited for {prefix!r}")

    def kill(self) -> float:
        """SIGKILL; returns the wall-clock time of the kill (to compare with log stamps)."""
        self.killed_at = time.time()
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)
        self.proc.wait(30)
        with contextlib.suppress(queue.Empty):  # what it said before dying
            while self._take(5.0) is not None:
                pass
        return self.killed_at

    def said(self, prefix: str) -> list[str]:
        return [line for line in self.lines if line.startswith(prefix)]

    @property
    def stderr(self) -> str:
        try:
            return self.log.read_text(errors="replace")[-4000:]
        except FileNotFoundError:
            return ""


@pytest.fixture
def clients(tmp_path: Path) -> Iterator[Callable[..., Client]]:
    """start(daemon, job, env=None) -> Client; every client is killed at the end."""
    started: list[Client] = []

    def start(daemon: Any, job: dict[str, Any], env: dict[str, str] | None = None) -> Client:
        c = Client(daemon, job, tmp_path / f"client-{len(started)}.stderr", env)
        started.append(c)
        return c

    yield start
    for c in started:
        if c.proc.poll() is None:
            c.proc.kill()
            c.proc.wait()


def _restarted_slow(daemon: Any, monkeypatch: pytest.MonkeyPatch, block: int) -> Any:
    assert daemon.stop() == 0
    with monkeypatch.context() as m:
        m.setenv("FASTPERSIST_THREADS", "1")
        m.setenv("FASTPERSIST_BLOCK_SIZE", str(block))
        daemon.start()
    return daemon


@pytest.fixture
def slow_daemon(daemon: Any, monkeypatch: pytest.MonkeyPatch) -> Any:
    """The `daemon`, restarted to write with one I/O thread of 16 KiB blocks (about
    0.3 GB/s): a 320 MB checkpoint is still being written a second after hand-over."""
    return _restarted_slow(daemon, monkeypatch, 16384)


@pytest.fixture
def slower_daemon(daemon: Any, monkeypatch: pytest.MonkeyPatch) -> Any:
    """slow_daemon with 4 KiB blocks (several times slower): a 48 MiB file is
    still being written after the test has seen it start, asked the daemon
    for its state and killed the client, even on a loaded machine (with 16
    KiB blocks it was sometimes done by then, and the abort then removed it)."""
    return _restarted_slow(daemon, monkeypatch, 4096)


# --- 1. the trainer dies right after the hand-over -----------------------------------------


def test_client_killed_right_after_hand_over_is_committed(slow_daemon, clients):
    d = slow_daemon
    target = d.root / "ck"
    c = clients(d, {"kind": "handover", "target": str(target), "step": 3, **BIG})
    c.wait_for("ready")
    c.wait_for("handed-over")
    killed_at = c.kill()
    # Its segments look old now, so housekeeping unlinks them at its next pass,
    # likely while the daemon still writes from them (its mappings keep the pages).
    segments = segments_of(d.shm_dir, c.pid)
    assert segments
    old = time.time() - 60
    for name in segments:
        os.utime(d.shm_dir / name, (old, old))

    committed = wait_until("the daemon to commit ck", lambda: events_of(d, "committed", "ck"),
                           timeout=60)
    assert len(committed) == 1, committed
    # The kill landed while the daemon was still writing (else this proves nothing).
    assert committed[0]["ts"] + 0.001 > killed_at, (
        f"ck was committed before the client was killed: {committed}, kill at {killed_at}")
    assert not events_of(d, "aborted", "ck") and not d.events("client-gone")
    assert committed[0]["bytes"] >= states.state_nbytes(**BIG)

    assert_loads(target, 3, BIG)
    proc = subprocess.run([sys.executable, "-m", "fastpersist.cli", "verify", str(target)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert manifests(d.root) == [target / "manifest.json"]
    wait_until("the staging directory to go", lambda: not staging_dirs(d.root), timeout=5)
    wait_until("the daemon to settle", lambda: settled(d), timeout=5)
    wait_until("the dead client's segments to be reclaimed",
               lambda: not segments_of(d.shm_dir, c.pid), timeout=10, every=0.1)
    wait_until("the reclaims to be logged", lambda: set(segments) <= reclaimed_segments(d),
               timeout=5)
    assert_daemon_healthy(d)


def test_client_killed_after_hand_over_of_a_compressed_save_is_committed(tmp_path, clients):
    """compression="zstd": the daemon, not the client, encodes; a client dead
    before the daemon even began (every write held at a gate) loses nothing."""
    from daemon_support import Daemon

    d = Daemon(tmp_path, gate=tmp_path / "gate").start()
    try:
        target = d.root / "ck"
        c = clients(d, {"kind": "handover", "target": str(target), "step": 5,
                        "compression": "zstd", **SMALL})
        c.wait_for("handed-over")
        killed_at = c.kill()
        # Nothing written yet: the gate holds the daemon's first write.
        assert not target.exists() and not list(d.root.rglob("data-*"))
        d.open_gate()
        committed = wait_until("the daemon to commit ck", lambda: events_of(d, "committed", "ck"),
                               timeout=60)
        assert committed[0]["ts"] > killed_at
        assert_loads(target, 5, SMALL)
        names = sorted(p.name for p in target.iterdir())
        assert names and all(n.endswith(".fpz") for n in names if n != "manifest.json"), names
        wait_until("the daemon to settle", lambda: settled(d), timeout=5)
        assert_daemon_healthy(d)
    finally:
        d.cleanup()


# --- 2. the trainer dies before the hand-over -----------------------------------------------

# Where the client is when it dies (the daemon's checkpoint is RECEIVING):
#   "idle": small files; the daemon has written file 0, file 1 is being copied
#   "writing": 48 MiB files and slow_daemon; the daemon is still writing file 0
#       from the client's segment
#   "streaming": 6 MiB tensors, over half the 8 MiB budget, so each is streamed
#       over gRPC (SubmitStream); the first stream stops halfway
WRITING = {"tensors": 4, "numel": 12 * MIB}
WRITING_ENV = {"FASTPERSIST_STAGING_BUDGET": str(128 * MIB)}
STREAMING = {"tensors": 3, "numel": 6 * MIB // 4}


@pytest.mark.parametrize("moment", ["idle", "writing", "streaming"])
def test_client_killed_before_hand_over_is_aborted_and_cleaned_up(moment, request, clients):
    writing = moment == "writing"
    daemon = request.getfixturevalue("slower_daemon" if writing else "daemon")
    target = daemon.root / "sub" / "ck"
    shape, env = {"idle": (SPLIT, SPLIT_ENV), "writing": (WRITING, WRITING_ENV),
                  "streaming": (STREAMING, SPLIT_ENV)}[moment]
    c = clients(daemon, {"kind": "block", "target": str(target), "step": 4, "block_at": 1,
                         "block_stream": moment == "streaming", **shape}, env=env)
    if moment == "streaming":
        c.wait_for("streaming")
    else:
        c.wait_for("staging 1")  # file 0 is submitted, file 1's snapshot never ends
    # Where the kill lands: the daemon holds the checkpoint (staging reserved, a
    # staging directory) and the client holds its segments.
    if writing:
        wait_until("the daemon to write file 0",
                   lambda: (p := data_file(target.parent, "ck")) and partly_written(p),
                   timeout=10, every=0.005)
    client = daemon.client()
    try:
        info = client.info()
        assert info.checkpoints_in_flight == 1 and info.staging_in_use > 0, info
        (status,) = client.list("").in_flight
        assert status.path == "sub/ck" and status.state == 1, status  # RECEIVING
    finally:
        client.close()
    assert len(staging_dirs(daemon.root)) == 1
    segments = segments_of(daemon.shm_dir, c.pid)
    assert segments or moment == "streaming", sorted(os.listdir(daemon.shm_dir))

    c.kill()
    if writing:
        data = data_file(target.parent, "ck")
        assert data is not None and partly_written(data), "file 0 was written before the kill"
        # Make the segments look old, so that housekeeping unlinks them as soon as
        # it runs: maybe while the daemon still writes from them (its mapping holds).
        old = time.time() - 60
        for name in segments:
            with contextlib.suppress(FileNotFoundError):
                os.utime(daemon.shm_dir / name, (old, old))
    # The Watch stream broke: the daemon aborts within about a second.
    wait_until("the staging directory to be removed", lambda: not staging_dirs(daemon.root),
               timeout=15)
    wait_until("the daemon to free the reservation", lambda: settled(daemon), timeout=10)
    assert not os.path.lexists(target)
    assert not os.path.lexists(target.parent), "the parent the save created was left behind"
    assert manifests(daemon.root) == []
    with pytest.raises(CheckpointNotFoundError):
        fastpersist.load(target)
    gone = events_of(daemon, "client-gone", "sub/ck")
    aborted = events_of(daemon, "aborted", "sub/ck")
    assert len(gone) == 1 and len(aborted) == 1, daemon.log
    assert f":{c.pid}:" in gone[0]["client"]
    assert not events_of(daemon, "committed", "sub/ck")
    assert not events_of(daemon, "handed-over", "sub/ck")
    assert_daemon_healthy(daemon)

    # Its segments belong to nobody now: unlinked within a few seconds (segments
    # younger than 5 s are spared; housekeeping runs every 2 s).
    wait_until("the dead client's segments to be reclaimed",
               lambda: not segments_of(daemon.shm_dir, c.pid), timeout=15, every=0.1)
    # (logged just after the unlinks)
    wait_until("the reclaims to be logged", lambda: set(segments) <= reclaimed_segments(daemon),
               timeout=5)

    # The daemon is none the worse: the next save of that path commits.
    fastpersist.save(make_state(5, **SMALL), target, daemon=daemon.address)
    assert_loads(target, 5, SMALL)


def test_client_killed_as_begin_returns_frees_the_path_within_seconds(daemon, clients):
    """The client dies with the checkpoint's id in hand and nothing else sent: no
    file, no progress stream of its own. The daemon runs with its default
    --idle-timeout (300 s), so only a liveness lease held from the first request
    aborts the checkpoint in time for the restarted trainer's save of the step."""
    assert "--idle-timeout" not in daemon.args
    target = daemon.root / "run" / "step-00000005"
    c = clients(daemon, {"kind": "begun", "target": str(target), "step": 5, **SMALL})
    c.wait_for("ready")
    assert c.proc.wait(60) == -signal.SIGKILL, (c.lines, c.stderr)
    assert not c.said("handed-over")
    begun = events_of(daemon, "begin", "run/step-00000005")
    assert len(begun) == 1 and f":{c.pid}:" in begun[0]["client"], daemon.log

    # "Within a few seconds": the timeouts are generous for a loaded machine and
    # still far below the idle timeout.
    wait_until("the daemon to abort the dead client's checkpoint",
               lambda: events_of(daemon, "aborted", "run/step-00000005"), timeout=30)
    wait_until("the staging directory to be removed", lambda: not staging_dirs(daemon.root),
               timeout=15)
    wait_until("the daemon to free the reservation", lambda: settled(daemon), timeout=15)
    ident = begun[0]["checkpoint"]
    assert not [e for e in daemon.events("idle-abort") if e["checkpoint"] == ident]
    # The restarted trainer saves the same step: not refused as in flight.
    fastpersist.save(make_state(5, **SMALL), target, daemon=daemon.address)
    assert_loads(target, 5, SMALL)
    assert_daemon_healthy(daemon)


# --- 3. the daemon dies mid-write ------------------------------------------------------------


# "after": killed after async_save returned (the future reports the failure);
# "before": killed while async_save is still sending files (a 64 MiB staging
# budget: 8 files of 24 MiB, each sent once the previous one is written), so
# async_save itself must fail instead of waiting for a daemon that is gone.
@pytest.mark.parametrize("hand_over", ["after", "before"])
def test_daemon_killed_mid_write(hand_over, slow_daemon, monkeypatch):
    d = slow_daemon
    big = d.root / "runs" / "big"  # below the root: the startup cleanup walks the tree
    fastpersist.save(make_state(1, **SMALL), d.root / "good", daemon=d.address)
    # An earlier version of the target itself, which the killed save was replacing.
    fastpersist.save(make_state(0, **SMALL), big, daemon=d.address)
    manifests_before = {p: p.read_bytes() for p in manifests(d.root)}

    if hand_over == "after":
        future = fastpersist.async_save(make_state(2, **BIG), big, daemon=d.address)
        save = Background(lambda: future.result(timeout=30))
    else:
        monkeypatch.setenv("FASTPERSIST_STAGING_BUDGET", str(64 * MIB))
        state = make_state(2, tensors=8, numel=6 * MIB)
        save = Background(lambda: fastpersist.async_save(
            state, big, daemon=d.address).result(timeout=30))
    data = wait_until("the daemon to start writing big",
                      lambda: (p := data_file(big.parent, "big")) and partly_written(p) and p,
                      timeout=30, every=0.005)
    if hand_over == "before":
        assert len(events_of(d, "handed-over", "runs/big")) == 1  # version 0's
    d.kill()
    killed = time.monotonic()
    assert partly_written(data), "the daemon had finished the file before the kill"

    save.thread.join(30)
    assert not save.thread.is_alive(), "the client still waits for a daemon killed 30 s ago"
    assert save.finished_at is not None and save.finished_at - killed < 10, (
        f"the client took {save.finished_at - killed:.1f} s to notice the daemon was gone")
    err = save.error
    assert isinstance(err, CheckpointError), repr(err)
    assert isinstance(err, DaemonUnavailableError) or "not answering" in str(err), repr(err)

    # The partial checkpoint is invisible, the earlier ones intact.
    (staging,) = staging_dirs(d.root)
    assert not (staging / "manifest.json").exists()
    with pytest.raises(CheckpointNotFoundError):
        fastpersist.load(staging)
    assert {p: p.read_bytes() for p in manifests(d.root)} == manifests_before
    assert_loads(d.root / "good", 1, SMALL)
    assert_loads(big, 0, SMALL)
    assert len(events_of(d, "committed", "runs/big")) == 1  # version 0 only

    # The restarted daemon removes the leftover before it serves.
    leftover = parse_leftover(staging)
    assert leftover is not None and leftover.kind == "tmp" and not leftover.owner_alive
    logged = len(d.events())
    d.start()
    assert not staging.exists()
    cleanups = [e for e in d.events()[logged:] if e["event"] == "cleanup"]
    assert any(staging.name in e["action"] for e in cleanups), d.events()[logged:]
    assert staging_dirs(d.root) == []
    assert {p: p.read_bytes() for p in manifests(d.root)} == manifests_before
    assert_loads(d.root / "good", 1, SMALL)
    assert_loads(big, 0, SMALL)
    assert settled(d)

    # And saves through it work, from a new connection and through the one that
    # went down with the old daemon (this process's saver, which saw the failure).
    monkeypatch.delenv("FASTPERSIST_STAGING_BUDGET", raising=False)
    fresh = daemon_saver(d.address)
    try:
        fresh.save(make_state(3, **SMALL), d.root / "after").result(timeout=60)
    finally:
        fresh.close()
    assert_loads(d.root / "after", 3, SMALL)
    fastpersist.async_save(make_state(4, **SMALL), big, daemon=d.address).result(timeout=60)
    assert_loads(big, 4, SMALL)


# --- 4. a restarted daemon reclaims the segments of dead clients ----------------------------


def test_restarted_daemon_reclaims_dead_clients_segments(daemon, clients):
    c = clients(daemon, {"kind": "segment", "size": MIB})
    dead_name = c.wait_for("segment").split()[1]
    dead = daemon.shm_dir / dead_name
    assert dead.exists()
    live = shm.Segment(daemon.shm_dir, MIB)  # this process lives on: a live client's
    try:
        old = time.time() - 60  # the reclaimer spares segments younger than 5 s
        for path in (dead, live.path):
            os.utime(path, (old, old))
        daemon.kill()
        c.kill()
        assert dead.exists()  # nobody reclaims while the daemon is down
        assert not any(e["segment"] == dead_name for e in daemon.events("reclaimed-segment"))

        daemon.start()
        assert not dead.exists(), "the restarted daemon did not reclaim the dead segment"
        reclaimed = [e["segment"] for e in daemon.events("reclaimed-segment")]
        assert dead_name in reclaimed
        assert live.path.exists() and live.name not in reclaimed

        # Housekeeping passes leave it alone too: an unheld segment put there now
        # is reclaimed by one, and the live one survives it.
        orphan = daemon.shm_dir / f"fastpersist-{2**22 + 1}-0123456789abcdef"
        orphan.write_bytes(b"\0" * 4096)
        os.utime(orphan, (old, old))
        wait_until("a housekeeping pass to reclaim the orphan", lambda: not orphan.exists(),
                   timeout=10, every=0.1)
        wait_until("the reclaim to be logged", lambda: orphan.name in reclaimed_segments(daemon),
                   timeout=5)
        assert live.path.exists() and live.name not in reclaimed_segments(daemon)
    finally:
        live.close()


# --- 5. SIGTERM: finish what was handed over, abort the rest ---------------------------------


def test_sigterm_commits_handed_over_and_aborts_the_rest(slow_daemon, clients, monkeypatch,
                                                         request):
    """In flight at the SIGTERM: "a", handed over and being written (this process);
    "pending", whose client (a process) is stuck copying its second file; "sending",
    whose client (a thread here) waits for the daemon to write its first file
    before it sends the next (a 64 MiB staging budget)."""
    d = slow_daemon
    pending = d.root / "pending"
    b = clients(d, {"kind": "block", "target": str(pending), "step": 6, "block_at": 1,
                    **SPLIT}, env=SPLIT_ENV)
    b.wait_for("staging 1")
    big = make_state(5, **BIG)  # made now: the window before the SIGTERM stays short
    monkeypatch.setenv("FASTPERSIST_STAGING_BUDGET", str(64 * MIB))
    # Long enough at the slow daemon's pace that it is still being sent at the SIGTERM.
    state = make_state(7, tensors=16, numel=6 * MIB)
    # A saver of its own: the process-wide one would hold "a" back until it is done.
    saver = daemon_saver(d.address)
    request.addfinalizer(lambda: saver.close(abort=True))
    sending = Background(lambda: saver.save(state, d.root / "sending").result(timeout=30))
    wait_until("the daemon to write sending's first file",
               lambda: (p := data_file(d.root, "sending")) and partly_written(p),
               timeout=30, every=0.005)
    monkeypatch.delenv("FASTPERSIST_STAGING_BUDGET")  # read when a save starts

    future = fastpersist.async_save(big, d.root / "a", daemon=d.address)
    del big
    assert d.stop(timeout=60) == 0

    run = last_run(d)
    (draining,) = [e for e in run if e["event"] == "draining"]
    # All were in flight when the SIGTERM came: "a" still being written.
    assert draining["in_flight"] == 3, d.log
    assert [e["finished"] for e in run if e["event"] == "stopped"] == [True]
    log = [e for e in run if e.get("path") in ("a", "pending", "sending")
           or e["event"] == "draining"]
    order = [(e["event"], e.get("path")) for e in log]
    assert order.index(("committed", "a")) > order.index(("draining", None)), order
    for name in ("pending", "sending"):
        assert ("committed", name) not in order and ("handed-over", name) not in order, order
        (aborted,) = events_of(d, "aborted", name)
        assert "shutting down" in aborted["reason"]
        assert not os.path.lexists(d.root / name)

    assert_loads(d.root / "a", 5, BIG)
    assert manifests(d.root) == [d.root / "a" / "manifest.json"]
    assert staging_dirs(d.root) == []
    # The client that handed "a" over hears that it committed; the one still
    # sending hears that its checkpoint was aborted, instead of waiting forever.
    future.result(timeout=30)
    sending.thread.join(30)
    assert not sending.thread.is_alive(), "async_save still waits for a daemon that has exited"
    assert isinstance(sending.error, CheckpointAbortedError), repr(sending.error)
    assert "shutting down" in str(sending.error)
    assert_daemon_healthy(d)


# --- 6. kills at random moments of a Checkpointer's loop --------------------------------------

# 4 tensors of 24 MiB with a 64 MiB staging budget: 4 data files (a file may take
# half the budget), the first three written before the hand-over (the client
# waits for each before it sends the next), the last after it. So a kill during
# a save lands before or after a hand-over; the daemon writes each save for about
# 0.3 s (slow_daemon), longer than the client's work between saves.
LOOP = {"tensors": 4, "numel": 6 * MIB}
LOOP_ENV = {"FASTPERSIST_STAGING_BUDGET": str(64 * MIB)}


def _outcomes(daemon: Any, pid: int, killed_at: float) -> list[str]:
    """What became of each checkpoint this client began: "committed" (before the
    kill), "committed-after-kill" (handed over, finished by the daemon alone),
    "aborted" (killed before the hand-over)."""
    ids = {e["checkpoint"]: e["path"] for e in daemon.events("begin")
           if f":{pid}:" in e["client"]}
    out = []
    for ident in ids:
        done = [e for e in daemon.events() if e.get("checkpoint") == ident
                and e["event"] in ("committed", "aborted", "failed")]
        assert len(done) == 1, (ident, done)
        if done[0]["event"] == "committed":
            out.append("committed-after-kill" if done[0]["ts"] + 0.001 > killed_at
                       else "committed")
        else:
            assert done[0]["event"] == "aborted", done
            out.append("aborted")
    return out


def _check_run(root: Path, handed_over: int | None, pids: set[int]) -> list[int]:
    """Every visible checkpoint is complete and holds its step's state; the last
    step handed over is among them. Returns the visible steps."""
    visible = []
    for entry in sorted(root.iterdir()) if root.exists() else []:
        if entry.name.startswith("step-"):
            assert (entry / "manifest.json").is_file(), f"{entry.name} is visible but incomplete"
            step = int(entry.name.removeprefix("step-"))
            assert_loads(entry, step, LOOP)
            visible.append(step)
        elif entry.name == "latest":
            name = entry.read_text().strip()
            assert (root / name / "manifest.json").is_file(), f"latest names {name}"
        elif parse_leftover(entry) is not None:
            # the client's own leftovers (pointer update, retention), for gc
            lo = parse_leftover(entry)
            assert lo is not None and lo.pid in pids and not lo.owner_alive, entry
        else:
            pytest.fail(f"unexpected entry after the kill: {entry.name}")
    if handed_over is not None:
        assert handed_over in visible, (
            f"step {handed_over} was handed over before the kill but is not committed: "
            f"{visible}")
    return visible


@pytest.mark.slow
def test_random_kills_of_a_checkpointer_loop(slow_daemon, clients):
    d = slow_daemon
    # With the default --idle-timeout (300 s): a client killed at any moment,
    # even between Begin's reply and its first file, frees its checkpoint
    # within seconds, as its Open stream breaks.
    assert "--idle-timeout" not in d.args
    rng = random.Random(20240611)
    root = d.root / "run"
    step = 0
    seen: list[list[str]] = []
    pids: set[int] = set()
    # Up to 20 kills: the schedule is random, and on a loaded machine the first
    # ten have been seen to miss the short window before a hand-over.
    for i in range(20):
        kinds = {k for o in seen for k in o}
        if i >= 5 and {"aborted", "committed-after-kill"} <= kinds:
            break
        c = clients(d, {"kind": "loop", "root": str(root), "start": step, "keep_last": 2,
                        **LOOP}, env=LOOP_ENV)
        # A random moment of the save cycle, after the k-th hand-over: every other
        # kill comes within 50 ms of it, while the daemon writes the last file.
        for _ in range(rng.randint(1, 3)):
            c.wait_for("saved")
        time.sleep(rng.uniform(0.0, 0.05) if i % 2 else rng.uniform(0.05, 0.5))
        killed_at = c.kill()
        saved = [int(line.split()[1]) for line in c.said("saved")]
        assert not c.said("gave-up")
        wait_until("the daemon to settle", lambda: settled(d), timeout=15, every=0.05)
        wait_until("the staging directories to go", lambda: not staging_dirs(d.root),
                   timeout=5)
        pids.add(c.pid)
        _check_run(root, saved[-1] if saved else None, pids)
        seen.append(_outcomes(d, c.pid, killed_at))
        step = max([step - 1, *saved]) + 1
    kinds = {k for o in seen for k in o}
    # The kills landed both before a hand-over and between a hand-over and its commit.
    assert {"aborted", "committed-after-kill"} <= kinds, seen
    assert_daemon_healthy(d)


def test_latest_names_the_checkpoint_the_daemon_committed_after_the_client_died(
        slow_daemon, clients):
    """Checkpointer.latest() is "the newest durable checkpoint". In daemon mode the
    newest may have been committed by the daemon after the trainer died, when
    nobody was left to update ROOT/latest; a restarted trainer must still find it."""
    d = slow_daemon
    root = d.root / "run"
    c = clients(d, {"kind": "loop", "root": str(root), "start": 0, "keep_last": 2, **LOOP},
                env=LOOP_ENV)
    c.wait_for("saved 1")  # step 0 is durable (save 1 waited for it), step 1 handed over
    killed_at = c.kill()
    wait_until("the daemon to settle", lambda: settled(d), timeout=15, every=0.05)
    assert _outcomes(d, c.pid, killed_at) == ["committed", "committed-after-kill"], d.log
    assert _check_run(root, 1, {c.pid}) == [0, 1]
    # The daemon moved the pointer itself, with the commit: nobody else was left to.
    assert (root / "latest").read_text() == "step-00000001\n"

    resumed = fastpersist.Checkpointer(root, daemon="")
    assert resumed.steps() == [0, 1]
    assert resumed.latest() == resumed.path_for(1), (
        f"latest() is {resumed.latest()}, but step 1 is committed; ROOT/latest says "
        f"{(root / 'latest').read_text().strip()!r}")
    assert resumed.load_latest()["step"] == 1
