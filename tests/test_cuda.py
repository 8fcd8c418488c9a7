"""CUDA tensors: save/load round trips to the same device, and async snapshots
taken with device-to-host copies on a side stream into pinned staging memory.

Skipped entirely without a GPU. The contract (fastpersist/saving/snapshot.py): the
copy waits for the work already queued on the compute stream (it sees the
values as of the save call), does not block the caller when
wait_for_snapshot=False, and future.wait_snapshot() returns once the copies are
done, after which the caller may change the tensors on the GPU.
"""

from __future__ import annotations

import copy
import importlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from support import daemon_saver, in_process_saver

import fastpersist
from fastpersist import Checkpointer
from fastpersist.tensors import checkpoint

if not torch.cuda.is_available():
    pytest.skip("CUDA is not available", allow_module_level=True)

DEV = torch.device("cuda", 0)
KIB = 1 << 10
MIB = 1 << 20
registry_module = importlib.import_module("fastpersist.saving.registry")


@pytest.fixture(autouse=True)
def _fresh_default_saver(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    registry_module.close_shared()
    yield
    registry_module.close_shared()
    torch.cuda.synchronize()


def to_cpu(obj: Any) -> Any:
    """A deep copy of obj with every tensor on the CPU (views and ties kept)."""
    obj = copy.deepcopy(obj)

    def walk(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            return x.cpu()
        if isinstance(x, dict):
            return {k: walk(v) for k, v in x.items()}
        if isinstance(x, list):
            return [walk(v) for v in x]
        if isinstance(x, tuple):
            return tuple(walk(v) for v in x)
        return x

    return walk(obj)


def assert_same(a: Any, b: Any, device: torch.device | None = None, path: str = "<root>"
                ) -> None:
    """a (loaded) equals b bit for bit; a's tensors are on `device` (b's, if None)."""
    if isinstance(b, torch.Tensor):
        assert isinstance(a, torch.Tensor), path
        want = device if device is not None else b.device
        assert a.device == want, f"{path}: on {a.device}, expected {want}"
        assert (a.dtype, a.shape) == (b.dtype, b.shape), path
        if b.numel():
            a_bytes = a.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
            b_bytes = b.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
            assert torch.equal(a_bytes, b_bytes), f"{path}: tensor bytes differ"
    elif isinstance(b, dict):
        assert isinstance(a, dict) and list(a) == list(b), path
        for k in b:
            assert_same(a[k], b[k], device, f"{path}.{k}")
    elif isinstance(b, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, device, f"{path}[{i}]")
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"


def gpu_state(numel: int = 1 << 20) -> dict[str, Any]:
    g = torch.Generator(device=DEV).manual_seed(0)
    base = torch.randn(numel, device=DEV, generator=g)
    tied = torch.randn(4096, device=DEV, generator=g)
    return {
        "f32": torch.randn(numel, device=DEV, generator=g),
        "bf16": torch.randn(numel, device=DEV, generator=g).to(torch.bfloat16),
        "i64": torch.arange(numel, device=DEV, dtype=torch.int64),
        "base": base,
        "view": base[10:5000:7],
        "tied_a": tied,
        "tied_b": tied,
        "cpu": torch.arange(100, dtype=torch.int32),  # a CPU tensor mixed in
        "nested": {"step": 3, "list": [torch.ones(7, device=DEV), "x"]},
    }


def staged_files(future: Any) -> list[Any]:
    """The staging buffers a save's snapshot copied into (the future waits on them)."""
    from fastpersist.saving.snapshot import StagedFile

    return [w for w in future._waiters if isinstance(w, StagedFile)]


def mutate_on_gpu(state: dict[str, Any]) -> None:
    state["f32"].add_(1)
    state["bf16"].zero_()
    state["i64"].mul_(3)
    state["base"].neg_()
    state["tied_a"].fill_(9)
    state["cpu"].add_(1)
    state["nested"]["list"][0].mul_(-4)


def test_round_trip_to_the_same_device(tmp_path: Path, engine_name: str) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(),
                                torch.nn.Linear(128, 8)).to(DEV)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(16, 64, device=DEV)).sum().backward()
    opt.step()
    state = {"model": model.state_dict(), "optim": opt.state_dict(), "extra": gpu_state(4096)}
    fastpersist.save(state, tmp_path / "ck")

    loaded = fastpersist.load(tmp_path / "ck")
    assert_same(loaded["model"], state["model"])
    assert all(t.device == DEV for t in loaded["model"].values())
    assert_same(loaded["extra"], state["extra"])
    assert loaded["extra"]["cpu"].device.type == "cpu"
    assert loaded["extra"]["tied_a"] is loaded["extra"]["tied_b"]
    for pid, s in state["optim"]["state"].items():
        for k, v in s.items():
            assert_same(loaded["optim"]["state"][pid][k], v, path=f"optim.{pid}.{k}")

    on_cpu = fastpersist.load(tmp_path / "ck", map_location="cpu")
    assert_same(on_cpu["model"], state["model"], torch.device("cpu"))
    assert_same(on_cpu["extra"], state["extra"], torch.device("cpu"))
    mapped = fastpersist.load(tmp_path / "ck", map_location={"cuda:0": "cpu"})
    assert_same(mapped["model"], state["model"], torch.device("cpu"))

    model2 = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(),
                                 torch.nn.Linear(128, 8)).to(DEV)
    model2.load_state_dict(loaded["model"])
    x = torch.randn(4, 64, device=DEV)
    torch.testing.assert_close(model2(x), model(x), rtol=0, atol=1e-6)


