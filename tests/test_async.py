"""fastpersist.async_save: the caller pays for the snapshot, the write happens behind it.

The contract (fastpersist/saving/pipeline.py): async_save returns once every tensor
is copied into staging memory, so the caller may then change the state in
place; future.result() returns once the checkpoint is durable (with save()'s
guarantees) and raises the background error; a failure nobody looked at is
raised by the next save; staging is allocated once, reused, and bounded by
FASTPERSIST_STAGING_BUDGET (a smaller budget streams the snapshot through it in
several data files); at most FASTPERSIST_MAX_IN_FLIGHT saves persist at once.
"""

from __future__ import annotations

import contextlib
import copy
import errno
import importlib
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from support import WriteLog, in_process_saver, inject_enospc

import fastpersist
from fastpersist import (
    Checkpointer,
    CheckpointError,
    CheckpointExistsError,
    DiskFullError,
    UnsupportedValueError,
)
from fastpersist.saving.futures import STOP
from fastpersist.storage.commit import find_leftovers
from fastpersist.tensors import checkpoint

KIB = 1 << 10
MIB = 1 << 20
saver_module = importlib.import_module("fastpersist.saving.pipeline")
registry_module = importlib.import_module("fastpersist.saving.registry")
persist_module = importlib.import_module("fastpersist.saving.persist")


# --- helpers --------------------------------------------------------------------------------


