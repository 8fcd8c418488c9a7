"""fastpersistd's memory tier (daemon/memory.py) and the load that reads it
(tensors/memory_read.py, loading/fallback.py), with real daemons and, for
a restarted trainer, a new process.

A load from memory is told from a load from disk by removing the data files
(the manifest stays): only the daemon's copy then holds the tensors.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from daemon_support import Daemon, serving

import fastpersist
from fastpersist._proto import fastpersist_pb2 as pb
from fastpersist.daemon.budgets import default_tier_bytes
from fastpersist.errors import ChecksumMismatchError, CorruptCheckpointError
from fastpersist.format.manifest import Manifest
from fastpersist.tensors import memory_read

MIB = 1 << 20
REPO = Path(__file__).resolve().parent.parent


def state(seed: int, mib: float = 1.0) -> dict[str, object]:
    g = torch.Generator().manual_seed(seed)
    n = int(mib * MIB) // 4
    return {"w": torch.randn(n, generator=g), "b": torch.arange(7 + seed), "step": seed,
            "half": torch.randn(33, 5, generator=g).half(), "none": torch.empty(0, 3)}


def digests(obj: dict[str, object]) -> dict[str, str]:
    return {k: hashlib.sha256(v.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()
            if isinstance(v, torch.Tensor) else repr(v) for k, v in obj.items()}


def copies(d: Daemon) -> list[Path]:
    return sorted(p for p in d.shm_dir.iterdir() if p.name.startswith("fastpersistd-copy-"))


def copy_bytes(d: Daemon) -> int:
    return sum(f.stat().st_size for c in copies(d) for f in c.iterdir())


def held(d: Daemon, relpath: str) -> pb.MemoryCopyResponse:
    client = d.client()
    try:
        return client.memory_copy(relpath, timeout=10)
    finally:
        client.close()


def drop_data_files(ckpt: Path) -> None:
    for f in ckpt.glob("data-*"):
        f.unlink()


@pytest.fixture
def tier(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Daemon]:
    with serving(Daemon(tmp_path, "--memory-tier-count", "2", "--memory-tier-bytes", "64M"),
                 monkeypatch) as d:
        yield d


def load_in_new_process(d: Daemon, ckpt: Path, daemon: str | None = None
                        ) -> subprocess.CompletedProcess[str]:
    """fastpersist.load in a fresh interpreter (a restarted trainer); prints
    the tensors' digests as JSON. Warnings are errors: a load that fell back
    to disk says so with a RuntimeWarning."""
    code = ("import hashlib, json, sys, torch, fastpersist\n"
            f"out = fastpersist.load({str(ckpt)!r}"
            + (f", daemon={daemon!r}" if daemon is not None else "") + ")\n"
            "print(json.dumps({k: hashlib.sha256(v.contiguous().view(torch.uint8).numpy()"
            ".tobytes()).hexdigest() if isinstance(v, torch.Tensor) else repr(v) "
            "for k, v in out.items()}))\n")
    env = {**os.environ, "FASTPERSIST_DAEMON": d.address, "FASTPERSIST_SHM_DIR": str(d.shm_dir),
           "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-W", "error::RuntimeWarning", "-c", code], env=env,
                          capture_output=True, text=True, timeout=120)


@pytest.mark.slow
def test_a_restarted_process_loads_from_the_daemons_memory(tier: Daemon) -> None:
    """The trainer that saved is gone; a new process loads the checkpoint
    bit for bit from the daemon's copy, with no data file left on disk."""
    ckpt = tier.root / "step-1"
    saved = state(1, mib=3)
    saver = subprocess.run(
        [sys.executable, "-c", "import sys, torch, fastpersist\n"
         "sys.path.insert(0, 'tests')\nfrom test_memory_tier import state\n"
         f"fastpersist.save(state(1, mib=3), {str(ckpt)!r})\n"],
        env={**os.environ, "FASTPERSIST_DAEMON": tier.address,
             "FASTPERSIST_SHM_DIR": str(tier.shm_dir), "PYTHONPATH": str(REPO)},
        cwd=REPO, capture_output=True, text=True, timeout=120)
    assert saver.returncode == 0, saver.stderr
    manifest = (ckpt / "manifest.json").read_bytes()
    drop_data_files(ckpt)
    done = load_in_new_process(tier, ckpt)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == digests(saved)
    # The copy is the files as they were on disk, and the manifest the committed one.
    reply = held(tier, "step-1")
    assert reply.manifest == manifest and reply.directory
    # Without the daemon the same load has nothing to read.
    alone = load_in_new_process(tier, ckpt, daemon="")
    assert alone.returncode != 0 and "CorruptCheckpointError" in alone.stderr
    # The copies go with the daemon.
    assert copies(tier)
    assert tier.stop() == 0
    assert not copies(tier)


