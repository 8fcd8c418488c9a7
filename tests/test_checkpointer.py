"""fastpersist.Checkpointer: retention, the `latest` pointer, close/abort, and crashes.

The contract (fastpersist/checkpointer.py): checkpoints are ROOT/step-NNNNNNNN;
after one is durable, and only then, ROOT/latest names it and retention
deletes what is neither among the newest keep_last nor a multiple of
keep_every; at most max_in_flight saves persist at once; close() finishes the
in-flight save, close(abort=True) abandons it leaving nothing behind; a crash
at any moment leaves `latest` naming a complete checkpoint.

The crash tests run a real training loop in a child process forked from a
server that has already imported torch (tests/helpers/checkpointer_child.py),
and SIGKILL or SIGTERM it while it persists.
"""

from __future__ import annotations

import errno
import os
import shutil
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from support import Child, ForkServer, WriteLog, inject_enospc

import fastpersist
from fastpersist import (
    CheckpointAbortedError,
    Checkpointer,
    CheckpointError,
    CheckpointNotFoundError,
    DiskFullError,
    PostCommitError,
)
from fastpersist.format.manifest import MANIFEST_NAME
from fastpersist.storage.commit import collect, find_leftovers
from fastpersist.tensors import checkpoint

HELPER = Path(__file__).parent / "helpers" / "checkpointer_child.py"
STEP_FRACTION = 1 / 16  # as in the helper
KIB = 1 << 10
MIB = 1 << 20


def small_state(step: int, tensors: int = 3, numel: int = 1024) -> dict[str, Any]:
    return {
        "step": step,
        "weights": {f"w{i}": torch.full((numel,), step + i * STEP_FRACTION)
                    for i in range(tensors)},
        "meta": {"name": f"step{step}"},
    }


def check_state(obj: Any, step: int | None = None) -> int:
    """The step of a loaded state, after checking it is one complete step."""
    assert isinstance(obj, dict)
    s = obj["step"]
    if step is not None:
        assert s == step
    assert obj["meta"] == {"name": f"step{s}"}
    for i in range(len(obj["weights"])):
        t = obj["weights"][f"w{i}"]
        assert t.dtype == torch.float32
        assert bool((t == s + i * STEP_FRACTION).all()), f"w{i} of step {s} holds other values"
    return s


def pointer(root: Path) -> str | None:
    try:
        return (root / "latest").read_text().strip()
    except FileNotFoundError:
        return None


def names(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir())


# --- retention and the latest pointer ------------------------------------------------------


def expected_kept(saved: list[int], keep_last: int | None, keep_every: int | None) -> list[int]:
    if keep_last is None:
        return sorted(saved)
    keep = set(sorted(saved)[-keep_last:])
    if keep_every:
        keep |= {s for s in saved if s % keep_every == 0}
    return sorted(keep)


@pytest.mark.parametrize(("keep_last", "keep_every"), [(2, 4), (1, None), (3, None), (None, 5)])
def test_retention_and_latest_after_each_save(tmp_path: Path, engine_name: str,
                                              keep_last: int | None, keep_every: int | None
                                              ) -> None:
    root = tmp_path / "ckpts"
    saved: list[int] = []
    with Checkpointer(root, keep_last=keep_last, keep_every=keep_every) as ckpt:
        assert ckpt.latest() is None and ckpt.steps() == []
        for step in range(1, 11):
            ckpt.save(step, small_state(step)).result()
            saved.append(step)
            assert ckpt.steps() == expected_kept(saved, keep_last, keep_every), step
            assert ckpt.latest() == root / f"step-{step:08d}"
            assert pointer(root) == f"step-{step:08d}"
            check_state(ckpt.load_latest(), step)
            # Nothing else: no staging directories, no retention leftovers.
            assert names(root) == sorted(
                ["latest", *(f"step-{s:08d}" for s in ckpt.steps())])
    if keep_last == 2 and keep_every == 4:
        assert saved and ckpt.steps() == [4, 8, 9, 10]
    for step in Checkpointer(root).steps():
        check_state(fastpersist.load(root / f"step-{step:08d}"), step)