@pytest.mark.parametrize("budget", [0, 6 * MIB], ids=["unbounded", "small-budget"])
def test_async_save_holds_the_values_before_the_mutation(
        tmp_path: Path, engine_name: str, monkeypatch: pytest.MonkeyPatch, budget: int) -> None:
    """wait_for_snapshot=False, then wait_snapshot(), then in-place changes on the
    GPU: the checkpoint holds the values of the save call. With the small budget
    the snapshot streams through several pinned buffers and the 4 MiB tensors
    (above half the budget) are written unstaged."""
    monkeypatch.setenv("FASTPERSIST_STAGING_BUDGET", str(budget))
    state = gpu_state()
    expected = to_cpu(state)
    future = fastpersist.async_save(state, tmp_path / "ck", wait_for_snapshot=False)
    future.wait_snapshot(timeout=60)
    mutate_on_gpu(state)
    future.result(timeout=120)
    loaded = fastpersist.load(tmp_path / "ck", map_location="cpu")
    assert_same(loaded, expected, torch.device("cpu"))
    assert loaded["tied_a"] is loaded["tied_b"]
    # Loaded without map_location: back on the GPU, still the old values.
    on_gpu = fastpersist.load(tmp_path / "ck")
    assert on_gpu["f32"].device == DEV and on_gpu["cpu"].device.type == "cpu"
    assert torch.equal(on_gpu["f32"].cpu(), expected["f32"])
    files = [r.file for r in checkpoint.read_manifest(tmp_path / "ck").tensors]
    assert (len(set(files)) > 1) == bool(budget)


def test_mutation_right_after_a_waiting_async_save(tmp_path: Path) -> None:
    """With the default wait_for_snapshot=True the caller may mutate at once."""
    state = gpu_state()
    expected = to_cpu(state)
    future = fastpersist.async_save(state, tmp_path / "ck")
    mutate_on_gpu(state)
    future.result(timeout=120)
    assert_same(fastpersist.load(tmp_path / "ck", map_location="cpu"), expected,
                torch.device("cpu"))


