"""Every durability claim, tested by SIGKILL at a bad moment.

The contract (DESIGN.md, fastpersist.save): a checkpoint is visible under its
name only once all of it is durable; a save over an existing checkpoint
replaces it atomically; a save killed at any moment leaves the old checkpoint
or the new one, never a partial one that load or read_manifest accepts; what a
killed save leaves behind is recognisable (find_leftovers) and `collect`
cleans it, putting back an old checkpoint that a replace had moved aside.

The savers are real processes killed with SIGKILL. They are forked from a
server that has already imported torch (tests/helpers/kill_saver.py), so a
kill costs a fork rather than an interpreter start. Each saver writes version
1, 2, 3, ... of a ~320 MB state over one path and reports a version only after
save() has returned: a version reported done must never be lost.
"""

from __future__ import annotations

import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from support import Child, ForkServer

import fastpersist
from fastpersist import CheckpointNotFoundError
from fastpersist.engine import get_engine
from fastpersist.storage.commit import Leftover, collect, find_leftovers
from fastpersist.tensors import checkpoint, verifying

HELPER = Path(__file__).parent / "helpers" / "kill_saver.py"

# The big state: 8 float32 tensors of 10M elements (320 MB); tensor i of version v
# holds v + i * STEP everywhere (exact in float32 for the versions used here).
TENSORS, NUMEL, STEP = 8, 10_000_000, 1 / 16
# The small state of the hook tests: 2 tensors of 1 MiB.
SMALL_TENSORS, SMALL_NUMEL = 2, 1 << 18


class Saver(Child):
    """One forked saver process and what it has reported."""

    noun = "saver"

    @property
    def done(self) -> list[int]:
        return self.steps("done")

    @property
    def started(self) -> list[int]:
        return self.steps("start")


class Zygote(ForkServer[Saver]):
    """The fork server of the savers (tests/helpers/kill_saver.py)."""

    def __init__(self) -> None:
        super().__init__(HELPER, Saver)

    def start(self, target: Path, *, start: int = 1, count: int | None = None,
              small: bool = False, no_exchange: bool = False, hook: str | None = None,
              hook_from: int | None = None) -> Saver:
        return self.fork({
            "target": str(target), "start": start, "count": count, "step": STEP,
            "tensors": SMALL_TENSORS if small else TENSORS,
            "numel": SMALL_NUMEL if small else NUMEL,
            "no_exchange": no_exchange, "hook": hook, "hook_from": hook_from,
            # The savers use the default (native) engine and knobs, whatever the
            # environment of the test run says.
            "env": {"FASTPERSIST_ENGINE": "native", "FASTPERSIST_DIRECT": "auto"},
        })


@pytest.fixture(scope="module")
def zygote():
    z = Zygote()
    yield z
    z.close()


@dataclass
class Calibration:
    first_cycle_s: float  # a new saver's first iteration: fill the tensors, then save


@pytest.fixture(scope="module")
def calibration(zygote, tmp_path_factory) -> Calibration:
    """Time a new saver's first save of the big state, as the kill tests run it
    (the first save of a process is slower than the next: buffers, caches)."""
    d = tmp_path_factory.mktemp("calibrate")
    cycles = []
    for _ in range(3):
        saver = zygote.start(d / "ck", count=1)
        t_ready, _ = saver.wait_for("ready")
        t_done, _ = saver.wait_for("done")
        saver.kill()
        cycles.append(t_done - t_ready)
    shutil.rmtree(d)
    return Calibration(first_cycle_s=sorted(cycles)[1])


# --- checks ---------------------------------------------------------------------------


def check_state(obj: object, versions: range) -> int:
    """The version of a loaded state, after checking it is one complete version."""
    assert isinstance(obj, dict)
    v = obj["version"]
    assert v in versions, f"checkpoint holds version {v}, expected one of {list(versions)}"
    assert obj["meta"] == {"step": v * 10, "name": f"v{v}"}
    weights = obj["weights"]
    assert sorted(weights) == sorted(f"w{i}" for i in range(len(weights)))
    for i in range(len(weights)):
        t = weights[f"w{i}"]
        assert t.dtype == torch.float32 and t.dim() == 1
        assert bool((t == v + i * STEP).all()), f"w{i} of version {v} holds other values"
    return v


def assert_not_loadable(leftover: Leftover) -> None:
    """A leftover is never mistaken for a checkpoint, even with a complete manifest."""
    with pytest.raises(CheckpointNotFoundError):
        fastpersist.load(leftover.path)
    with pytest.raises(CheckpointNotFoundError):
        checkpoint.read_manifest(leftover.path)