def assert_same(a: Any, b: Any, path: str = "<root>") -> None:
    """Equal values and types, bit-exact tensors."""
    assert type(a) is type(b), f"{path}: {type(a)} != {type(b)}"
    if isinstance(a, torch.Tensor):
        assert (a.dtype, a.shape, a.device) == (b.dtype, b.shape, b.device), path
        if a.numel():
            a_bytes = a.detach().contiguous().reshape(-1).view(torch.uint8)
            b_bytes = b.detach().contiguous().reshape(-1).view(torch.uint8)
            assert torch.equal(a_bytes, b_bytes), f"{path}: tensor bytes differ"
    elif isinstance(a, dict):
        assert list(a) == list(b), path
        for k in a:
            assert_same(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{path}[{i}]")
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"


def mixed_state(big_numel: int = 1000) -> dict[str, Any]:
    """A float32, a bf16, an int64 and an int32 tensor, a strided view of another
    entry, a tied pair, a 0-d tensor, nested containers and plain values."""
    g = torch.Generator().manual_seed(1)
    base = torch.randn(8192, generator=g)
    tied = torch.randn(10_000, generator=g)
    return {
        "f32": torch.randn(16_384, generator=g),
        "bf16": torch.randn(20_000, generator=g).to(torch.bfloat16),
        "i64": torch.arange(8192, dtype=torch.int64) * 3,
        "i32": torch.randint(-1000, 1000, (4096,), dtype=torch.int32, generator=g),
        "base": base,
        "view": base[100:4000:3],
        "tied_a": tied,
        "tied_b": tied,
        "scalar": torch.tensor(2.5),
        "big": torch.randn(big_numel, generator=g),
        "nested": {"list": [torch.randn(1000, generator=g), 3, "x"], "step": 7, "lr": 0.5},
    }


def mutate(state: dict[str, Any]) -> None:
    """Change every tensor of mixed_state in place, as an optimizer step would."""
    state["f32"].add_(1)
    state["bf16"].zero_()
    state["i64"].add_(7)
    state["i32"].mul_(-1)
    state["base"].mul_(-2)  # also changes "view"
    state["tied_a"].add_(3)  # also "tied_b"
    state["scalar"].fill_(-1)
    state["big"].zero_()
    state["nested"]["list"][0].fill_(5)


def check_mixed(loaded: dict[str, Any], expected: dict[str, Any]) -> None:
    assert_same(loaded, expected)
    assert loaded["tied_a"] is loaded["tied_b"]
    # The view still shares its base's storage.
    assert loaded["view"].untyped_storage().data_ptr() == loaded["base"].untyped_storage(
    ).data_ptr()


def data_files(path: Path) -> list[str]:
    return sorted(p.name for p in path.iterdir() if p.name.startswith("data-"))


def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        m = re.search(r"^VmRSS:\s+(\d+) kB", f.read(), re.M)
    assert m
    return int(m[1]) * KIB


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def wait_done(future: fastpersist.SaveFuture, timeout: float = 60) -> None:
    """Wait without looking at the result (done() does not count as observing)."""
    deadline = time.monotonic() + timeout
    while not future.done():
        assert time.monotonic() < deadline, "the save never finished"
        time.sleep(0.005)


@pytest.fixture(autouse=True)
def _fresh_default_saver(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Each test gets its own process-wide Saver (fastpersist.async_save's), so that
    no test sees another's staging buffers or unobserved failures."""
    registry_module.close_shared()
    yield
    registry_module.close_shared()


# --- the snapshot isolates the checkpoint from later changes ---------------------------------


@pytest.mark.parametrize("budget", [0, 256 * KIB], ids=["unbounded", "small-budget"])
def test_mutation_after_return_does_not_reach_the_checkpoint(
        tmp_path: Path, engine_name: str, monkeypatch: pytest.MonkeyPatch, budget: int) -> None:
    monkeypatch.setenv("FASTPERSIST_STAGING_BUDGET", str(budget))
    # "big" (800 KiB) is larger than half the small budget: written unstaged.
    state = mixed_state(big_numel=200_000)
    expected = copy.deepcopy(state)
    target = tmp_path / "ck"
    future = fastpersist.async_save(state, target)
    mutate(state)
    assert not torch.equal(state["f32"], expected["f32"])  # the mutation did happen
    future.result()
    assert future.done()
    loaded = fastpersist.load(target, verify=True)
    check_mixed(loaded, expected)
    files = data_files(target)
    manifest = checkpoint.read_manifest(target)
    if budget:
        assert len(files) > 1, files
        # The oversize tensor has a data file of its own.
        big_file = {r.file for r in manifest.tensors if r.name.startswith("big")}
        assert len(big_file) == 1
        assert [r.name for r in manifest.tensors if r.file in big_file] == [
            r.name for r in manifest.tensors if r.name.startswith("big")]
    else:
        assert files == ["data-00000.safetensors"]
    assert [p.name for p in target.parent.iterdir()] == ["ck"]



@pytest.mark.parametrize("budget", [
    0,
    256 * KIB,
], ids=["unbounded", "small-budget"])
def test_mutation_while_several_saves_are_queued(tmp_path: Path, engine_name: str,
                                                 monkeypatch: pytest.MonkeyPatch,
                                                 budget: int) -> None:
    """Save, mutate, save, mutate ... on one Saver: every checkpoint holds exactly
    the state of its save() call. (With the small budget the second save's first
    data file best fits the buffer that was released last.)"""
    monkeypatch.setenv("FASTPERSIST_STAGING_BUDGET", str(budget))
    state = mixed_state(big_numel=200_000)
    saves = []
    for k in range(4):
        expected = copy.deepcopy(state)
        saves.append((fastpersist.async_save(state, tmp_path / f"ck{k}"), expected))
        mutate(state)
    for k, (future, expected) in enumerate(saves):
        future.result()
        check_mixed(fastpersist.load(tmp_path / f"ck{k}"), expected)


@pytest.mark.parametrize("budget", [0, 256 * KIB], ids=["one-file", "several-files"])
def test_result_equals_a_synchronous_save(tmp_path: Path, engine_name: str,
                                          monkeypatch: pytest.MonkeyPatch, budget: int) -> None:
    state = mixed_state(big_numel=200_000)
    fastpersist.save(state, tmp_path / "sync")
    monkeypatch.setenv("FASTPERSIST_STAGING_BUDGET", str(budget))
    fastpersist.async_save(state, tmp_path / "async").result()
    sync, asynch = tmp_path / "sync", tmp_path / "async"
    assert_same(fastpersist.load(asynch), fastpersist.load(sync))
    m_sync, m_async = checkpoint.read_manifest(sync), checkpoint.read_manifest(asynch)
    assert m_async.tree == m_sync.tree

    def records(m: Any) -> dict[str, tuple[Any, ...]]:
        return {r.name: (r.dtype, r.shape, r.length, r.crc32c) for r in m.tensors}

    assert records(m_async) == records(m_sync)
    if not budget:
        assert data_files(asynch) == data_files(sync) == ["data-00000.safetensors"]
        assert (asynch / "data-00000.safetensors").read_bytes() == (
            sync / "data-00000.safetensors").read_bytes()
        doc_sync = json.loads((sync / "manifest.json").read_bytes())
        doc_async = json.loads((asynch / "manifest.json").read_bytes())
        doc_sync.pop("created_unix")
        doc_async.pop("created_unix")
        assert doc_async == doc_sync
    else:
        assert len(data_files(asynch)) > 1


def test_wait_for_snapshot_false_on_cpu(tmp_path: Path) -> None:
    state = mixed_state()
    expected = copy.deepcopy(state)
    future = fastpersist.async_save(state, tmp_path / "ck", wait_for_snapshot=False)
    future.wait_snapshot(timeout=30)
    mutate(state)
    future.result(timeout=60)
    check_mixed(fastpersist.load(tmp_path / "ck"), expected)


def test_future_api(tmp_path: Path) -> None:
    calls: list[fastpersist.SaveFuture] = []
    t0 = time.perf_counter()
    future = fastpersist.async_save({"w": torch.randn(MIB), "step": 1}, tmp_path / "ck")
    returned = time.perf_counter() - t0
    future.add_done_callback(calls.append)
    assert future.path == tmp_path / "ck"
    assert isinstance(future.snapshot_seconds, float)
    assert 0 < future.snapshot_seconds <= returned
    future.wait_snapshot(timeout=0)  # already taken
    future.result(timeout=60)
    assert future.done() and future.exception() is None
    assert isinstance(future.persist_seconds, float) and future.persist_seconds > 0
    assert calls == [future]
    assert "done" in repr(future)
    assert fastpersist.load(tmp_path / "ck")["step"] == 1


def test_errors_before_the_snapshot_raise_from_async_save(tmp_path: Path) -> None:
    with pytest.raises(UnsupportedValueError):
        fastpersist.async_save({"w": torch.ones(3), "bad": object()}, tmp_path / "a")
    assert not (tmp_path / "a").exists()

    not_a_ckpt = tmp_path / "file"
    not_a_ckpt.write_text("precious")
    with pytest.raises(CheckpointExistsError):
        fastpersist.async_save({"w": torch.ones(3)}, not_a_ckpt)
    assert not_a_ckpt.read_text() == "precious"

    foreign = tmp_path / "dir"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    with pytest.raises(CheckpointExistsError):
        fastpersist.async_save({"w": torch.ones(3)}, foreign)
    assert [p.name for p in foreign.iterdir()] == ["notes.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dir", "file"]
    # The Saver is still usable afterwards.
    fastpersist.async_save({"w": torch.ones(3)}, tmp_path / "ok").result()


def test_allow_pickle(tmp_path: Path) -> None:
    state = {"w": torch.ones(3), "extra": {1, 2, 3}}
    fastpersist.async_save(state, tmp_path / "ck", allow_pickle=True).result()
    assert fastpersist.load(tmp_path / "ck", allow_pickle=True)["extra"] == {1, 2, 3}


# --- staging memory -------------------------------------------------------------------------


def test_staging_is_allocated_once_and_reused(tmp_path: Path, engine_name: str) -> None:
    saver = in_process_saver()
    state = {f"w{i}": torch.randn(256 * KIB) for i in range(4)}  # 4 MiB
    assert saver.staging_bytes == 0
    for k in range(3):
        saver.save(state, tmp_path / f"ck{k}").result()
        assert saver.staging_bytes == 4 * MIB
    saver.close()
    assert saver.staging_bytes == 0


def thread_minor_faults() -> int:
    """Minor page faults of the calling thread so far (/proc/thread-self/stat)."""
    with open("/proc/thread-self/stat") as stat:
        return int(stat.read().rsplit(")", 1)[1].split()[7])


def test_a_second_save_is_warm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 14, part 4: after one save, the staging holds a buffer per data file,
    so a second save of the same state allocates nothing and faults no staging
    page in. (Taking buffers file by file, a file could take the buffer of one
    the writer had finished, and a second save then allocated the rest.)"""
    monkeypatch.setenv("FASTPERSIST_FILE_BYTES", str(1 * MIB))
    real_stage = saver_module.stage_file

    def slow_copy(*args: Any) -> Any:
        staged = real_stage(*args)
        time.sleep(0.05)  # time for the writer to finish an earlier file, if it had one
        return staged

    monkeypatch.setattr(saver_module, "stage_file", slow_copy)
    saver = in_process_saver()
    state = {f"w{i}": torch.randn(256 * KIB) for i in range(8)}  # 8 files of 1 MiB
    saver.save(state, tmp_path / "first").result()
    assert saver.pool.allocations == 8 and saver.staging_bytes == 8 * MIB
    before = thread_minor_faults()
    future = saver.save(state, tmp_path / "second")  # returns after the copy
    faults = thread_minor_faults() - before
    future.result()
    assert saver.pool.allocations == 8  # every buffer reused
    # 8 MiB of staging is 2048 pages: none is faulted in again (the bound leaves
    # room for the interpreter's own small allocations).
    assert faults < 200, faults
    assert_same(fastpersist.load(tmp_path / "second"), state)
    saver.close()


def test_files_go_to_the_writer_after_the_whole_copy(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """A snapshot that fits the staging is copied before the writer starts: its
    checksums and I/O do not compete with the copy the caller waits for."""
    monkeypatch.setenv("FASTPERSIST_FILE_BYTES", str(1 * MIB))
    events: list[str] = []
    real_stage, real_write = saver_module.stage_file, persist_module.CheckpointWriter.write_file

    def stage(*args: Any) -> Any:
        events.append("copy")
        return real_stage(*args)

    def write(self: Any, tensors: Any) -> None:
        events.append("write")
        real_write(self, tensors)

    monkeypatch.setattr(saver_module, "stage_file", stage)
    monkeypatch.setattr(persist_module.CheckpointWriter, "write_file", write)
    saver = in_process_saver()
    saver.save({f"w{i}": torch.randn(256 * KIB) for i in range(4)}, tmp_path / "c").result()
    assert events == ["copy"] * 4 + ["write"] * 4
    saver.close()


def test_a_failed_copy_gives_back_the_buffers_it_did_not_use(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FASTPERSIST_FILE_BYTES", str(1 * MIB))
    state = {f"w{i}": torch.randn(256 * KIB) for i in range(6)}
    saver = in_process_saver()
    saver.save(state, tmp_path / "a").result()
    real_stage = saver_module.stage_file
    calls = []

    def failing(*args: Any) -> Any:
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("copy failed")
        return real_stage(*args)

    monkeypatch.setattr(saver_module, "stage_file", failing)
    with pytest.raises(RuntimeError, match="copy failed"):
        saver.save(state, tmp_path / "b")
    assert not (tmp_path / "b").exists()
    monkeypatch.setattr(saver_module, "stage_file", real_stage)
    saver.save(state, tmp_path / "c").result()
    # Only the buffer the failed copy wrote into is not reused (discarded: freed,
    # or kept where a device copy might still land in it); the two copied
    # files' and the three untouched ones are.
    assert saver.pool.allocations == 6 + 1
    assert_same(fastpersist.load(tmp_path / "c"), state)
    saver.close()


def test_staging_stays_within_the_budget(tmp_path: Path, engine_name: str,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    budget = 1 * MIB
    monkeypatch.setenv("FASTPERSIST_STAGING_BUDGET", str(budget))
    saver = in_process_saver()
    # 10 x 256 KiB (staged, two per file) and one 2 MiB tensor (unstaged).
    state = {f"w{i:02d}": torch.full((64 * KIB,), float(i)) for i in range(10)}
    state["huge"] = torch.randn(512 * KIB)
    expected = copy.deepcopy(state)
    sizes = []
    for k in range(3):
        future = saver.save(state, tmp_path / f"ck{k}")
        sizes.append(saver.staging_bytes)
        assert 0 < saver.staging_bytes <= budget
        for t in state.values():
            t.add_(1)
        future.result()
        assert_same(fastpersist.load(tmp_path / f"ck{k}"), expected)
        assert len(data_files(tmp_path / f"ck{k}")) == 6
        for t in expected.values():
            t.add_(1)
    assert saver.staging_bytes == sizes[0]  # reused, not reallocated
    saver.close()


def test_saves_after_the_state_grew(tmp_path: Path) -> None:
    saver = in_process_saver()
    small = {"w": torch.randn(64 * KIB)}
    large = {"w": torch.randn(256 * KIB), "v": torch.randn(64 * KIB)}
    for k, state in enumerate([small, large, large, small, large]):
        saver.save(state, tmp_path / f"ck{k}").result()
        assert_same(fastpersist.load(tmp_path / f"ck{k}"), state)
    saver.close()


def test_staging_grows_instead_of_piling_up(tmp_path: Path) -> None:
    saver = in_process_saver()
    for k, mib in enumerate([1, 2, 3]):
        saver.save({"w": torch.zeros(mib * MIB // 4)}, tmp_path / f"ck{k}").result()
        assert saver.staging_bytes == mib * MIB, k
    saver.close()


def test_staging_respects_a_budget_set_later(tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    saver = in_process_saver()
    state = {f"w{i}": torch.randn(256 * KIB) for i in range(4)}  # 4 MiB
    saver.save(state, tmp_path / "a").result()
    monkeypatch.setenv("FASTPERSIST_STAGING_BUDGET", str(2 * MIB))
    saver.save(state, tmp_path / "b").result()
    assert saver.staging_bytes <= 2 * MIB
    saver.close()


def test_state_without_tensor_bytes(tmp_path: Path) -> None:
    saver = in_process_saver()
    saver.save({"step": 3, "empty": torch.empty(0, 4)}, tmp_path / "ck").result()
    loaded = fastpersist.load(tmp_path / "ck")
    assert loaded["step"] == 3 and loaded["empty"].shape == (0, 4)
    saver.close()


def test_many_saves_do_not_grow_memory_or_fds(tmp_path: Path, engine_name: str) -> None:
    state = {f"w{i}": torch.randn(512 * KIB) for i in range(4)}  # 8 MiB
    with Checkpointer(tmp_path / "ckpts", keep_last=2) as ckpt:
        samples = []
        for step in range(36):
            for t in state.values():
                t.add_(1)
            ckpt.save(step, state).result()
            if step >= 5:  # after warm-up
                samples.append((rss_bytes(), open_fds(), ckpt.staging_bytes))
        _, fds0, staging0 = samples[0]
        assert staging0 == 8 * MIB
        for _, fds, staging in samples:
            assert staging == staging0
            assert fds == fds0
        # A leak grows with the saves; one allocator step (a malloc arena, on a
        # busy machine) does not: compare the typical RSS early and late.
        third = len(samples) // 3
        early = statistics.median(rss for rss, _, _ in samples[:third])
        late = statistics.median(rss for rss, _, _ in samples[-third:])
        assert late - early < 6 * MIB, f"RSS grew by {(late - early) / MIB:.1f} MiB"
        assert_same(ckpt.load_latest(), state)
        assert ckpt.steps() == [34, 35]


# --- failures in the background ------------------------------------------------------------


def _sh(*cmd: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=False)


@pytest.fixture
def small_tmpfs(tmp_path: Path) -> Iterator[Path]:
    """An 8 MiB tmpfs (as in tests/test_errors.py); skipped where mounting is not allowed."""
    if os.geteuid() != 0 or not shutil.which("mount") or not shutil.which("umount"):
        pytest.skip("mounting a tmpfs needs root and mount(8)")
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    r = _sh("mount", "-t", "tmpfs", "-o", "size=8m,mode=0755", "tmpfs", str(mnt))
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs: {r.stderr.strip()}")
    try:
        yield mnt
    finally:
        if _sh("umount", str(mnt)).returncode != 0:
            _sh("umount", "-l", str(mnt))


def versioned(version: int, mib: int) -> dict[str, Any]:
    return {"version": version,
            "weights": [torch.full((MIB // 4,), float(version) + i) for i in range(mib)]}


def free_bytes(d: Path) -> int:
    st = os.statvfs(d)
    return st.f_bfree * st.f_frsize


@pytest.mark.parametrize("budget", [0, 2 * MIB], ids=["one-file", "several-files"])
def test_background_disk_full(engine_name: str, small_tmpfs: Path,
                              monkeypatch: pytest.MonkeyPatch, budget: int) -> None:
    monkeypatch.setenv("FASTPERSIST_STAGING_BUDGET", str(budget))
    ckpts = small_tmpfs / "ckpts"
    target = ckpts / "ck"
    fastpersist.async_save(versioned(1, 1), target).result()
    before = free_bytes(small_tmpfs)
    future = fastpersist.async_save(versioned(2, 12), target)  # returns: the snapshot fits
    with pytest.raises(DiskFullError, match=r"(?i)no space") as info:
        future.result()
    assert info.value.errno in (errno.ENOSPC, errno.EDQUOT)
    assert str(target) in str(info.value)
    assert future.done() and isinstance(future.persist_seconds, float)
    # Nothing half-written: no staging directory, the space is back, v1 intact.
    assert [p.name for p in ckpts.iterdir()] == ["ck"]
    assert find_leftovers(ckpts) == []
    os.sync()
    assert free_bytes(small_tmpfs) >= before
    loaded = fastpersist.load(target, verify=True)
    assert_same(loaded, versioned(1, 1))
    # Observed on the future, so not raised again; the disk is usable.
    fastpersist.async_save(versioned(3, 1), target).result()
    assert fastpersist.load(target)["version"] == 3


def test_unobserved_failure_is_raised_by_the_next_async_save(
        tmp_path: Path, engine_name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    inject_enospc(monkeypatch, "bad")
    failed = fastpersist.async_save({"w": torch.ones(1000)}, tmp_path / "bad")
    wait_done(failed)
    with pytest.raises(CheckpointError) as info:
        fastpersist.async_save({"w": torch.ones(10)}, tmp_path / "next")
    assert isinstance(info.value.__cause__, DiskFullError)
    assert "bad" in str(info.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # neither save left anything
    # Raised once: the next save goes through.
    fastpersist.async_save({"w": torch.ones(10)}, tmp_path / "next").result()
    # And the failure is on its own future as well.
    with pytest.raises(DiskFullError):
        failed.result()


def test_unobserved_failure_is_raised_by_the_next_checkpointer_save(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    inject_enospc(monkeypatch, "step-00000001")
    with Checkpointer(tmp_path / "ckpts") as ckpt:
        wait_done(ckpt.save(1, {"w": torch.ones(1000)}))
        with pytest.raises(CheckpointError) as info:
            ckpt.save(2, {"w": torch.ones(1000)})
        assert isinstance(info.value.__cause__, DiskFullError)
        ckpt.save(2, {"w": torch.ones(1000)}).result()
        assert ckpt.steps() == [2]


def test_failure_while_the_next_save_waits_for_room(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    gate = threading.Event()
    inject_enospc(monkeypatch, "bad", gate)
    failed = fastpersist.async_save({"w": torch.ones(1000)}, tmp_path / "bad")
    timer = threading.Timer(0.3, gate.set)  # fails while the next save waits
    timer.start()
    try:
        with pytest.raises(CheckpointError) as info:
            fastpersist.async_save({"w": torch.ones(10)}, tmp_path / "next").result()
        assert isinstance(info.value.__cause__, DiskFullError)
    finally:
        timer.join()
        wait_done(failed)
        failed.exception()


# --- backpressure ----------------------------------------------------------------------------


def test_max_in_flight_one_waits_for_the_previous_save(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FASTPERSIST_MAX_IN_FLIGHT", "1")
    log = WriteLog(monkeypatch, hold=0)
    first = log.watch(fastpersist.async_save({"w": torch.ones(1000)}, tmp_path / "a"))
    assert log.held.wait(30)
    assert not first.done()
    timer = log.release_after(0.3)
    second = log.watch(fastpersist.async_save({"w": torch.ones(1000)}, tmp_path / "b"))
    assert first.done()  # async_save waited for room
    first.result()
    second.result()
    timer.join()
    assert log.events.index(("done", "a")) < log.events.index(("begin", "b")), log.events


def test_max_in_flight_two_overlaps(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    saver = in_process_saver(max_in_flight=2)
    log = WriteLog(monkeypatch, hold=0)
    first = log.watch(saver.save({"w": torch.ones(1000)}, tmp_path / "a"))
    assert log.held.wait(30)
    second = log.watch(saver.save({"w": torch.ones(1000)}, tmp_path / "b"))
    assert not first.done()  # the second save started while the first persists
    third = None
    timer = log.release_after(0.3)
    third = log.watch(saver.save({"w": torch.ones(1000)}, tmp_path / "c"))  # waits for room
    assert first.done()
    for f in (first, second, third):
        f.result()
    timer.join()
    ev = log.events
    assert ev.index(("begin", "b")) < ev.index(("done", "a")) < ev.index(("begin", "c")), ev
    saver.close()


def test_max_in_flight_is_read_at_each_save(tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FASTPERSIST_MAX_IN_FLIGHT", "1")
    fastpersist.async_save({"w": torch.ones(1000)}, tmp_path / "warm").result()
    monkeypatch.setenv("FASTPERSIST_MAX_IN_FLIGHT", "2")
    log = WriteLog(monkeypatch, hold=0)
    first = log.watch(fastpersist.async_save({"w": torch.ones(1000)}, tmp_path / "a"))
    assert log.held.wait(30)
    timer = log.release_after(0.5)
    try:
        fastpersist.async_save({"w": torch.ones(1000)}, tmp_path / "b")
        assert not first.done(), "the second save waited although 2 may be in flight"
    finally:
        timer.join()
        fastpersist.api.pipeline_for("").wait()


def test_closed_saver_refuses_saves(tmp_path: Path) -> None:
    saver = in_process_saver()
    saver.save({"w": torch.ones(3)}, tmp_path / "a")
    saver.close()
    assert fastpersist.load(tmp_path / "a")["w"].tolist() == [1.0, 1.0, 1.0]
    with pytest.raises(CheckpointError):
        saver.save({"w": torch.ones(3)}, tmp_path / "b")
    assert not (tmp_path / "b").exists()


def test_math_sanity_of_budget_split() -> None:
    """The split that the budget tests rely on: 10 x 256 KiB into files of two, plus
    one file per tensor above half the budget."""
    from fastpersist.saving.snapshot import group_into_files
    from fastpersist.tensors import plan, state

    s = {f"w{i:02d}": torch.zeros(64 * KIB) for i in range(10)}
    s["huge"] = torch.zeros(512 * KIB)
    _, leaves = state.encode(s)
    files = group_into_files(plan.plan_tensors(leaves), MIB, 256 * MIB)
    assert sorted((len(f.tensors), f.staged) for f in files) == [(1, False)] + [(2, True)] * 5
    assert sum(f.nbytes for f in files) == 9 * MIB // 2


def test_process_exit_waits_for_an_in_flight_save(tmp_path: Path) -> None:
    """A script that calls async_save and exits at once still gets its checkpoint."""
    script = (
        "import sys, torch, fastpersist\n"
        "state = {'w': torch.full((64 << 20,), 3.0), 'step': 9}\n"
        "fastpersist.async_save(state, sys.argv[1])\n"
    )
    target = tmp_path / "ckpt"
    subprocess.run([sys.executable, "-c", script, str(target)], check=True, timeout=300)
    out = fastpersist.load(target)
    assert out["step"] == 9 and bool((out["w"] == 3.0).all())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_snapshot_failure_is_raised_once_and_leaves_nothing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An error while copying into staging raises from async_save itself; the
    next save is not blamed for it again, and nothing is left on disk."""
    saver = in_process_saver()
    real_stage = saver_module.stage_file

    def broken_stage(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("copy failed")

    monkeypatch.setattr(saver_module, "stage_file", broken_stage)
    with pytest.raises(RuntimeError, match="copy failed"):
        saver.save({"w": torch.ones(10)}, tmp_path / "a")
    monkeypatch.setattr(saver_module, "stage_file", real_stage)
    saver.wait()
    assert find_leftovers(tmp_path) == [] and not (tmp_path / "a").exists()
    saver.save({"w": torch.ones(10)}, tmp_path / "b").result()  # not "an earlier save failed"
    assert torch.equal(fastpersist.load(tmp_path / "b")["w"], torch.ones(10))
    saver.close()


def test_saves_from_two_threads_start_one_writer_thread(tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Two threads' first saves both find no writer thread; only one may start
    one (two writers: close() stops one and waits forever for the other)."""
    both_checked = threading.Barrier(2, timeout=2.0)  # passes only if both got this far
    writers: list[threading.Thread] = []

    class Thread(threading.Thread):
        def __init__(self, *a: Any, **k: Any) -> None:
            super().__init__(*a, **k)
            if k.get("name") == "fastpersist-writer":
                writers.append(self)
                with contextlib.suppress(threading.BrokenBarrierError):
                    both_checked.wait()

    monkeypatch.setattr(saver_module.threading, "Thread", Thread)
    saver = in_process_saver(max_in_flight=2)
    saves = [Thread(target=lambda i=i: saver.save({"i": torch.full((4,), i)},
                                                   tmp_path / f"ck{i}").result())
             for i in range(2)]
    for t in saves:
        t.start()
    for t in saves:
        t.join(60)
    try:
        assert len(writers) == 1, f"{len(writers)} writer threads"
    finally:
        for _ in writers[1:]:  # so that close() does not wait forever on the old code
            saver._jobs.put(STOP)
        saver.close()
    for i in range(2):
        assert torch.equal(fastpersist.load(tmp_path / f"ck{i}")["i"], torch.full((4,), i))