@pytest.mark.skipif(not hasattr(torch.cuda, "_sleep"), reason="needs torch.cuda._sleep")
def test_snapshot_sees_work_queued_before_the_save(tmp_path: Path) -> None:
    """The side stream waits for the compute stream: a value written by a kernel
    that is still queued (behind a long sleep) when async_save is called is the
    one in the checkpoint, and async_save(wait_for_snapshot=False) does not wait
    for it."""
    t = torch.zeros(4 * MIB, device=DEV)
    torch.cuda.synchronize()
    torch.cuda._sleep(200_000_000)  # ~0.1 s or more of GPU time on the compute stream
    t.fill_(7.0)  # queued behind the sleep
    future = fastpersist.async_save({"t": t}, tmp_path / "ck", wait_for_snapshot=False)
    future.wait_snapshot(timeout=60)
    t.fill_(-1.0)
    future.result(timeout=120)
    loaded = fastpersist.load(tmp_path / "ck", map_location="cpu")["t"]
    assert bool((loaded == 7.0).all())


@pytest.mark.skipif(not hasattr(torch.cuda, "_sleep"), reason="needs torch.cuda._sleep")
def test_freed_source_memory_is_not_reused_before_the_copy(tmp_path: Path) -> None:
    """The caller drops its tensors while the copy is still queued and allocates
    new ones of the same size: the copy must still read the old values."""
    t = torch.full((4 * MIB,), 3.0, device=DEV)
    torch.cuda.synchronize()
    torch.cuda._sleep(200_000_000)
    future = fastpersist.async_save({"t": t}, tmp_path / "ck", wait_for_snapshot=False)
    del t
    junk = [torch.full((4 * MIB,), -5.0, device=DEV) for _ in range(4)]
    future.wait_snapshot(timeout=60)
    future.result(timeout=120)
    del junk
    loaded = fastpersist.load(tmp_path / "ck", map_location="cpu")["t"]
    assert bool((loaded == 3.0).all())


def test_staging_memory_is_pinned(tmp_path: Path) -> None:
    saver = in_process_saver()
    state = {"w": torch.randn(MIB, device=DEV), "v": torch.randn(1000, device=DEV)}
    expected = to_cpu(state)
    future = saver.save(state, tmp_path / "ck", wait_for_snapshot=False)
    future.wait_snapshot(timeout=60)
    staged = staged_files(future)  # the snapshot's staging buffers
    assert staged
    for s in staged:
        assert s.buffer is not None and s.buffer.is_pinned() and s.pinned
        assert s.buffer.data_ptr() % 4096 == 0  # O_DIRECT-ready
    assert saver.staging_bytes >= 4 * MIB + 4000
    future.result(timeout=120)
    assert_same(fastpersist.load(tmp_path / "ck", map_location="cpu"), expected,
                torch.device("cpu"))
    # The next save reuses the same pinned memory.
    before = saver.staging_bytes
    saver.save(state, tmp_path / "ck2").result(timeout=120)
    assert saver.staging_bytes == before
    saver.close()


def test_prepared_pinned_staging_is_what_the_first_save_uses(tmp_path: Path) -> None:
    saver = in_process_saver()
    state = {"w": torch.randn(MIB, device=DEV), "v": torch.randn(1000, device=DEV)}
    expected = to_cpu(state)
    assert saver.prepare_staging(state) == 4 * MIB + 4000
    allocations = saver.pool.allocations
    future = saver.save(state, tmp_path / "ck")
    assert saver.pool.allocations == allocations  # the prepared buffer
    assert all(s.buffer is not None and s.buffer.is_pinned() for s in staged_files(future))
    future.result(timeout=120)
    saver.close()
    assert_same(fastpersist.load(tmp_path / "ck", map_location="cpu"), expected,
                torch.device("cpu"))