def test_the_copy_is_the_disk_files_byte_for_byte(tier: Daemon) -> None:
    fastpersist.save(state(2), tier.root / "step-2", daemon=tier.address)
    reply = held(tier, "step-2")
    copy = tier.shm_dir / reply.directory
    names = sorted(p.name for p in (tier.root / "step-2").glob("data-*"))
    assert names and sorted(p.name for p in copy.iterdir()) == names
    for name in names:
        assert (copy / name).read_bytes() == (tier.root / "step-2" / name).read_bytes()
        assert (copy / name).stat().st_mode & 0o777 == 0o640
    assert copy.stat().st_mode & 0o777 == 0o750


def test_the_sources_ranges_and_file_checks(tier: Daemon) -> None:
    """read_ranges gives the records' CRC32Cs from the copy, check_file its
    sizes, into= is read in place: the Source interface, whole."""
    ckpt = tier.root / "step-3"
    saved = state(3)
    fastpersist.save(saved, ckpt, daemon=tier.address)
    source, why = memory_read.find(tier.address, ckpt)
    assert source is not None, why
    manifest = source.manifest()
    for f in manifest.files:
        source.check_file(f)
        records = [r for r in manifest.tensors if r.file == f.name]
        buffers = [bytearray(r.length) for r in records]
        crcs = source.read_ranges(f, [(b, r.offset) for b, r in zip(buffers, records,
                                                                       strict=True)],
                                  checksum=True)
        assert crcs == [r.crc32c for r in records]
    drop_data_files(ckpt)
    into = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else v
            for k, v in saved.items()}
    out = fastpersist.load(ckpt, into=into, daemon=tier.address)
    assert out["w"] is into["w"] and digests(out) == digests(saved)
    # A copy file cut short is a file of the wrong size, as on disk.
    f = manifest.files[0]
    os.truncate(source.copy / f.name, f.size - 1)
    with pytest.raises(CorruptCheckpointError, match="truncated"):
        source.check_file(f)


def test_tensors_from_memory_are_the_loaders_own(tier: Daemon) -> None:
    """The tensors map the daemon's copy copy-on-write: writing them changes
    neither the copy nor the next load's tensors."""
    ckpt = tier.root / "step-12"
    saved = state(12)
    fastpersist.save(saved, ckpt, daemon=tier.address)
    drop_data_files(ckpt)
    out = fastpersist.load(ckpt, daemon=tier.address)
    out["w"].add_(1.0)
    out["b"].zero_()
    again = fastpersist.load(ckpt, daemon=tier.address)
    assert digests(again) == digests(saved)
    assert not torch.equal(out["w"], again["w"])