def test_invalid_arguments(tmp_path: Path) -> None:
    with pytest.raises(ValueError):
        Checkpointer(tmp_path, keep_last=0)
    with pytest.raises(ValueError):
        Checkpointer(tmp_path, keep_every=0)
    with Checkpointer(tmp_path) as ckpt, pytest.raises(ValueError):
        ckpt.save(-1, small_state(1))
    assert list(tmp_path.iterdir()) == []


def test_retention_and_pointer_wait_for_the_newer_checkpoint(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """While step 2 persists, step 1 is neither deleted nor un-pointed-at."""
    root = tmp_path / "ckpts"
    with Checkpointer(root, keep_last=1) as ckpt:
        ckpt.save(1, small_state(1)).result()
        log = WriteLog(monkeypatch, hold=0)  # hold step 2's data file
        future = ckpt.save(2, small_state(2))
        assert log.held.wait(30)
        assert not future.done()
        assert ckpt.steps() == [1]
        assert pointer(root) == "step-00000001"
        assert ckpt.latest() == root / "step-00000001"
        check_state(ckpt.load_latest(), 1)
        log.released.set()
        future.result()
        assert ckpt.steps() == [2]
        assert pointer(root) == "step-00000002"
        assert names(root) == ["latest", "step-00000002"]


def test_retention_deletes_what_it_listed_under_a_hand_made_name(tmp_path: Path) -> None:
    """A checkpoint saved by hand as step-1 (not step-00000001) is retained and
    deleted by the name it has; later saves keep working."""
    root = tmp_path / "ckpts"
    fastpersist.save(small_state(1), root / "step-1")
    with Checkpointer(root, keep_last=2) as ckpt:
        for step in (2, 3, 4):
            ckpt.save(step, small_state(step)).result()
        assert ckpt.steps() == [3, 4]
        assert names(root) == ["latest", "step-00000003", "step-00000004"]
        assert ckpt.latest() == root / "step-00000004"


def test_latest_returns_the_directory_it_found(tmp_path: Path) -> None:
    root = tmp_path / "ckpts"
    fastpersist.save(small_state(7), root / "step-7")
    ckpt = Checkpointer(root)
    assert ckpt.latest() == root / "step-7"
    check_state(ckpt.load_latest(), 7)


def test_latest_falls_back_to_a_scan(tmp_path: Path) -> None:
    root = tmp_path / "ckpts"
    with Checkpointer(root) as ckpt:
        for step in (3, 7, 12):
            ckpt.save(step, small_state(step)).result()
    ckpt = Checkpointer(root)
    assert ckpt.latest() == root / "step-00000012"

    (root / "latest").unlink()  # no pointer at all
    assert ckpt.latest() == root / "step-00000012"
    check_state(ckpt.load_latest(), 12)

    (root / "latest").write_text("step-00000007\n")  # an older, valid one: trusted
    assert ckpt.latest() == root / "step-00000007"

    shutil.rmtree(root / "step-00000007")  # names a deleted directory
    assert ckpt.latest() == root / "step-00000012"

    (root / "latest").write_text("step-00000099\n")  # never existed
    assert ckpt.latest() == root / "step-00000012"

    (root / "step-00000050").mkdir()  # an incomplete directory is never a checkpoint
    (root / "latest").write_text("step-00000050\n")
    assert ckpt.latest() == root / "step-00000012"
    assert ckpt.steps() == [3, 12]

    (root / "latest").write_text("../../etc\n")  # garbage
    assert ckpt.latest() == root / "step-00000012"
    check_state(ckpt.load_latest(), 12)


def test_load_latest_round_trip(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(8, 16)).sum().backward()
    opt.step()
    state = {"model": model.state_dict(), "optim": opt.state_dict(), "step": 5,
             "rng": torch.get_rng_state()}
    root = tmp_path / "ckpts"
    ckpt = Checkpointer(root)
    with pytest.raises(CheckpointNotFoundError):
        ckpt.load_latest()
    ckpt.save(5, state).result()
    ckpt.close()
    loaded = Checkpointer(root).load_latest(map_location="cpu")
    assert loaded["step"] == 5
    assert torch.equal(loaded["rng"], state["rng"])
    for k, v in state["model"].items():
        assert torch.equal(loaded["model"][k], v), k
    assert loaded["optim"]["param_groups"] == state["optim"]["param_groups"]
    for pid, s in state["optim"]["state"].items():
        for k, v in s.items():
            assert torch.equal(loaded["optim"]["state"][pid][k], v), (pid, k)
    model2 = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    model2.load_state_dict(loaded["model"])


# --- close, abort, backpressure, failures ------------------------------------------------


def test_close_finishes_the_in_flight_save(tmp_path: Path, engine_name: str) -> None:
    root = tmp_path / "ckpts"
    ckpt = Checkpointer(root, keep_last=1)
    ckpt.save(1, small_state(1, numel=MIB))
    future = ckpt.save(2, small_state(2, numel=MIB))
    ckpt.close()
    assert future.done()
    future.result()
    assert pointer(root) == "step-00000002"
    assert names(root) == ["latest", "step-00000002"]
    assert ckpt.staging_bytes == 0
    with pytest.raises(CheckpointError):
        ckpt.save(3, small_state(3))


def test_close_abort_during_a_slow_save_leaves_no_trace(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A budget of 2 MiB cuts 4 x 1 MiB tensors into 4 data files (at most 2 staged
    at once, so save() returns once the second is written); the third file's
    write is held until close(abort=True) has been called, so the abort lands
    between data files."""
    root = tmp_path / "ckpts"
    ckpt = Checkpointer(root)
    ckpt.save(1, small_state(1)).result()
    monkeypatch.setenv("FASTPERSIST_STAGING_BUDGET", str(2 * MIB))
    log = WriteLog(monkeypatch, hold=2)  # step 2's third data file
    future = ckpt.save(2, small_state(2, tensors=4, numel=MIB // 4))
    assert log.held.wait(30)
    timer = log.release_after(0.3)  # runs while close() waits for the save
    ckpt.close(abort=True)
    timer.join()
    assert future.done()
    with pytest.raises(CheckpointAbortedError):
        future.result()
    assert log.writes == 3, "the abort did not land before the last data file"
    # Nothing left of step 2: no directory, no staging leftovers, pointer unchanged.
    assert names(root) == ["latest", "step-00000001"]
    assert find_leftovers(root) == []
    assert pointer(root) == "step-00000001"
    check_state(Checkpointer(root).load_latest(), 1)
    assert ckpt.staging_bytes == 0


def test_context_manager_aborts_on_keyboard_interrupt(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = tmp_path / "ckpts"
    monkeypatch.setenv("FASTPERSIST_STAGING_BUDGET", str(2 * MIB))
    log = WriteLog(monkeypatch, hold=2)
    future = None
    with pytest.raises(KeyboardInterrupt), Checkpointer(root) as ckpt:
        future = ckpt.save(1, small_state(1, tensors=4, numel=MIB // 4))
        assert log.held.wait(30)
        log.release_after(0.3)
        raise KeyboardInterrupt
    assert future is not None
    with pytest.raises(CheckpointAbortedError):
        future.result()
    assert not root.exists() or names(root) == []


@pytest.mark.parametrize("max_in_flight", [1, 2])
def test_backpressure(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, max_in_flight: int
                      ) -> None:
    """The first save's write is held for a moment: with max_in_flight=1 the second
    save() does not begin before the first is done; with 2 it does."""
    root = tmp_path / "ckpts"
    log = WriteLog(monkeypatch, hold=0)
    with Checkpointer(root, max_in_flight=max_in_flight) as ckpt:
        first = log.watch(ckpt.save(1, small_state(1)))
        assert log.held.wait(30)
        log.release_after(0.3)
        second = log.watch(ckpt.save(2, small_state(2)))
        if max_in_flight == 1:
            assert first.done()  # save() waited for room
        first.result()
        second.result()
    begin2 = log.events.index(("begin", "step-00000002"))
    done1 = log.events.index(("done", "step-00000001"))
    if max_in_flight == 1:
        assert done1 < begin2, log.events
    else:
        assert begin2 < done1, log.events
    assert Checkpointer(root).steps() == [1, 2]


def test_unobserved_failure_is_raised_by_the_next_save(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = tmp_path / "ckpts"
    ckpt = Checkpointer(root)
    ckpt.save(1, small_state(1)).result()
    inject_enospc(monkeypatch, "step-00000002")
    failed = ckpt.save(2, small_state(2))
    deadline = time.monotonic() + 30
    while not failed.done():  # done() does not count as looking at the result
        assert time.monotonic() < deadline
        time.sleep(0.01)
    with pytest.raises(CheckpointError) as info:
        ckpt.save(3, small_state(3))
    assert isinstance(info.value.__cause__, DiskFullError)
    assert "step-00000002" in str(info.value)
    # The failed save left nothing; the raising save did not start.
    assert names(root) == ["latest", "step-00000001"]
    assert pointer(root) == "step-00000001"
    # Reported once: the next save works.
    ckpt.save(3, small_state(3)).result()
    assert ckpt.steps() == [1, 3]
    # The failure is still on its own future too.
    with pytest.raises(DiskFullError):
        failed.result()
    ckpt.close()


def test_wait_raises_an_unobserved_failure(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                           ) -> None:
    root = tmp_path / "ckpts"
    inject_enospc(monkeypatch, "step-00000001")
    with Checkpointer(root) as ckpt:
        ckpt.save(1, small_state(1))
        with pytest.raises(CheckpointError) as info:
            ckpt.wait()
        assert isinstance(info.value.__cause__, DiskFullError)
        assert not root.exists() or names(root) == []


def test_close_raises_an_unobserved_failure(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                            ) -> None:
    inject_enospc(monkeypatch, "step-00000001")
    ckpt = Checkpointer(tmp_path / "ckpts")
    ckpt.save(1, small_state(1))  # nobody looks at its future
    with pytest.raises(CheckpointError) as info:
        ckpt.close()
    assert isinstance(info.value.__cause__, DiskFullError)


def test_leaving_the_with_block_on_an_error_keeps_that_error(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    inject_enospc(monkeypatch, "step-00000001")
    with pytest.raises(ValueError, match="training blew up"), pytest.warns(RuntimeWarning), \
            Checkpointer(tmp_path / "ckpts") as ckpt:
        ckpt.save(1, small_state(1))
        raise ValueError("training blew up")


def test_failed_pointer_update_leaves_no_stray_file(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = tmp_path / "ckpts"
    real_replace = os.replace

    def replace(src: Any, dst: Any, *args: Any, **kwargs: Any) -> None:
        # (the pointer is renamed within the root's directory descriptor: by name)
        if Path(dst).name == "latest":
            raise OSError(errno.EIO, "Input/output error (injected)", str(dst))
        real_replace(src, dst, *args, **kwargs)

    monkeypatch.setattr(os, "replace", replace)
    with Checkpointer(root) as ckpt:
        with pytest.raises(PostCommitError, match="step-00000001 is committed, but moving"):
            ckpt.save(1, small_state(1)).result()
        monkeypatch.undo()
        check_state(fastpersist.load(root / "step-00000001"), 1)  # it is, all the same
        known = {"latest", *(lo.path.name for lo in find_leftovers(root))}
        strays = [n for n in names(root) if n not in known and not n.startswith("step-")]
        assert strays == []


# --- crashes: SIGKILL and SIGTERM of a training loop ----------------------------------------

# The crash tests' state: 4 float32 tensors of 12.5M elements (200 MB).
KILL_TENSORS, KILL_NUMEL = 4, 12_500_000
KEEP_LAST, KEEP_EVERY = 2, 3


class Zygote(ForkServer[Child]):
    """The fork server of the training loops (tests/helpers/checkpointer_child.py)."""

    def __init__(self) -> None:
        super().__init__(HELPER, Child)

    def start(self, root: Path, *, start: int, mode: str, abort: bool = False) -> Child:
        return self.fork({
            "root": str(root), "start": start, "mode": mode, "abort": abort,
            "tensors": KILL_TENSORS, "numel": KILL_NUMEL,
            "keep_last": KEEP_LAST, "keep_every": KEEP_EVERY,
            "env": {"FASTPERSIST_ENGINE": "native", "FASTPERSIST_STAGING_BUDGET": "0",
                    "FASTPERSIST_MAX_IN_FLIGHT": "1"},
        })


@pytest.fixture(scope="module")
def zygote() -> Iterator[Zygote]:
    z = Zygote()
    yield z
    z.close()


def check_after_crash(root: Path, child: Child, done_floor: int) -> int | None:
    """Check what a crashed training loop left under root against the contract,
    collect its leftovers, and return the step `latest` names (None: none yet).

    done_floor: the newest step any child reported durable so far.
    """
    done_floor = max([done_floor, *child.steps("done")])
    newest_started = max([done_floor, *child.steps("saved")])
    ckpt = Checkpointer(root)
    latest = ckpt.latest()
    if done_floor:
        assert latest is not None, f"step {done_floor} was reported durable; latest is None"
    latest_step = None if latest is None else int(latest.name.split("-")[1])
    if latest_step is not None:
        assert latest_step >= done_floor, (latest_step, done_floor)
        assert latest_step <= newest_started + 1  # saved, committed, killed before 'saved'
        check_state(fastpersist.load(latest, verify=True), latest_step)
    name = pointer(root)
    if name is not None:
        # The pointer, where there is one, names a complete checkpoint (never one
        # that retention deleted or that was not committed yet).
        assert (root / name).is_dir(), f"latest names {name}, which does not exist"
        checkpoint.read_manifest(root / name)
        # latest() follows the pointer, or a higher step committed after it: the
        # kill came between that step's commit and its pointer update.
        assert latest is not None and (latest.name == name or (
            latest_step is not None and latest_step > int(name.split("-")[1])
            and (latest / MANIFEST_NAME).stat().st_mtime_ns
            > (root / "latest").stat().st_mtime_ns)), (latest, name)
    # Every committed checkpoint is complete; none of the done multiples of keep_every
    # was deleted by retention.
    steps = ckpt.steps()
    for s in steps:
        check_state(fastpersist.load(root / f"step-{s:08d}", verify=True), s)
    for s in range(1, done_floor + 1):
        if s % KEEP_EVERY == 0:
            assert s in steps, f"step {s} (a multiple of keep_every) is gone: {steps}"
    # What else is there is recognisable and belongs to the dead child.
    leftovers = find_leftovers(root)
    for lo in leftovers:
        assert not lo.owner_alive, lo
        with pytest.raises(CheckpointNotFoundError):
            fastpersist.load(lo.path)
    known = {"latest", *(f"step-{s:08d}" for s in steps), *(lo.path.name for lo in leftovers)}
    # (A kill inside the pointer update leaves its temporary file: a leftover too.)
    strays = [n for n in names(root) if n not in known]
    assert not strays, f"unrecognisable entries after the crash: {strays}"
    for lo in leftovers:
        collect(lo)
    assert find_leftovers(root) == []
    assert set(names(root)) <= {"latest", *(f"step-{s:08d}" for s in ckpt.steps())}
    return latest_step


@dataclass
class KillOutcome:
    delay: float
    done: list[int]
    leftovers: list[str]
    latest: int | None


@pytest.mark.slow
def test_sigkill_during_persist(zygote: Zygote, big_tmp: Path) -> None:
    """A training loop saving a 200 MB state each step, SIGKILLed at moments spread
    over its saves; each restart resumes from latest() + 1 as a real job would."""
    root = big_tmp / "ckpts"
    # Calibrate: how long one step's save takes in a fresh child.
    child = zygote.start(big_tmp / "calibrate", start=1, mode="kill")
    t_ready, _ = child.wait_for("ready")
    child.wait_for("done", "1")
    t_done2, _ = child.wait_for("done", "2")
    child.kill()
    shutil.rmtree(big_tmp / "calibrate")
    cycle = max(0.05, (t_done2 - t_ready) / 2)

    delays = [cycle * k for k in (0.2, 0.6, 0.9, 1.3, 1.7, 2.2, 2.6)]
    floor = 0
    outcomes: list[KillOutcome] = []
    # A busy machine runs slower than calibrated: then up to 4 more kills, each
    # later, until the kills have also landed after completed saves.
    while delays:
        delay = delays.pop(0)
        latest = Checkpointer(root).latest()
        start = (int(latest.name.split("-")[1]) if latest else 0) + 1
        child = zygote.start(root, start=start, mode="kill")
        child.wait_for("ready")
        time.sleep(delay)
        child.kill()
        kinds = [lo.kind for lo in find_leftovers(root)] if root.exists() else []
        latest_step = check_after_crash(root, child, floor) if root.exists() else None
        outcomes.append(KillOutcome(delay, child.steps("done"), kinds, latest_step))
        floor = max([floor, *child.steps("done")])
        if not delays and floor < 2 and len(outcomes) < 11:
            delays.append(delay * 1.5)
    # The kills landed where they are meant to: some during a save's persist, and
    # some after saves had completed.
    assert any("tmp" in o.leftovers for o in outcomes), outcomes
    assert any(o.done for o in outcomes), outcomes
    assert floor >= 2, outcomes


@pytest.mark.slow
@pytest.mark.parametrize("abort", [False, True], ids=["close", "close-abort"])
def test_sigterm_mid_persist_closes_cleanly(zygote: Zygote, big_tmp: Path, abort: bool) -> None:
    """SIGTERM sets a flag; the loop stops after its next save() and calls close():
    the child exits 0, and the in-flight checkpoint is committed (and named by
    latest) or, with abort, possibly absent; either way nothing else is left."""
    root = big_tmp / "ckpts"
    child = zygote.start(root, start=1, mode="term", abort=abort)
    child.wait_for("ready")
    child.wait_for("done", "1")
    child.wait_for("saved", "2")
    time.sleep(0.05)  # step 2 is persisting now
    os.kill(child.pid, signal.SIGTERM)
    status = child.wait_exit()
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, status
    kinds = [a[0] for _, a in child.events]
    assert "term" in kinds, child.events
    _, closing = child.wait_for("closing")
    _, closed = child.wait_for("closed")
    last = int(closing[1])
    assert int(closed[1]) == last and last >= 2
    done = child.steps("done")
    assert done and max(done) == last - 1
    ckpt = Checkpointer(root)
    if closed[2] == "committed":
        assert pointer(root) == f"step-{last:08d}"
        assert ckpt.latest() == root / f"step-{last:08d}"
        check_state(ckpt.load_latest(), last)
    else:
        assert abort, "a plain close() must finish the in-flight save"
        assert not (root / f"step-{last:08d}").exists()
        assert pointer(root) == f"step-{last - 1:08d}"
        check_state(ckpt.load_latest(), last - 1)
    assert find_leftovers(root) == []
    expected = {"latest", *(f"step-{s:08d}" for s in ckpt.steps())}
    assert set(names(root)) == expected
    assert ckpt.steps() == expected_kept(
        list(range(1, last + (closed[2] == "committed"))), KEEP_LAST, KEEP_EVERY)
