"""StagingPool.give_back: the one way a staging buffer comes back, and the rule it
enforces (staging.py): reused only when every reader and writer of it is known
to be done, quarantined otherwise, with the memory accounted either way."""

from __future__ import annotations

import threading

import pytest
import torch
from support import in_process_saver

from fastpersist.errors import CheckpointError
from fastpersist.saving.snapshot import StagedFile, stage_file
from fastpersist.saving.staging import StagingPool
from fastpersist.tensors.plan import StoredTensor

N = 4096


class Copy:
    """A device copy into a buffer: done when the test says so, or failed."""

    def __init__(self, fails: bool = False) -> None:
        self.fails = fails
        self.waited = threading.Event()
        self.landed = threading.Event()

    def synchronize(self) -> None:
        self.waited.set()
        self.landed.wait()
        if self.fails:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")


class Pool:
    """A StagingPool whose frees and let-gos are recorded."""

    def __init__(self, let_go: bool) -> None:
        self.freed: list[int] = []
        self.let_go: list[int] = []
        self.pool = StagingPool(
            free=lambda b: self.freed.append(b.data_ptr()),
            let_go=(lambda b: self.let_go.append(b.data_ptr())) if let_go else None)

    def staged(self, *events: Copy) -> StagedFile:
        buffer = self.pool.acquire(N, 0, False)
        source = torch.zeros(N // 4)
        staged = stage_file([StoredTensor("t", "F32", (N // 4,), source, N)], buffer, False)
        staged.events.extend(events)  # type: ignore[arg-type]
        return staged


def test_a_buffer_nobody_else_read_is_reused() -> None:
    p = Pool(let_go=True)
    s = p.staged()
    p.pool.give_back(s)
    assert p.pool.acquire(N, 0, False).data_ptr() == s.buffer.data_ptr()  # type: ignore[union-attr]
    assert p.pool.allocated_bytes == N and p.pool.quarantined == 0


def test_a_lent_buffer_comes_back_only_when_returned() -> None:
    p = Pool(let_go=True)
    s = p.staged()
    s.lend()
    s.returned()
    p.pool.give_back(s)
    assert p.pool.acquire(N, 0, False).data_ptr() == s.buffer.data_ptr()  # type: ignore[union-attr]


@pytest.mark.parametrize("let_go", [True, False])
def test_a_lent_buffer_never_returned_is_quarantined(let_go: bool) -> None:
    p = Pool(let_go=let_go)
    s = p.staged()
    s.lend()
    p.pool.give_back(s)
    assert p.pool.quarantined == 1
    assert p.pool.allocated_bytes == 0  # out of the budget: nobody's to reuse
    if let_go:  # segments: unlinked and unmapped here; the reader's mapping stays
        assert p.let_go == [s.buffer.data_ptr()] and p.pool.quarantined_bytes == 0  # type: ignore[union-attr]
    else:  # nothing can free it safely: kept, never reused
        assert p.let_go == [] and p.pool.quarantined_bytes == N
    assert p.freed == []
    other = p.pool.acquire(N, 0, False)
    assert other.data_ptr() != s.buffer.data_ptr()  # type: ignore[union-attr]


def test_giving_back_twice_does_not_hand_a_buffer_to_two_users() -> None:
    p = Pool(let_go=True)
    first = p.staged()
    p.pool.give_back(first)
    second = p.staged()  # the same buffer, in use again
    assert second.buffer is first.buffer
    p.pool.give_back(first)  # a stale second give_back: ignored
    third = p.pool.acquire(N, 0, False)
    assert third.data_ptr() != second.buffer.data_ptr()  # type: ignore[union-attr]


def test_give_back_waits_for_a_device_copy_before_the_buffer_can_be_reused() -> None:
    p = Pool(let_go=True)
    copy = Copy()
    s = p.staged(copy)
    giving = threading.Thread(target=p.pool.give_back, args=(s,))
    giving.start()
    assert copy.waited.wait(60)
    # The copy still writes into it: the next acquire must get another buffer.
    other = p.pool.acquire(N, 0, False)
    assert other.data_ptr() != s.buffer.data_ptr()  # type: ignore[union-attr]
    copy.landed.set()
    giving.join(60)
    assert p.pool.acquire(N, 0, False).data_ptr() == s.buffer.data_ptr()  # type: ignore[union-attr]


def test_a_buffer_whose_copy_failed_is_kept_not_freed_nor_reused() -> None:
    p = Pool(let_go=True)
    copy = Copy(fails=True)
    copy.landed.set()
    s = p.staged(copy)
    p.pool.give_back(s)
    # The DMA engine may still write into it: neither unmapped nor reused.
    assert p.pool.quarantined == 1 and p.pool.quarantined_bytes == N
    assert p.let_go == [] and p.freed == []
    assert p.pool.acquire(N, 0, False).data_ptr() != s.buffer.data_ptr()  # type: ignore[union-attr]


def test_a_quarantined_buffer_makes_room_in_the_budget() -> None:
    p = Pool(let_go=True)
    buffer = p.pool.acquire(N, N, False)
    s = StagedFile([], buffer)
    s.lend()
    got: list[torch.Tensor] = []
    waiting = threading.Thread(target=lambda: got.append(p.pool.acquire(N, N, False, 60)))
    waiting.start()  # blocks: the budget is full
    p.pool.give_back(s)
    waiting.join(60)
    assert got and got[0].data_ptr() != buffer.data_ptr()
    assert p.pool.allocated_bytes == N


def test_acquire_all_takes_a_buffer_per_size_and_reuses_them() -> None:
    pool = StagingPool()
    first = pool.acquire_all([N, 2 * N, N], 0, False)
    assert [b.numel() for b in first] == [N, 2 * N, N] and pool.allocations == 3
    pool.give_back_unused(first, False)
    again = pool.acquire_all([N, 2 * N, N], 0, False)
    assert sorted(b.data_ptr() for b in again) == sorted(b.data_ptr() for b in first)
    assert pool.allocations == 3 and pool.allocated_bytes == 4 * N


def test_acquire_all_gives_back_what_it_took_when_one_fails() -> None:
    pool = StagingPool()
    with pytest.raises(CheckpointError, match="does not fit the staging budget"):
        pool.acquire_all([N, 4 * N], 2 * N, False)
    assert pool.allocations == 1
    assert pool.acquire(N, 2 * N, False).numel() == N and pool.allocations == 1  # reused


@pytest.mark.parametrize("pinned", [False, True], ids=["host", "pinned"])
def test_a_discarded_buffer_leaves_the_budget(pinned: bool) -> None:
    """A buffer whose copy failed part-way: freed when the copy came from host
    memory (it has ended), kept out of use when a device copy may still land
    in it; either way out of the budget, so a save waiting for room proceeds."""
    freed: list[int] = []
    # (A "pinned" buffer here is plain memory: what differs is the bookkeeping.)
    pool = StagingPool(lambda n, _: torch.empty(n, dtype=torch.uint8),
                       free=lambda b: freed.append(b.data_ptr()))
    buffer = pool.acquire(N, N, pinned)
    got: list[torch.Tensor] = []
    waiting = threading.Thread(target=lambda: got.append(pool.acquire(N, N, False, 60)))
    waiting.start()  # blocks: the budget is full
    pool.discard(buffer, pinned)
    waiting.join(60)
    assert got and pool.allocated_bytes == N
    if pinned:
        assert freed == [] and pool.quarantined == 1
        assert got[0].data_ptr() != buffer.data_ptr()
    else:
        assert freed == [buffer.data_ptr()] and pool.quarantined == 0


def test_failed_copies_do_not_use_up_the_staging_budget(tmp_path, monkeypatch) -> None:
    """Two async_saves whose copy fails part-way, then one that works: with a
    budget of two files, buffers kept by the failed copies would leave the
    third save waiting for room for ever."""

    import fastpersist
    from fastpersist.saving import pipeline as saver_module

    monkeypatch.setenv("FASTPERSIST_STAGING_BUDGET", str(2 << 20))
    state = {f"t{i}": torch.full((1 << 18,), float(i)) for i in range(6)}  # 6 x 1 MiB
    real = saver_module.stage_file
    calls = [0]

    def fails_on_the_second_file(*args, **kwargs):
        calls[0] += 1
        if calls[0] % 2 == 0:
            raise RuntimeError("copy failed")
        return real(*args, **kwargs)

    saver = in_process_saver()
    monkeypatch.setattr(saver_module, "stage_file", fails_on_the_second_file)
    for attempt in range(2):
        with pytest.raises(RuntimeError, match="copy failed"):
            saver.save(state, tmp_path / f"bad{attempt}").result()
    monkeypatch.setattr(saver_module, "stage_file", real)
    done: list[object] = []
    worker = threading.Thread(target=lambda: done.append(
        saver.save(state, tmp_path / "good").result()), daemon=True)
    worker.start()
    worker.join(60)
    assert done, "the save after two failed copies is still waiting for staging room"
    loaded = fastpersist.load(tmp_path / "good")
    assert all(torch.equal(loaded[k], v) for k, v in state.items())
    saver.close()