def test_a_corrupt_copy_is_caught_and_the_disk_is_read(tier: Daemon) -> None:
    """A flipped byte in the daemon's copy fails the tensor's CRC32C: the
    load warns (naming file and tensor) and reads the disk instead."""
    ckpt = tier.root / "step-4"
    saved = state(4)
    fastpersist.save(saved, ckpt, daemon=tier.address)
    source, _ = memory_read.find(tier.address, ckpt)
    assert source is not None
    w = next(r for r in source.manifest().tensors if r.name == "w")
    with open(source.copy / w.file, "r+b") as f:
        f.seek(w.offset + 1000)
        byte = f.read(1)
        f.seek(w.offset + 1000)
        f.write(bytes([byte[0] ^ 0x10]))
    with pytest.raises(ChecksumMismatchError) as raised:
        source.read_tensors(source.manifest(), verify=True)
    assert raised.value.tensor == "w" and raised.value.file == w.file
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = fastpersist.load(ckpt, daemon=tier.address)
    assert digests(out) == digests(saved)
    said = [str(c.message) for c in caught if issubclass(c.category, RuntimeWarning)]
    assert any("'w'" in m and w.file in m and "reading it from disk" in m for m in said), said
    # With the disk's files gone too, the load raises the disk's error.
    drop_data_files(ckpt)
    with pytest.warns(RuntimeWarning), pytest.raises(CorruptCheckpointError, match="missing"):
        fastpersist.load(ckpt, daemon=tier.address)


def test_replaced_and_deleted_checkpoints_are_not_served(tier: Daemon) -> None:
    first = tier.root / "step-5"
    fastpersist.save(state(5), first, daemon=tier.address)
    assert held(tier, "step-5").directory
    # Replaced behind the daemon's back (an in-process save): the daemon's
    # manifest check refuses its copy, and drops it.
    fastpersist.save(state(50), first, daemon="")
    reply = held(tier, "step-5")
    assert not reply.directory and "not the one" in reply.reason
    assert digests(fastpersist.load(first, daemon=tier.address)) == digests(state(50))
    assert not copies(tier)
    # Replaced through the daemon: the newer save's copy is served.
    fastpersist.save(state(51), first, daemon=tier.address)
    drop_data_files(first)
    assert digests(fastpersist.load(first, daemon=tier.address)) == digests(state(51))
    # Deleted through the daemon: the copy goes at once.
    client = tier.client()
    client.delete("step-5")
    client.close()
    assert not copies(tier) and not held(tier, "step-5").directory
    # Removed by hand and saved again in-process: not the daemon's checkpoint.
    second = tier.root / "step-6"
    fastpersist.save(state(6), second, daemon=tier.address)
    for f in second.iterdir():
        f.unlink()
    second.rmdir()
    assert not held(tier, "step-6").directory
    fastpersist.save(state(60), second, daemon="")
    assert digests(fastpersist.load(second, daemon=tier.address)) == digests(state(60))


def test_retention_drops_the_copies_it_deletes(tier: Daemon) -> None:
    """A Checkpointer through the daemon: retention's deletions drop their copies."""
    ck = fastpersist.Checkpointer(tier.root / "run", keep_last=1, daemon=tier.address)
    for step in (1, 2):
        ck.save(step, state(step))
        ck.wait()
    first, second = (ck.path_for(s).relative_to(tier.root).as_posix() for s in (1, 2))
    assert not ck.path_for(1).exists()
    assert not held(tier, first).directory
    assert held(tier, second).directory
    assert len(copies(tier)) == 1
    assert digests(ck.load_latest()) == digests(state(2))


