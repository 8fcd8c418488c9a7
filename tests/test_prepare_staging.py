"""prepare_staging: the staging a save takes, allocated and faulted in before the first save.

A fresh process's first async save otherwise maps its staging buffers and takes a
page fault per page of them while the caller waits. After prepare_staging the first
save allocates nothing and (on 4 KiB pages) faults in almost nothing.
"""

from __future__ import annotations

import resource
from pathlib import Path
from typing import Any

import pytest
import torch
from support import daemon_saver, in_process_saver

import fastpersist

MIB = 1 << 20


def _state(tensors: int, each: int) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(tensors)
    return {"layers": {f"w{i}": torch.randn(each // 4, generator=gen) for i in range(tensors)},
            "bias": torch.randn(17, generator=gen), "step": 3}


def _nbytes(state: dict[str, Any]) -> int:
    return sum(t.nbytes for t in state["layers"].values()) + state["bias"].nbytes


def _assert_same(loaded: dict[str, Any], state: dict[str, Any]) -> None:
    assert loaded["step"] == state["step"]
    assert torch.equal(loaded["bias"], state["bias"])
    for name, t in state["layers"].items():
        assert torch.equal(loaded["layers"][name], t), name


def test_a_prepared_saver_allocates_nothing_at_its_first_save(tmp_path: Path) -> None:
    state = _state(3, 8 * MIB)
    saver = in_process_saver()
    try:
        assert saver.prepare_staging(state) == _nbytes(state)  # one data file: one buffer
        allocations = saver.pool.allocations
        assert allocations == 1 and saver.staging_bytes == _nbytes(state)
        saver.save(state, tmp_path / "ckpt").result()
        assert saver.pool.allocations == allocations  # the prepared buffer, reused
        assert saver.staging_bytes == _nbytes(state)
    finally:
        saver.close()
    _assert_same(fastpersist.load(tmp_path / "ckpt"), state)


def _faults_of_first_save(tmp_path: Path, name: str, prepare: bool) -> int:
    state = _state(4, 16 * MIB)
    saver = in_process_saver()
    try:
        if prepare:
            saver.prepare_staging(state)
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        future = saver.save(state, tmp_path / name)  # returns once the snapshot is copied
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
        future.result()
    finally:
        saver.close()
    return faults


def test_a_prepared_first_save_does_not_fault_its_staging_in(tmp_path: Path) -> None:
    pages = 4 * 16 * MIB // 4096
    cold = _faults_of_first_save(tmp_path, "cold", prepare=False)
    if cold < pages // 2:
        pytest.skip(f"staging comes in as huge pages here ({cold} faults for {pages} pages)")
    warm = _faults_of_first_save(tmp_path, "warm", prepare=True)
    assert warm < pages // 8, (warm, cold)


def test_with_a_budget_smaller_than_the_state_every_file_reuses_the_prepared_buffers(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FASTPERSIST_STAGING_BUDGET", str(16 * MIB))
    gen = torch.Generator().manual_seed(0)
    # 30 MiB in files of at most 8 MiB (half the budget), the first one smaller.
    state = {"layers": {f"w{i}": torch.randn(n * MIB // 4, generator=gen)
                        for i, n in enumerate([6, 8, 8, 8])},
             "bias": torch.randn(17, generator=gen), "step": 3}
    saver = in_process_saver()
    try:
        assert saver.prepare_staging(state) == 16 * MIB  # two of the largest file's size
        allocations = saver.pool.allocations
        saver.save(state, tmp_path / "ckpt").result()
        assert saver.pool.allocations == allocations  # every file reused those two
        assert saver.staging_bytes == 16 * MIB
    finally:
        saver.close()
    _assert_same(fastpersist.load(tmp_path / "ckpt"), state)


def test_preparing_while_a_save_is_in_flight_does_not_double_the_staging(
        tmp_path: Path) -> None:
    state = _state(2, 8 * MIB)
    saver = in_process_saver()
    try:
        future = saver.save(state, tmp_path / "ckpt")  # its buffer is the writer's for now
        assert saver.prepare_staging(state) == _nbytes(state)
        assert future.done()  # it waited for that save, then reused its buffer
        assert saver.staging_bytes == _nbytes(state)
        saver.save(state, tmp_path / "ckpt2").result()
        assert saver.staging_bytes == _nbytes(state)
    finally:
        saver.close()


def test_the_checkpointer_and_the_module_prepare_their_savers(tmp_path: Path) -> None:
    state = _state(2, 4 * MIB)
    with fastpersist.Checkpointer(tmp_path / "run", daemon="") as ckpt:
        assert ckpt.prepare_staging(state) == _nbytes(state)
        assert ckpt.staging_bytes == _nbytes(state)
        ckpt.save(1, state).result()
        assert ckpt.staging_bytes == _nbytes(state)
    assert fastpersist.prepare_staging(state, daemon="") == _nbytes(state)
    fastpersist.async_save(state, tmp_path / "async", daemon="").result()
    _assert_same(fastpersist.load(tmp_path / "async"), state)


def test_values_that_need_pickle_are_refused_as_a_save_would(tmp_path: Path) -> None:
    saver = in_process_saver()
    try:
        with pytest.raises(fastpersist.UnsupportedValueError, match="without pickle"):
            saver.prepare_staging({"w": torch.ones(4), "odd": object()})
        assert saver.prepare_staging({"w": torch.ones(4), "odd": 1j}, allow_pickle=True) == 16
    finally:
        saver.close()
    saver.close()
    with pytest.raises(fastpersist.CheckpointError, match="closed"):
        saver.prepare_staging({"w": torch.ones(4)})


def test_through_the_daemon_the_first_save_reuses_the_prepared_segments(
        daemon: Any, tmp_path: Path) -> None:

    state = _state(2, 4 * MIB)
    saver = daemon_saver(daemon.address)
    try:
        assert saver.prepare_staging(state) == _nbytes(state)
        allocations = saver.pool.allocations
        target = daemon.root / "ckpt"
        saver.save(state, target).result()
        assert saver.pool.allocations == allocations
    finally:
        saver.close()
    _assert_same(fastpersist.load(target), state)