def check_after_kill(target: Path, saver: Saver, floor: int) -> int | None:
    """What a killed save left behind, checked against the contract, then cleaned up.

    `floor` is the newest version ever reported saved to `target` (0: none).
    Returns the version the target holds after gc (None: no target).
    """
    parent = target.parent
    floor = max([floor, *saver.done])
    newest = max([floor, *saver.started])
    allowed = range(max(floor, 1), newest + 1)

    leftovers = find_leftovers(parent)
    known = {target, *(lo.path for lo in leftovers)}
    strays = [p.name for p in parent.iterdir() if p not in known]
    assert not strays, f"unrecognisable entries after the kill: {strays}"
    for lo in leftovers:
        assert lo.target_name == target.name, lo
        assert lo.pid == saver.pid, lo
        assert not lo.owner_alive, lo
        assert_not_loadable(lo)

    old = [lo for lo in leftovers if lo.kind == "old"]
    version: int | None = None
    if target.exists():
        version = check_state(fastpersist.load(target, verify=True), allowed)
        checkpoint.read_manifest(target)
        before = (target / "manifest.json").read_bytes(), target.stat().st_ino
    else:
        assert floor == 0 or old, (
            f"version {floor} was reported saved, but {target.name} is gone and no "
            f"moved-aside checkpoint exists: {[lo.path.name for lo in leftovers]}"
        )
        if old:
            with pytest.raises(CheckpointNotFoundError) as info:
                fastpersist.load(target)
            assert old[0].path.name in str(info.value)

    for lo in leftovers:
        collect(lo)
    remaining = sorted(p.name for p in parent.iterdir())
    if version is None and not old:
        assert remaining == [], remaining
        return None
    assert remaining == [target.name], remaining
    if version is None:
        # A replace was interrupted between its renames; gc put the old one back.
        return check_state(fastpersist.load(target, verify=True), allowed)
    # gc did not touch the target we loaded.
    checkpoint.read_manifest(target)
    assert ((target / "manifest.json").read_bytes(), target.stat().st_ino) == before
    return version


@dataclass
class Outcome:
    delay: float
    saves_done: int  # saves the killed saver completed
    leftovers: list[str]  # kinds of what the kill left behind
    version: int | None  # the target's version after gc


def kill_loop(zygote: Zygote, target: Path, delays: list[float], *, no_exchange: bool,
              fresh: bool) -> list[Outcome]:
    """Start a saver, SIGKILL it after each delay (from its first save), check, repeat.

    With fresh=False every saver writes over the same target, continuing the
    versions; with fresh=True each writes a new target (its first-ever save).
    """
    floor = 0
    next_version = 1
    outcomes: list[Outcome] = []
    delays = list(delays)
    k = 0
    while k < len(delays):
        delay = delays[k]
        t = target.parent.parent / f"{target.parent.name}-{k}" / target.name if fresh else target
        t.parent.mkdir(exist_ok=True)
        saver = zygote.start(t, start=next_version, no_exchange=no_exchange)
        saver.wait_for("ready")
        time.sleep(delay)
        saver.kill()
        kinds = [lo.kind for lo in find_leftovers(t.parent)]
        version = check_after_kill(t, saver, 0 if fresh else floor)
        outcomes.append(Outcome(delay, len(saver.done), kinds, version))
        if not fresh:
            floor = version or 0
            next_version = max([next_version, *saver.started]) + 1
        k += 1
        if k == len(delays) and not any(o.saves_done for o in outcomes) and k < 2 * len(delays):
            # A slow machine: the saves took longer than calibrated. Kill later
            # until one save completes, so the kills also hit a replace.
            delays.append(delays[-1] * 1.25)
    return outcomes


def spread(n: int, until: float) -> list[float]:
    return [until * k / (n - 1) for k in range(n)]


def assert_kills_landed(outcomes: list[Outcome]) -> None:
    """The delays did what they are for: some kills hit a save in progress, and some
    came after a save had completed (so they hit a replace)."""
    assert any("tmp" in o.leftovers for o in outcomes), f"no kill hit a save: {outcomes}"
    assert any(o.saves_done for o in outcomes), f"no save completed before a kill: {outcomes}"


# --- kills at moments spread over the save ----------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize(("no_exchange", "kills"), [(False, 12), (True, 10)],
                         ids=["exchange", "rename-aside"])
def test_kill_while_replacing(zygote, calibration, big_tmp, no_exchange, kills):
    """Saves over one path, killed at moments spread over 1.5 save cycles; with
    no_exchange, RENAME_EXCHANGE fails (EINVAL) and replace moves the old one aside."""
    delays = spread(kills, 1.5 * calibration.first_cycle_s)
    outcomes = kill_loop(zygote, big_tmp / "ckpts" / "ck", delays, no_exchange=no_exchange,
                         fresh=False)
    assert_kills_landed(outcomes)