def test_eviction_by_count_and_by_bytes_within_the_budget(tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch
                                                          ) -> None:
    budget = 5 * MIB
    d = Daemon(tmp_path, "--memory-tier-count", "3", "--memory-tier-bytes", str(budget)).start()
    monkeypatch.setenv("FASTPERSIST_SHM_DIR", str(d.shm_dir))
    peak = [0]
    stop = threading.Event()

    def watch() -> None:  # the copies' bytes in --shm-dir, sampled throughout
        while not stop.is_set():
            with contextlib.suppress(FileNotFoundError):  # a copy removed while listed
                peak[0] = max(peak[0], copy_bytes(d))
            time.sleep(0.001)

    sampler = threading.Thread(target=watch)
    sampler.start()
    try:
        for step in range(1, 5):  # 1 MiB each: the count evicts
            fastpersist.save(state(step), d.root / f"step-{step}", daemon=d.address)
        assert [bool(held(d, f"step-{s}").directory) for s in range(1, 5)] == [
            False, True, True, True]
        for step in range(5, 7):  # 2 MiB each: the bytes evict
            fastpersist.save(state(step, mib=2), d.root / f"step-{step}", daemon=d.address)
        kept = [s for s in range(1, 7) if held(d, f"step-{s}").directory]
        assert kept == [5, 6], kept
        # Larger than the budget: not kept, and nothing evicted for it.
        fastpersist.save(state(7, mib=6), d.root / "step-7", daemon=d.address)
        assert not held(d, "step-7").directory
        assert [s for s in range(1, 8) if held(d, f"step-{s}").directory] == [5, 6]
        client = d.client()
        info = client.info()
        client.close()
        assert info.memory_tier_copies == 2 and info.memory_tier_bytes == copy_bytes(d)
        assert info.memory_tier_budget == budget and info.memory_tier_count == 3
    finally:
        stop.set()
        sampler.join()
        from fastpersist.saving.registry import close_shared

        close_shared(abort=True)
        d.cleanup()
    assert 0 < peak[0] <= budget


_HANG_STEP_2 = """
import pathlib, time
import fastpersist.daemon.memory as memory
real = memory.MemoryTier._copy_file
def copy_file(self, c, job, name, size):
    crcs = real(self, c, job, name, size)
    if c.relpath == "step-2":
        pathlib.Path({mark!r}).touch()
        time.sleep(3600)
    return crcs
memory.MemoryTier._copy_file = copy_file
"""


