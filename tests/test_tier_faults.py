"""Fault injection on the object-store tier, against a real S3 server process
(moto) behind a fault-injecting proxy (tier_faults.py): throttling and 5xx
answers, connections reset mid-part and after the server acted, requests
stalled past the client's timeout, gc and retention racing the uploads, a
file corrupted on the local disk, and fastpersistd SIGKILLed mid-upload at
random points (FASTPERSIST_TIER_KILLS kills, 20 by default; the full run in
docs/guides/tier.md, "Fault injection", takes 200).

After each scenario, with the faults stopped and the uploader given time:
    lost              a committed checkpoint neither in the store (a remote
                      manifest made from its local manifest, every byte
                      verified) nor still pending
    corrupt uploaded  a remote checkpoint whose bytes do not verify, or do not
                      load as the state that was saved
    unfinished        checkpoints still pending
must all be 0; each scenario also checks that its faults were served."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import random
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from daemon_support import Daemon
from tier_faults import FaultProxy, RandomFaults, Rule, Rules, wait_until

import fastpersist
from fastpersist.cli import main as fpctl
from fastpersist.format.manifest import MANIFEST_NAME, Manifest
from fastpersist.knobs import current as current_knobs
from fastpersist.tensors import tier_read
from fastpersist.tier.client import S3
from fastpersist.tier.listing import CHECKPOINT, listing
from fastpersist.tier.upload import SOURCE_KEY
from fastpersist.tier.url import TierURL

MIB = 1 << 20


@pytest.fixture
def proxy(s3: Any, monkeypatch: pytest.MonkeyPatch) -> Any:
    """The proxy in front of the test's moto server; uploads retry within
    seconds (they would wait up to a minute) and time out after 1 s."""
    monkeypatch.setenv("FASTPERSIST_TIER_PART_BYTES", str(5 * MIB))
    monkeypatch.setenv("FASTPERSIST_TIER_RETRY_MAX", "2")
    monkeypatch.setenv("FASTPERSIST_TIER_TIMEOUT", "1")
    with FaultProxy(s3.endpoint, stall_s=3.0) as p:
        yield p


def _state(step: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(step)
    # 16 MiB: four parts of 5 MiB raw, two or three compressed.
    return {"w": torch.randn(4 * MIB, generator=g), "b": torch.arange(1000) + step,
            "step": step}


def _source(ckpt: Path) -> str:
    return hashlib.sha256((ckpt / MANIFEST_NAME).read_bytes()).hexdigest()


class Figures:
    """What a scenario left in the store, against what it saved."""

    def __init__(self, s3: Any, tier: str) -> None:
        self.store = S3(endpoint_url=s3.endpoint)  # straight to the server
        self.tier = TierURL.parse(tier)

    def remote(self) -> dict[str, str]:
        """Relative path -> the fastpersist-source of each remote checkpoint."""
        out = {}
        for e in listing(self.store, self.tier).entries:
            if e.kind == CHECKPOINT:
                got = self.store.get_with_metadata(self.tier.child(e.name), MANIFEST_NAME,
                                                   64 * MIB)
                assert got is not None
                out[e.name] = got[1].get(SOURCE_KEY, "")
        return out

    def lost(self, saved: dict[str, str], pending: set[str]) -> list[str]:
        """Saved checkpoints (path -> source) neither uploaded nor pending."""
        remote = self.remote()
        return sorted(p for p, source in saved.items()
                      if remote.get(p) != source and p not in pending)

    def corrupt(self, expected: Callable[[str], dict[str, Any] | None]) -> list[str]:
        """Remote checkpoints that do not verify, or do not load as saved
        (expected(path): the state saved there; None: not ours to load)."""
        bad = []
        for path in sorted(self.remote()):
            url = self.tier.child(path)
            report = tier_read.verify(self.store, url)
            state = expected(path)
            if not report.ok:
                bad.append(f"{path}: {report.problems}")
            elif state is not None:
                loaded = fastpersist.load(str(url))  # the environment's endpoint: the server
                if not (torch.equal(loaded["w"], state["w"]) and
                        torch.equal(loaded["b"], state["b"])):
                    bad.append(f"{path}: loads other values")
        return bad


def _step_of(path: str) -> int:
    return int(path.rpartition("step-")[2])


def _in_process(s3: Any, proxy: FaultProxy, tmp_path: Path, schedule: Any, *,
                steps: int = 5, compression: str = "zstd", tier: str | None = None,
                tier_keep_last: int | None = None, healed: Callable[[], None] | None = None
                ) -> tuple[Figures, dict[str, str], Any]:
    """A Checkpointer (keep_last=2, a tier through the proxy) saves `steps`
    checkpoints under `schedule`'s faults, which go on until every upload got
    through them (or two minutes passed); then the faults stop and the rest
    drains. Returns the figures, what was saved and the tier status."""
    tier = tier or s3.url
    proxy.schedule = schedule
    root = tmp_path / "run"
    ckpt = fastpersist.Checkpointer(root, keep_last=2, tier=tier, tier_endpoint=proxy.endpoint,
                                    tier_keep_last=tier_keep_last, tier_compression=compression)
    saved = {}
    for step in range(1, steps + 1):
        ckpt.save(step, _state(step)).result()
        saved[f"step-{step:08d}"] = _source(root / f"step-{step:08d}")
    ckpt.wait_for_tier(120)  # through the faults
    proxy.schedule = lambda _: None  # the faults stop
    if healed is not None:
        healed()
    assert ckpt.wait_for_tier(120), ckpt.tier_status()
    status = ckpt.tier_status()
    ckpt.close()
    return Figures(s3, tier), saved, status


def _assert_clean(figures: Figures, saved: dict[str, str], status: Any,
                  keep: int | None = None) -> None:
    newest = sorted(saved, key=_step_of)[-keep:] if keep else list(saved)
    assert figures.lost({p: saved[p] for p in newest}, set(status.pending)) == []
    assert figures.corrupt(lambda p: _state(_step_of(p))) == []
    assert status.pending == () and status.corrupt == ()


@pytest.mark.slow
@pytest.mark.parametrize("compression", ["zstd", "none"])
def test_throttling_and_server_errors(s3: Any, proxy: FaultProxy, tmp_path: Path,
                                      compression: str) -> None:
    faults = RandomFaults(seed=1, rate=0.35, faults=["503", "500"])
    figures, saved, status = _in_process(s3, proxy, tmp_path, faults, compression=compression)
    _assert_clean(figures, saved, status)
    assert proxy.stats.faults["503"] > 0 and proxy.stats.faults["500"] > 0, proxy.stats


@pytest.mark.slow
@pytest.mark.parametrize("compression", ["zstd", "none"])
def test_connections_reset_mid_part_and_after_the_server_acted(
        s3: Any, proxy: FaultProxy, tmp_path: Path, compression: str) -> None:
    rules = Rules(
        Rule("UploadPart", "reset-body", times=4),
        Rule("UploadPart", "reset-response", times=3, after=2),
        Rule("CompleteMultipartUpload", "reset-response", times=2),  # done, never told
        Rule("PutObject", "reset-response", times=2, key=MANIFEST_NAME),  # the conditional put
        Rule("PutObject", "reset-body", times=2),
        Rule("ListObjects", "reset-response", times=2),
        Rule("GetObject", "reset-body", times=2, key=MANIFEST_NAME))
    figures, saved, status = _in_process(s3, proxy, tmp_path, rules, compression=compression)
    _assert_clean(figures, saved, status)
    assert rules.spent, [r for r in rules.rules if r.times > 0]
    assert proxy.stats.faults["reset-body"] >= 4 and proxy.stats.faults["reset-response"] >= 5


@pytest.mark.slow
def test_requests_stalled_past_the_timeout(s3: Any, proxy: FaultProxy, tmp_path: Path) -> None:
    assert current_knobs().tier_timeout == 1
    rules = Rules(Rule("UploadPart", "stall", times=3), Rule("CreateMultipartUpload", "stall"),
                  Rule("CompleteMultipartUpload", "stall"),
                  Rule("PutObject", "stall", key=MANIFEST_NAME),
                  Rule("ListObjects", "stall"))
    figures, saved, status = _in_process(s3, proxy, tmp_path, rules, steps=3)
    _assert_clean(figures, saved, status)
    assert rules.spent and proxy.stats.faults["stall"] == 7


@pytest.mark.slow
def test_gc_and_retention_racing_the_uploads(s3: Any, proxy: FaultProxy,
                                             tmp_path: Path) -> None:
    """fpctl gc of the parent prefix every half second while a Checkpointer uploads
    to a run directory below it (tier_keep_last=2 deleting in the store,
    keep_last=2 deleting locally), with throttling and resets. moto dates
    every multipart upload 2010, so each gc aborts the uploads in flight
    (moto then answers their parts 500, S3 404): the uploader must take that
    as a failed attempt, never a loss, and the run directory and its
    checkpoints are never gc's."""
    stop = threading.Event()
    runs: list[tuple[int, list[dict[str, str]]]] = []

    def gc_loop() -> None:
        import io

        while not stop.is_set():
            out = io.StringIO()
            with contextlib.redirect_stdout(out):  # only this thread prints
                status = fpctl(["gc", s3.url, "--older-than", "30", "--json"])
            runs.append((status, json.loads(out.getvalue() or "[]")))
            stop.wait(0.5)

    gc = threading.Thread(target=gc_loop)
    gc.start()
    try:
        faults = RandomFaults(seed=3, rate=0.2, faults=["503", "reset-body", "reset-response"])
        figures, saved, status = _in_process(s3, proxy, tmp_path, faults, steps=8,
                                             tier=f"{s3.url}/run1", tier_keep_last=2,
                                             healed=stop.set)
    finally:
        stop.set()
        gc.join()
    _assert_clean(figures, saved, status, keep=2)
    assert sorted(figures.remote()) == ["step-00000007", "step-00000008"]
    assert runs and {status for status, _ in runs} == {0}
    actions = [a for _, done in runs for a in done]
    assert {a["kind"] for a in actions} <= {"multipart-upload"}  # nothing else was gc's
    print(f"\ngc raced the uploads {len(runs)} times, aborting {len(actions)} multipart "
          f"upload(s) in flight; faults {dict(proxy.stats.faults)}")