@pytest.mark.slow
def test_kill_during_first_save(zygote, calibration, big_tmp):
    """A fresh path, killed during its first save: nothing or a complete checkpoint."""
    outcomes = kill_loop(zygote, big_tmp / "fresh" / "ck", spread(6, calibration.first_cycle_s),
                         no_exchange=False, fresh=True)
    assert outcomes[0].version is None  # killed as it started
    assert any("tmp" in o.leftovers for o in outcomes), outcomes


# --- kills at each step of the commit ------------------------------------------------

# (hook, rename-exchange available, what the target holds after the kill: the
# version before the killed save, the killed save's version, or nothing)
HOOKS = [
    ("before_manifest", True, "old"),
    ("before_publish", True, "old"),
    ("after_exchange", True, "new"),
    ("during_rmtree", True, "new"),
    ("before_manifest", False, "old"),
    ("before_publish", False, "old"),
    ("between_renames", False, "missing"),
    ("during_rmtree", False, "new"),
]


@pytest.mark.parametrize(("hook", "exchange", "after"), HOOKS,
                         ids=[f"{h}-{'exchange' if e else 'rename-aside'}" for h, e, _ in HOOKS])
def test_kill_at_each_commit_step(zygote, tmp_path, hook, exchange, after):
    target = tmp_path / "ckpts" / "ck"
    target.parent.mkdir()
    saver = zygote.start(target, small=True, no_exchange=not exchange, hook=hook, hook_from=2)
    saver.wait_for("done")
    saver.wait_for("hook", fail_on=("done",))
    saver.kill()
    assert saver.done == [1] and saver.started == [1, 2]

    leftovers = find_leftovers(target.parent)
    assert leftovers, "the killed save left nothing behind to recognise"
    for lo in leftovers:
        assert_not_loadable(lo)
    if after == "missing":
        assert not target.exists()
        old = [lo for lo in leftovers if lo.kind == "old"]
        assert len(old) == 1
        with pytest.raises(CheckpointNotFoundError, match=old[0].path.name):
            fastpersist.load(target)
        with pytest.raises(CheckpointNotFoundError, match=old[0].path.name):
            checkpoint.read_manifest(target)
    else:
        want = 1 if after == "old" else 2
        assert check_state(fastpersist.load(target), range(want, want + 1)) == want

    version = check_after_kill(target, saver, 1)
    assert version == (2 if after == "new" else 1)


def test_staging_directory_with_complete_manifest_is_not_loadable(zygote, tmp_path):
    """Killed after the manifest is durable but before the rename: the staging
    directory is a complete checkpoint in all but name, and must stay unloadable."""
    target = tmp_path / "ckpts" / "ck"
    target.parent.mkdir()
    saver = zygote.start(target, small=True, hook="before_publish", hook_from=1)
    saver.wait_for("hook", fail_on=("done",))
    saver.kill()
    assert not target.exists()
    (lo,) = find_leftovers(target.parent)
    assert lo.kind == "tmp" and (lo.path / "manifest.json").is_file()
    with pytest.raises(CheckpointNotFoundError, match="staging directory"):
        fastpersist.load(lo.path)
    with pytest.raises(CheckpointNotFoundError):
        fastpersist.load(lo.path, verify=False)
    with pytest.raises(CheckpointNotFoundError):
        checkpoint.read_manifest(lo.path)
    with pytest.raises(CheckpointNotFoundError):
        verifying.verify(lo.path, get_engine())
    with pytest.raises(CheckpointNotFoundError, match="does not exist"):
        fastpersist.load(target)
    # A relative path and a trailing slash name the same directory.
    with pytest.raises(CheckpointNotFoundError):
        fastpersist.load(os.path.relpath(lo.path) + "/")
    assert check_after_kill(target, saver, 0) is None


def test_live_save_leftover_is_not_collected(zygote, tmp_path):
    """gc must not touch the staging directory of a save that is still running."""
    target = tmp_path / "ckpts" / "ck"
    target.parent.mkdir()
    saver = zygote.start(target, small=True, hook="before_publish", hook_from=1)
    saver.wait_for("hook", fail_on=("done",))
    try:
        (lo,) = find_leftovers(target.parent)
        assert lo.owner_alive
    finally:
        saver.kill()
    (lo,) = find_leftovers(target.parent)
    assert not lo.owner_alive
    collect(lo)
    assert list(target.parent.iterdir()) == []