@pytest.mark.slow
def test_sigkill_mid_copy_leaves_no_servable_copy(tmp_path: Path) -> None:
    """SIGKILL while the daemon copies step-2 (step-1 held): the next daemon
    serves neither and removes both directories; a load reads the disk."""
    mark = tmp_path / "copying"
    d = Daemon(tmp_path, "--memory-tier-count", "1",
               prelude=_HANG_STEP_2.format(mark=str(mark))).start()
    env = {**os.environ, "FASTPERSIST_DAEMON": d.address, "FASTPERSIST_SHM_DIR": str(d.shm_dir),
           "PYTHONPATH": str(REPO)}
    try:
        save = ("import sys, fastpersist\nsys.path.insert(0, 'tests')\n"
                "from test_memory_tier import state\n"
                f"fastpersist.save(state(1), {str(d.root / 'step-1')!r})\n"
                f"fastpersist.save(state(2), {str(d.root / 'step-2')!r})\n")
        saver = subprocess.Popen([sys.executable, "-c", save], env=env, cwd=REPO,
                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 60
        while not mark.exists():
            assert time.monotonic() < deadline and saver.poll() is None
            time.sleep(0.02)
        assert held(d, "step-1").directory
        d.kill()
        saver.kill()
        saver.wait()
        assert len(copies(d)) == 2  # left behind: step-1's, and step-2's half
        again = Daemon(tmp_path, "--memory-tier-count", "1", root=d.root,
                       shm_dir=d.shm_dir).start()
        try:
            assert not copies(again)
            assert not held(again, "step-1").directory
            assert not held(again, "step-2").directory
            assert not (d.root / "step-2").exists()  # never committed
            drop_data_files(d.root / "step-1")
            done = load_in_new_process(again, d.root / "step-1")
            assert done.returncode != 0 and "CorruptCheckpointError" in done.stderr
        finally:
            again.cleanup()
    finally:
        d.cleanup()


@pytest.mark.slow
def test_a_daemon_down_or_frozen_costs_the_load_a_timeout(tier: Daemon) -> None:
    ckpt = tier.root / "step-8"
    saved = state(8)
    fastpersist.save(saved, ckpt, daemon=tier.address)
    assert tier.proc is not None
    os.kill(tier.proc.pid, signal.SIGSTOP)
    try:
        source, why = memory_read.find(tier.address, ckpt, timeout=0.5)
        assert source is None and "not answering" in why
        done = load_in_new_process(tier, ckpt)  # from disk, after LOOKUP_TIMEOUT
        assert done.returncode == 0, done.stderr
        assert json.loads(done.stdout) == digests(saved)
    finally:
        os.kill(tier.proc.pid, signal.SIGCONT)
    tier.kill()
    assert digests(fastpersist.load(ckpt, daemon=tier.address)) == digests(saved)


def test_checkpoints_the_tier_does_not_keep(tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """Off by default (--memory-tier-count 0) it keeps nothing; a compressed
    checkpoint is not kept."""
    with serving(Daemon(tmp_path / "off"), monkeypatch) as off:
        fastpersist.save(state(9), off.root / "step-9", daemon=off.address)
        reply = held(off, "step-9")
        assert not reply.directory and "--memory-tier-count 0" in reply.reason
        assert not copies(off)
        fastpersist.save(state(10), off.root / "step-10", daemon=off.address,
                         compression="zstd")
    with serving(Daemon(tmp_path / "on", "--memory-tier-count", "1"), monkeypatch) as on:
        fastpersist.save(state(10), on.root / "step-10", daemon=on.address, compression="zstd")
        assert not held(on, "step-10").directory and not copies(on)
        fastpersist.save(state(11), on.root / "step-11", daemon=on.address)
        m = Manifest.from_json(held(on, "step-11").manifest, "step-11")
        assert {r.name for r in m.tensors} == {"w", "b", "half", "none"}


def test_the_default_budget_fits_the_cgroup() -> None:
    """The copies are charged to the daemon's cgroup: within a limit, the
    default is half of what the daemon's own memory leaves of it."""
    own = {"idle": 64 * MIB, "writers": 64 * MIB}
    assert default_tier_bytes(8 << 30, own, None) == 8 << 30
    assert default_tier_bytes(8 << 30, own, 512 * MIB) == 192 * MIB
    assert default_tier_bytes(100 * MIB, own, 64 << 30) == 100 * MIB
    assert default_tier_bytes(8 << 30, own, 100 * MIB) == 0


def test_memory_copy_over_tcp_takes_the_token(tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """MemoryCopy is refused without the token like every call on TCP; with
    it (a client on the node that uses the TCP address) the load reads memory."""
    import grpc
    from test_daemon_tcp import TCP

    from fastpersist._proto import fastpersist_pb2_grpc as pb_grpc

    for var in ("http_proxy", "https_proxy", "grpc_proxy", "HTTP_PROXY", "HTTPS_PROXY"):
        monkeypatch.delenv(var, raising=False)
    t = TCP(tmp_path, "--memory-tier-count", "1").start()
    monkeypatch.setenv("FASTPERSIST_SHM_DIR", str(t.daemon.shm_dir))
    try:
        ckpt = t.daemon.root / "step-13"
        fastpersist.save(state(13), ckpt, daemon=t.daemon.address)
        for token in (None, "not-the-token"):
            with t.channel(token) as channel, pytest.raises(grpc.RpcError) as refused:
                pb_grpc.FastPersistStub(channel).MemoryCopy(
                    pb.MemoryCopyRequest(path="step-13"), timeout=10)
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
        monkeypatch.setenv("FASTPERSIST_DAEMON_CA_FILE", str(t.files["cert"]))
        monkeypatch.setenv("FASTPERSIST_DAEMON_TOKEN_FILE", str(t.files["token"]))
        drop_data_files(ckpt)
        assert digests(fastpersist.load(ckpt, daemon=t.address)) == digests(state(13))
    finally:
        from fastpersist.saving.registry import close_shared

        close_shared(abort=True)
        t.daemon.cleanup()