@pytest.mark.slow
def test_a_corrupted_local_file_among_faults(s3: Any, proxy: FaultProxy,
                                             tmp_path: Path) -> None:
    root = tmp_path / "run"
    saved = {}
    for step in range(1, 5):
        path = root / f"step-{step:08d}"
        fastpersist.save(_state(step), path)
        saved[path.name] = _source(path)
    m = Manifest.from_json((root / "step-00000003" / MANIFEST_NAME).read_bytes(), "x")
    w = next(t for t in m.tensors if t.name == "w")
    with open(root / "step-00000003" / w.file, "r+b") as f:  # bit rot in the third part
        f.seek(w.offset + 11 * MIB)
        byte = f.read(1)
        f.seek(w.offset + 11 * MIB)
        f.write(bytes([byte[0] ^ 0x01]))
    del saved["step-00000003"]
    proxy.schedule = RandomFaults(seed=4, rate=0.2, faults=["503", "reset-body", "stall"])
    ckpt = fastpersist.Checkpointer(root, tier=s3.url, tier_endpoint=proxy.endpoint,
                                    tier_compression="none")
    for step in (5, 6):
        ckpt.save(step, _state(step)).result()
        saved[f"step-{step:08d}"] = _source(root / f"step-{step:08d}")
    ckpt.wait_for_tier(120)  # through the faults
    proxy.schedule = lambda _: None
    assert ckpt.wait_for_tier(120)
    status = ckpt.tier_status()
    assert status is not None
    figures = Figures(s3, s3.url)
    assert figures.lost(saved, set(status.pending)) == []
    assert figures.corrupt(lambda p: _state(_step_of(p))) == []
    assert "step-00000003" not in figures.remote()
    (corrupt,) = status.corrupt
    assert "step-00000003" in corrupt and "tensor 'w'" in corrupt
    assert status.pending == ()
    ckpt.close(abort=True)
    assert proxy.stats.faults.total() > 0