def test_checkpointer_with_gpu_state(tmp_path: Path, engine_name: str) -> None:
    state = gpu_state(1 << 16)
    with Checkpointer(tmp_path / "ckpts", keep_last=2) as ckpt:
        saved = []
        for step in range(1, 5):
            saved.append(to_cpu(state))
            ckpt.save(step, state, wait_for_snapshot=False).wait_snapshot(timeout=60)
            mutate_on_gpu(state)
        ckpt.wait()
        assert ckpt.steps() == [3, 4]
        assert_same(ckpt.load_latest(map_location="cpu"), saved[-1], torch.device("cpu"))
        latest = ckpt.load_latest()
        assert latest["f32"].device == DEV
        assert torch.equal(latest["f32"].cpu(), saved[-1]["f32"])
        third = fastpersist.load(tmp_path / "ckpts" / "step-00000003", map_location="cpu")
        assert_same(third, saved[2], torch.device("cpu"))


def test_daemon_save_of_gpu_state(daemon: Any) -> None:
    """Through fastpersistd: D2H copies go into shared memory page-locked with
    cudaHostRegister; the snapshot holds the values as of the call, and the
    daemon's checkpoint equals an in-process save of the same state."""

    state = gpu_state()
    expected = to_cpu(state)
    saver = daemon_saver(daemon.address)
    try:
        future = saver.save(state, daemon.root / "ck", wait_for_snapshot=False)
        future.wait_snapshot(timeout=60)
        mutate_on_gpu(state)
        future.result(timeout=120)
        registered = list(saver.sink.segments._registered.values())
        assert registered and all(registered)  # pinned shared memory
        assert_same(fastpersist.load(daemon.root / "ck", map_location="cpu"), expected,
                    torch.device("cpu"))
        restored = fastpersist.load(daemon.root / "ck")
        assert restored["f32"].device == DEV
        # A second save reuses the registered segments.
        before = saver.staging_bytes
        saver.save(state, daemon.root / "ck2").result(timeout=120)
        assert saver.staging_bytes == before
        assert_same(fastpersist.load(daemon.root / "ck2", map_location="cpu"), to_cpu(state),
                    torch.device("cpu"))
    finally:
        saver.close()


def test_memory_tier_load_to_the_gpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A checkpoint of GPU state saved through a daemon with its memory tier
    on loads back onto the GPU from the daemon's memory alone (the data files
    are removed first, so a disk read would fail)."""
    from daemon_support import Daemon

    d = Daemon(tmp_path, "--memory-tier-count", "2", "--memory-tier-bytes", "256M").start()
    monkeypatch.setenv("FASTPERSIST_SHM_DIR", str(d.shm_dir))
    try:
        state = gpu_state()
        expected = to_cpu(state)
        fastpersist.save(state, d.root / "ck", daemon=d.address)
        for f in (d.root / "ck").glob("data-*"):
            f.unlink()
        restored = fastpersist.load(d.root / "ck", daemon=d.address)
        assert_same(restored, state)  # each on the device it was saved from
        on_cpu = fastpersist.load(d.root / "ck", daemon=d.address, map_location="cpu")
        assert_same(on_cpu, expected, torch.device("cpu"))
    finally:
        registry_module.close_shared(abort=True)
        d.cleanup()


def test_hand_off_of_a_gpu_snapshot(daemon: Any) -> None:
    """hand_off waits for the device-to-host copy of a save that has not
    finished its snapshot, then for the daemon to own it; the checkpoint
    holds the values as of the save call."""
    state = gpu_state()
    expected = to_cpu(state)
    if hasattr(torch.cuda, "_sleep"):
        torch.cuda._sleep(100_000_000)  # the copy waits for queued work
    future = fastpersist.async_save(state, daemon.root / "ck", daemon=daemon.address,
                                    wait_for_snapshot=False)
    report = fastpersist.hand_off(timeout=60)
    assert report.ok and [Path(p) for p in report.safe] == [daemon.root / "ck"], report
    mutate_on_gpu(state)
    future.result(timeout=120)
    assert_same(fastpersist.load(daemon.root / "ck", map_location="cpu"), expected,
                torch.device("cpu"))
