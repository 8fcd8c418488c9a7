"""Fuzzing fastpersistd: random, structured and mutated calls of its 15 RPCs,
whole saves (compressed ones among them, their segments truncated under the
daemon) and calls over TCP from peers without the token, with attacks on its
root and shm directory in between (tests/daemon_fuzzing.py).

The daemon must never die or freeze (a prober asks Info and health all along),
must answer every call with a specific status code (never UNKNOWN or
INTERNAL; UNAUTHENTICATED to every call without the token), must create,
rename, read and delete nothing outside its root (a sentinel directory
outside it is compared before and after; no file in the root may hold the
sentinel's secret; no symlink may appear in the root but the ones the
attacks planted), and its memory must stay bounded (VmRSS from /proc, after
a warm-up).

FASTPERSIST_FUZZ_CASES sets the number of calls (default: a CI-sized run);
FASTPERSIST_FUZZ_SEED the generator's seed.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import tls_support
from daemon_fuzzing import SECRET, Fuzzer, Stranger
from daemon_raw import Raw, assert_serving, close_remote_savers
from daemon_support import Daemon
from grpc import StatusCode as Code

from fastpersist._proto import fastpersist_pb2 as pb

CASES = int(os.environ.get("FASTPERSIST_FUZZ_CASES", "1500"))
SEED = int(os.environ.get("FASTPERSIST_FUZZ_SEED", "20261130"))
UNSPECIFIC = {Code.UNKNOWN, Code.INTERNAL}
# The daemon is gone or frozen (a Wait may run into its own short deadline).
DEAD = {Code.UNAVAILABLE, Code.CANCELLED, Code.DEADLINE_EXCEEDED}
RPC_NAMES = ["Info", "Begin", "Open", "SubmitShm", "SubmitStream", "Commit", "Abort", "Wait",
             "Watch", "List", "Delete", "BeginJob", "CommitJob", "ResolvePrepared", "AbortJob",
             "MemoryCopy", "Replicate", "Replicas", "ReadReplica",
             "save", "save_zstd", "stranger"]
# Growth of the daemon's RSS allowed from the end of the warm-up to the end.
# Measured: see test_the_daemon_survives_fuzzing's report.
MAX_RSS_GROWTH = 48 << 20


def rss(pid: int) -> dict[str, int]:
    """VmRSS and its parts (RssAnon, RssFile, RssShmem), in bytes."""
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "RssAnon", "RssFile", "RssShmem"):
            out[key] = int(value.split()[0]) << 10
    return out


def snapshot(directory: Path) -> dict[str, str]:
    """Every entry under `directory` (not following links): kind, and content hash."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(directory):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            if p.is_symlink():
                out[str(p)] = "link:" + os.readlink(p)
            elif p.is_file():
                out[str(p)] = hashlib.sha256(p.read_bytes()).hexdigest()
            else:
                out[str(p)] = "dir" if p.is_dir() else "other"
    return out


def root_findings(root: Path, planted: dict[int, str]) -> list[str]:
    """Symlinks in the root the attacks did not plant, or that were renamed
    (published); files holding the secret."""
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            if p.is_symlink():
                if planted.get(os.lstat(p).st_ino) != name:
                    found.append(f"a symlink the daemon made or renamed: {p}")
            elif p.is_file() and SECRET in p.read_bytes():
                found.append(f"the sentinel's secret in {p}")
    return found


class Prober:
    """Info and health every 50 ms, on a channel of their own: liveness."""

    def __init__(self, daemon: Daemon) -> None:
        self.raw = Raw(daemon)
        self.client = daemon.client()
        self.failures: list[str] = []
        self.calls = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            try:
                self.raw.stub.Info(pb.InfoRequest(), timeout=30)
                if self.client.health(timeout=30) != "SERVING":
                    self.failures.append("health: not SERVING")
                self.calls += 1
            except Exception as exc:
                self.failures.append(repr(exc)[:300])

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        self.raw.close()
        self.client.close()


