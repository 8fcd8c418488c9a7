"""What a client reports, and which buffers it reuses, when a reply from fastpersistd
is lost (the rule in staging.py: a buffer goes back to its pool only when every
reader and writer of it is known to be done; otherwise it is quarantined).

The daemons are real processes whose writes wait for the test to open a gate
(tests/helpers/gated_daemon.py): the daemon reads a segment only when the test
says so, e.g. after the client started its next save. The faults are injected on
the client side: a Watch stream that breaks after Commit, a Commit whose reply is
lost, a daemon that cannot be asked for the outcome, a device copy that lands late.
Each test then checks that what is on disk is exactly what was saved, and that
what the first save reported matches what is on disk.
"""

from __future__ import annotations

import importlib
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest
import torch
from daemon_support import Daemon
from support import daemon_saver

import fastpersist
from fastpersist.errors import CheckpointError, DaemonError, DaemonUnavailableError
from fastpersist.protocol.client import DaemonClient
from fastpersist.saving import pipeline, remote
from fastpersist.saving.remote import DaemonJob

T = TypeVar("T")


@pytest.fixture
def gated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Daemon]:
    """A real fastpersistd that writes nothing until daemon.open_gate()."""
    d = Daemon(tmp_path, gate=tmp_path / "gate").start()
    monkeypatch.setenv("FASTPERSIST_SHM_DIR", str(d.shm_dir))
    try:
        yield d
    finally:
        d.cleanup()


def wait_until(what: str, fn: Callable[[], T], timeout: float = 60.0) -> T:
    deadline = time.monotonic() + timeout
    while True:
        value = fn()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.01)


def state(value: float, n: int = 4096) -> dict[str, torch.Tensor]:
    return {"x": torch.full((n,), value)}


def outcome(future: Any) -> BaseException | None:
    return future.exception(timeout=120)  # type: ignore[no-any-return]


class Spies:
    """Marks the client's moments a test waits for: a save's writer job ended,
    and the client asked the daemon for a checkpoint's outcome (Wait)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.jobs_done = 0
        self.asked = threading.Event()
        self.segments: list[str] = []
        persist, wait, submit = (DaemonJob.write, DaemonClient.wait, DaemonClient.submit_shm)

        def persist_spy(job: DaemonJob, *a: Any, **k: Any) -> None:
            try:
                persist(job, *a, **k)
            finally:
                self.jobs_done += 1

        def wait_spy(client: DaemonClient, *a: Any, **k: Any) -> Any:
            self.asked.set()
            return wait(client, *a, **k)

        def submit_spy(client: DaemonClient, ident: str, index: int, header: bytes,
                       segment: str, *a: Any, **k: Any) -> None:
            self.segments.append(segment)
            submit(client, ident, index, header, segment, *a, **k)

        monkeypatch.setattr(DaemonJob, "write", persist_spy)
        monkeypatch.setattr(DaemonClient, "wait", wait_spy)
        monkeypatch.setattr(DaemonClient, "submit_shm", submit_spy)

    def first_job_settled_or_asking(self) -> None:
        """Until the first save's writer let go of it (the code before the fix
        did so at once, returning its segments) or is asking the daemon about it."""
        wait_until("the first save to end or to ask for its outcome",
                   lambda: self.jobs_done >= 1 or self.asked.is_set())


def progress_class() -> Any:
    """The Watch follower (handover.Progress; remote.Progress before the fix,
    so that this file shows the defects on that code too)."""
    try:
        return importlib.import_module("fastpersist.saving.handover").Progress
    except ImportError:
        return remote.Progress  # type: ignore[attr-defined]


def break_watch_after_commit(monkeypatch: pytest.MonkeyPatch) -> None:
    """The first save's progress stream breaks once the daemon has its Commit."""
    progress = progress_class()
    wait = progress.wait
    broken: list[bool] = []

    def broken_wait(progress: Any, files_written: int | None = None) -> Any:
        if files_written is None and not broken:
            broken.append(True)
            raise DaemonUnavailableError("injected: the progress stream broke", "UNAVAILABLE")
        return wait(progress, files_written)

    monkeypatch.setattr(progress, "wait", broken_wait)


def lose_commit_reply(monkeypatch: pytest.MonkeyPatch) -> None:
    """The first Commit reaches the daemon; its reply does not reach the client."""
    commit = DaemonClient.commit
    lost: list[bool] = []

    def commit_reply_lost(client: DaemonClient, *a: Any, **k: Any) -> None:
        commit(client, *a, **k)
        if not lost:
            lost.append(True)
            raise DaemonUnavailableError("injected: the Commit reply was lost",
                                         "DEADLINE_EXCEEDED")

    monkeypatch.setattr(DaemonClient, "commit", commit_reply_lost)