# -- fastpersistd SIGKILLed mid-upload ----------------------------------------------


def _tier_status(d: Daemon) -> dict[str, Any] | None:
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        if fpctl(["daemon", "status", "--daemon", d.address, "--json"]) != 0:
            return None
    tier: dict[str, Any] = json.loads(out.getvalue())["tier"]
    return tier


@pytest.mark.slow
def test_the_daemon_sigkilled_mid_upload(s3: Any, proxy: FaultProxy, tmp_path: Path,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """FASTPERSIST_TIER_KILLS times (default 20): start fastpersistd --tier
    (through the proxy, 5% of requests faulted), save a checkpoint through it
    into a run directory, SIGKILL it at a random moment within the next 1.5 s
    (mid-save, mid-upload, mid-retention, idle), and start again. A corrupt
    checkpoint sits in the root from the start. Then the faults stop, a last
    daemon drains the queue, and every checkpoint whose save returned (or
    that is committed on disk) must be in the store, every byte verified."""
    kills = int(os.environ.get("FASTPERSIST_TIER_KILLS", "20"))
    rng = random.Random(int(os.environ.get("FASTPERSIST_TIER_SEED", "5")))
    proxy.schedule = faults = RandomFaults(seed=6, rate=0.05)
    monkeypatch.setenv("FASTPERSIST_TIER_TIMEOUT", "2")
    root = tmp_path / "root"
    fastpersist.save(_state(0), root / "run" / "step-00000000")  # corrupt from the start
    m = Manifest.from_json((root / "run/step-00000000" / MANIFEST_NAME).read_bytes(), "x")
    w = next(t for t in m.tensors if t.name == "w")
    with open(root / "run/step-00000000" / w.file, "r+b") as f:
        f.seek(w.offset + 7)
        f.write(b"\xff")
    args = ("--tier", s3.url, "--tier-endpoint", proxy.endpoint)
    saved: dict[str, str] = {}
    step, in_flight_at_kill, save_errors = 0, 0, 0
    daemons = []
    try:
        for _ in range(kills):
            d = Daemon(tmp_path, *args, root=root).start()
            daemons.append(d)
            monkeypatch.setenv("FASTPERSIST_SHM_DIR", str(d.shm_dir))
            step += 1
            in_flight: list[int] = []

            def kill(d: Daemon = d, in_flight: list[int] = in_flight) -> None:
                in_flight.append(proxy.active)  # requests of the store open at the kill
                d.kill()

            killer = threading.Timer(rng.uniform(0.0, 1.5), kill)
            killer.start()
            try:
                ckpt = fastpersist.Checkpointer(root / "run", daemon=d.address, keep_last=2)
                ckpt.save(step, _state(step)).result()
                saved[f"run/step-{step:08d}"] = _source(root / "run" / f"step-{step:08d}")
                ckpt.close(abort=True)
            except (fastpersist.CheckpointError, FileNotFoundError):
                save_errors += 1  # killed mid-save: committed or not, the disk says
            killer.join()
            in_flight_at_kill += in_flight[0] > 0
            d.kill()
            _forget_savers()
            d.cleanup()
        faults.on = False
        d = Daemon(tmp_path, *args, root=root).start()
        daemons.append(d)
        wait_until("the queue drained", lambda: (t := _tier_status(d)) is not None
                   and t["pending"] == 0, timeout=300)
        on_disk = _committed(root)
        figures = Figures(s3, s3.url)
        remote = figures.remote()
        for path in on_disk - {"run/step-00000000"}:
            saved.setdefault(path, _source(root / path))
        lost = figures.lost(saved, set())
        corrupt = figures.corrupt(lambda p: _state(_step_of(p)))
        unfinished = _tier_status(d)["pending"]  # type: ignore[index]
        reported = [e for e in d.events("tier-upload-corrupt")
                    if e["path"] == "run/step-00000000"]
        print(f"\ntier SIGKILL soak: {kills} kills ({in_flight_at_kill} with requests in "
              f"flight, {save_errors} mid-save), {len(saved)} checkpoints committed, "
              f"{len(remote)} in the store, {proxy.stats.requests} requests, faults "
              f"{dict(proxy.stats.faults)}; lost {len(lost)}, corrupt uploaded "
              f"{len(corrupt)}, unfinished {unfinished}")
        assert lost == [] and corrupt == [] and unfinished == 0
        assert "run/step-00000000" not in remote and reported
        assert in_flight_at_kill > 0 and proxy.stats.faults.total() > 0
    finally:
        _forget_savers()
        for d in daemons:
            d.cleanup()


def _committed(root: Path) -> set[str]:
    return {str(p.parent.relative_to(root)) for p in root.glob("*/*/" + MANIFEST_NAME)}


def _forget_savers() -> None:
    from fastpersist.saving.registry import close_shared

    close_shared(abort=True)