@pytest.fixture
def campaign(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Fuzzer]:
    sentinel = tmp_path / "sentinel"
    (sentinel / "sub").mkdir(parents=True)
    (sentinel / "secret").write_bytes(SECRET * 256)
    (sentinel / "sub" / "manifest.json").write_bytes(b'{"' + SECRET + b'": 1}')
    (tmp_path / "d").mkdir()
    tcp: list[str] = []
    if shutil.which("openssl") is not None:  # TCP, for the peers without the token
        files = tls_support.server_files(tmp_path)
        port = tls_support.free_port()
        tcp = ["--listen", f"127.0.0.1:{port}", "--tls-cert", str(files["cert"]),
               "--tls-key", str(files["key"]), "--token-file", str(files["token"])]
    d = Daemon(tmp_path / "d", "--idle-timeout", "3", "--staging-budget", "256M",
               "--replica-bytes", "8M", *tcp)
    d.start()
    monkeypatch.setenv("FASTPERSIST_SHM_DIR", str(d.shm_dir))
    for var in ("http_proxy", "https_proxy", "grpc_proxy", "HTTP_PROXY", "HTTPS_PROXY"):
        monkeypatch.delenv(var, raising=False)
    raw = Raw(d)
    fuzzer = Fuzzer(d, raw, sentinel, SEED)
    if tcp:
        fuzzer.stranger = Stranger(port, files["cert"].read_bytes())
    fuzzer.sentinel_shm = d.shm_dir.parent / f"{d.shm_dir.name}-secret"
    fuzzer.sentinel_shm.write_bytes(SECRET * 1024)
    try:
        yield fuzzer
    finally:
        for call in fuzzer.watches:
            call.cancel()
        for sock in fuzzer.sockets:
            sock.close()
        if fuzzer.stranger is not None:
            fuzzer.stranger.close()
        raw.close()
        close_remote_savers()
        # Unblock anything stuck on a planted FIFO, so that the daemon can stop.
        # (os.walk: the daemon may be removing leftovers while we look, which
        # makes Path.rglob raise for a directory that just went.)
        found = [Path(top) / name for top, dirs, files in os.walk(d.root)
                 for name in dirs + files]
        for fifo in found + list(d.shm_dir.iterdir()):
            with contextlib.suppress(OSError):
                if fifo.is_fifo():
                    os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        fuzzer.sentinel_shm.unlink()
        d.cleanup()


def test_the_daemon_survives_fuzzing(campaign: Fuzzer) -> None:
    f, d = campaign, campaign.d
    assert d.proc is not None
    before = snapshot(f.sentinel)
    outside_root = sorted(p.name for p in d.root.parent.iterdir())
    calls = f.calls()
    codes: Counter[str] = Counter()
    unspecific: list[str] = []
    prober = Prober(d)
    warm = max(CASES // 5, 1)
    samples: list[tuple[int, dict[str, int]]] = [(0, rss(d.proc.pid))]
    started = time.monotonic()
    try:
        for i in range(CASES):
            if f.rng.random() < 0.15:
                with contextlib.suppress(OSError):  # it races the daemon: that is its point
                    f.attack()
            k = f.rng.randrange(len(calls))
            name = RPC_NAMES[k]
            try:
                calls[k]()
                code = Code.OK
            except grpc.RpcError as exc:
                code = exc.code()
                if code in UNSPECIFIC or (code in DEAD and name not in ("Wait", "save",
                                                                        "save_zstd")):
                    unspecific.append(f"case {i} {name}: {code.name}: {exc.details()}"[:400])
            if name == "stranger" and f.stranger is not None and code != Code.UNAUTHENTICATED:
                unspecific.append(f"case {i} {name}: {code.name} to a peer without the token")
            codes[f"{name} {code.name}"] += 1
            assert d.proc.poll() is None, f"the daemon died at case {i} ({name}):\n{d.log[-3000:]}"
            if i + 1 == warm or (i + 1) % 1000 == 0 or i + 1 == CASES:
                samples.append((i + 1, rss(d.proc.pid)))
    finally:
        prober.stop()
    seconds = time.monotonic() - started
    faulted = sum("SIGBUS" in e.get("error", "") for e in d.events("failed"))
    report = "\n".join(
        [f"fuzz: {CASES} cases, seed {SEED}, {seconds:.0f} s, {f.n} attacks, "
         f"{prober.calls} probes, {faulted} checkpoints failed by a truncated segment (SIGBUS)"]
        + [f"  after {n:6d}: " + ", ".join(f"{k} {v >> 20} MiB" for k, v in s.items())
           for n, s in samples]
        + [f"  {k}: {v}" for k, v in sorted(codes.items())])
    print(report)
    assert unspecific == [], report
    assert prober.failures == [], prober.failures[:10]
    assert snapshot(f.sentinel) == before, "something outside the root changed"
    assert sorted(p.name for p in d.root.parent.iterdir()) == outside_root
    assert root_findings(d.root, f.planted_links) == []
    warm_rss = next(s for n, s in samples if n == warm)["VmRSS"]
    growth = samples[-1][1]["VmRSS"] - warm_rss
    assert growth < MAX_RSS_GROWTH, report
    assert_serving(d)