def save_twice(d: Daemon, saver: Any, spies: Spies
               ) -> tuple[BaseException | None, BaseException | None]:
    """Save 1.0 to ck1 (a fault injected), then 2.0 to ck2 while the daemon has
    not read ck1's segments yet; then let the daemon write. The outcomes of both."""
    first: Any = None
    try:
        first = saver.save(state(1.0), d.root / "ck1")
    except CheckpointError as exc:  # the hand-over itself may report the fault
        first_error: BaseException | None = exc
    spies.first_job_settled_or_asking()
    # Copied into staging when this returns; the daemon has read nothing yet.
    second = saver.save(state(2.0), d.root / "ck2", wait_for_snapshot=False)
    d.open_gate()
    if first is not None:
        first_error = outcome(first)
    return first_error, outcome(second)


def settled(d: Daemon) -> bool:
    """Nothing in flight in the daemon: whatever it will commit, it has."""
    client = d.client()
    try:
        return client.info().checkpoints_in_flight == 0
    finally:
        client.close()


def check_disk_matches(d: Daemon, first_error: BaseException | None) -> None:
    wait_until("the daemon to finish what it was handed", lambda: settled(d))
    loaded = fastpersist.load(d.root / "ck2")
    assert torch.equal(loaded["x"], state(2.0)["x"])
    if (d.root / "ck1").exists():
        got = fastpersist.load(d.root / "ck1")["x"]
        assert torch.equal(got, state(1.0)["x"]), (
            f"ck1 holds {got.unique().tolist()} where 1.0 was saved: its segment was reused")
    assert first_error is None, (
        f"the first save reported {first_error!r} but the daemon committed it")


def test_a_broken_watch_after_commit_reuses_no_segment_and_reports_the_commit(
        gated: Daemon, monkeypatch: pytest.MonkeyPatch) -> None:
    spies = Spies(monkeypatch)
    break_watch_after_commit(monkeypatch)
    saver = daemon_saver(gated.address, max_in_flight=2)
    try:
        first_error, second_error = save_twice(gated, saver, spies)
        assert second_error is None
        check_disk_matches(gated, first_error)
    finally:
        saver.close()


def test_a_lost_commit_reply_reuses_no_segment_and_reports_the_commit(
        gated: Daemon, monkeypatch: pytest.MonkeyPatch) -> None:
    spies = Spies(monkeypatch)
    lose_commit_reply(monkeypatch)
    saver = daemon_saver(gated.address, max_in_flight=2)
    try:
        first_error, second_error = save_twice(gated, saver, spies)
        assert second_error is None
        check_disk_matches(gated, first_error)
    finally:
        saver.close()


def test_an_outcome_nobody_can_tell_quarantines_the_segments(
        gated: Daemon, monkeypatch: pytest.MonkeyPatch) -> None:
    """The daemon cannot be asked: the save raises DaemonMayStillCommitError, its
    segment is never reused (the client unlinks it; the daemon's mapping keeps the
    pages), and the daemon does commit it later, with the first save's values."""
    from fastpersist.errors import DaemonMayStillCommitError

    spies = Spies(monkeypatch)
    break_watch_after_commit(monkeypatch)
    monkeypatch.setattr("fastpersist.protocol.client.OUTCOME_PATIENCE", 1.0, raising=False)

    def unreachable(client: DaemonClient, *a: Any, **k: Any) -> Any:
        spies.asked.set()
        raise DaemonUnavailableError("injected: fastpersistd does not answer", "UNAVAILABLE")

    monkeypatch.setattr(DaemonClient, "wait", unreachable)
    saver = daemon_saver(gated.address, max_in_flight=2)
    try:
        first = saver.save(state(1.0), gated.root / "ck1")
        error = outcome(first)
        assert isinstance(error, DaemonMayStillCommitError), repr(error)
        assert "may still commit" in str(error)
        [segment] = spies.segments
        assert not (gated.shm_dir / segment).exists(), "the segment was not quarantined"
        second = saver.save(state(2.0), gated.root / "ck2", wait_for_snapshot=False)
        gated.open_gate()
        assert outcome(second) is None
        assert segment not in spies.segments[1:]
        # Only the second save's segment is the client's now.
        assert saver.staging_bytes == 4096 * 4
        wait_until("the daemon to commit ck1",
                   lambda: gated.events("committed") and (gated.root / "ck1").exists()
                   and len(gated.events("committed")) == 2)
        assert torch.equal(fastpersist.load(gated.root / "ck1")["x"], state(1.0)["x"])
        assert torch.equal(fastpersist.load(gated.root / "ck2")["x"], state(2.0)["x"])
    finally:
        saver.close()


class LateCopy:
    """A device-to-host copy into a staging buffer that is still in flight: it
    lands (writes its bytes) when the test says so, whoever waits for it."""

    def __init__(self, view: torch.Tensor) -> None:
        self.view = view
        self.waited = threading.Event()
        self._landed = threading.Event()

    def land(self) -> None:
        self.view.fill_(1.0)  # the first save's values, late
        self._landed.set()

    def synchronize(self) -> None:
        self.waited.set()
        self._landed.wait()


def test_a_buffer_with_a_copy_in_flight_is_not_reused_after_a_failure(
        gated: Daemon, monkeypatch: pytest.MonkeyPatch) -> None:
    """Defect 8: the first save fails at its first file while the device copy
    into its second file's buffer is still running. That buffer must not be
    handed to the next save until the copy has landed."""
    monkeypatch.setenv("FASTPERSIST_FILE_BYTES", str(64 << 10))
    copies: list[LateCopy] = []
    stage_file = pipeline.stage_file

    def stage_with_late_copy(tensors: Any, buffer: torch.Tensor, pinned: bool) -> Any:
        staged = stage_file(tensors, buffer, pinned)
        if not copies and staged.tensors[0].name == "b":  # the first save's second file
            copies.append(LateCopy(staged.tensors[0].source))
            staged.events.append(copies[0])
        return staged

    submit = DaemonClient.submit_shm
    refused: list[bool] = []

    def refuse_first(client: DaemonClient, *a: Any, **k: Any) -> None:
        if not refused:
            refused.append(True)
            raise DaemonError("injected: data file 0 refused", "INVALID_ARGUMENT")
        submit(client, *a, **k)

    monkeypatch.setattr(pipeline, "stage_file", stage_with_late_copy)
    monkeypatch.setattr(DaemonClient, "submit_shm", refuse_first)
    saver = daemon_saver(gated.address, max_in_flight=2)

    def two_files(value: float) -> dict[str, torch.Tensor]:
        return {"a": torch.full((16384,), value), "b": torch.full((16384,), value)}

    try:
        first = saver.save(two_files(1.0), gated.root / "ck1", wait_for_snapshot=False)
        [late] = copies
        wait_until("the first save to fail or to wait for its copy",
                   lambda: first.done() or late.waited.is_set())
        if first.done():  # looked at, so that the next save does not raise it
            assert isinstance(first.exception(), DaemonError)
        second = saver.save(two_files(2.0), gated.root / "ck2", wait_for_snapshot=False)
        late.land()
        gated.open_gate()
        assert isinstance(outcome(first), DaemonError)
        assert outcome(second) is None
        loaded = fastpersist.load(gated.root / "ck2")
        for name in ("a", "b"):
            assert torch.equal(loaded[name], two_files(2.0)[name]), (
                f"ck2's {name} holds {loaded[name].unique().tolist()}: a late copy "
                "landed in a buffer the second save was using")
        assert not (gated.root / "ck1").exists()
    finally:
        saver.close()


def test_a_commit_that_never_arrived_is_sent_again(gated: Daemon,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Commit fails before it reaches the daemon: the client cannot tell that
    from a lost reply, sends it again, and the daemon commits the checkpoint."""
    commit = DaemonClient.commit
    calls: list[bool] = []

    def lost_on_the_way(client: DaemonClient, *a: Any, **k: Any) -> None:
        calls.append(True)
        if len(calls) == 1:
            raise DaemonUnavailableError("injected: Commit did not arrive", "UNAVAILABLE")
        commit(client, *a, **k)

    monkeypatch.setattr(DaemonClient, "commit", lost_on_the_way)
    gated.open_gate()
    saver = daemon_saver(gated.address)
    try:
        assert outcome(saver.save(state(1.0), gated.root / "ck1")) is None
        assert len(calls) == 2
        assert torch.equal(fastpersist.load(gated.root / "ck1")["x"], state(1.0)["x"])
        assert len(gated.events("committed")) == 1
    finally:
        saver.close()
