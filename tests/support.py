"""Helpers shared by several test modules (imported as `support`: pytest puts tests/
on sys.path, there being no tests/__init__.py).

WriteLog and inject_enospc patch fastpersist's writer; ForkServer is the test's
side of the fork servers in tests/helpers (see forkserver.py there).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Generic, TypeVar

import pytest

import fastpersist
from fastpersist.saving import persist
from fastpersist.tensors import datafile

# --- patches of the writer -----------------------------------------------------------------


class WriteLog:
    """Wraps CheckpointWriter.begin/write_file to log the order of events and to
    hold one data-file write (counted from 0 over all saves) until `released` is set."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, hold: int | None = None) -> None:
        self.events: list[tuple[str, str]] = []
        self.writes = 0
        self.hold = hold
        self.held = threading.Event()  # the held write has started
        self.released = threading.Event()
        real_write = persist.CheckpointWriter.write_file
        real_begin = persist.CheckpointWriter.begin.__func__  # type: ignore[attr-defined]

        def write_file(writer: persist.CheckpointWriter, tensors: Any) -> None:
            n = self.writes
            self.writes += 1
            self.events.append(("write", writer.target.name))
            if n == self.hold:
                self.held.set()
                assert self.released.wait(60), "the held write was never released"
            real_write(writer, tensors)

        def begin(cls: type, target: Path, tree: Any, stored: Any,
                  compression: str | None = None) -> persist.CheckpointWriter:
            self.events.append(("begin", target.name))
            return real_begin(cls, target, tree, stored, compression)

        monkeypatch.setattr(persist.CheckpointWriter, "write_file", write_file)
        monkeypatch.setattr(persist.CheckpointWriter, "begin", classmethod(begin))

    def watch(self, future: fastpersist.SaveFuture) -> fastpersist.SaveFuture:
        future.add_done_callback(lambda f: self.events.append(("done", f.path.name)))
        return future

    def release_after(self, seconds: float) -> threading.Timer:
        timer = threading.Timer(seconds, self.released.set)
        timer.start()
        return timer


def zeros_like_state(obj: Any) -> Any:
    """The state's containers and plain values with a new zero tensor for each
    tensor (ties untied): an `into=` for load."""
    import torch

    if isinstance(obj, torch.Tensor):
        return torch.zeros_like(obj.detach())
    if isinstance(obj, dict):
        return {k: zeros_like_state(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(zeros_like_state(v) for v in obj)
    return obj


def assert_same_state(a: Any, b: Any) -> None:
    """Two states are equal: the same containers, plain values, and tensors of
    the same dtype and values."""
    import torch

    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            assert_same_state(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            assert_same_state(x, y)
    else:
        assert a == b


def assert_loaded_into(expected: Any, loaded: Any, into: Any) -> None:
    """Wherever `into` has a tensor, `loaded` (a load with into=) holds that
    object, with the values `expected` (a load without it) has there."""
    import torch

    if isinstance(into, torch.Tensor):
        assert loaded is into
        assert torch.equal(into, expected.to(into.device, into.dtype))
    elif isinstance(into, dict):
        for k in into:
            assert_loaded_into(expected[k], loaded[k], into[k])
    elif isinstance(into, (list, tuple)):
        for e, lo, i in zip(expected, loaded, into, strict=True):
            assert_loaded_into(e, lo, i)


def flip_bit(path: Path, offset: int, bit: int = 0) -> None:
    """Corrupt one bit of a file in place, durably (as a failing disk would)."""
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ (1 << bit)]))
        os.fsync(f.fileno())


def inject_enospc(monkeypatch: pytest.MonkeyPatch, target_name: str,
                  gate: threading.Event | None = None) -> None:
    """Data-file writes of checkpoint `target_name` fail with ENOSPC after writing
    a few bytes (after `gate` is set, if given), as on a full disk."""
    real = datafile.write

    def write(engine: Any, directory: str, file_name: str, tensors: Any) -> Any:
        if f".{target_name}.fp-tmp-" in directory:
            with open(os.path.join(directory, file_name), "wb") as f:
                f.write(b"partial")
            if gate is not None:
                assert gate.wait(60)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC),
                          os.path.join(directory, file_name))
        return real(engine, directory, file_name, tensors)

    monkeypatch.setattr(datafile, "write", write)


# --- the client of a fork server (tests/helpers/forkserver.py) -----------------------------

EVENT_TIMEOUT = 120.0


@dataclass
class Child:
    """One process forked by a ForkServer and what it has reported."""

    noun: ClassVar[str] = "child"  # what the messages call it

    server: ForkServer[Any]
    pid: int
    events: list[tuple[float, list[str]]] = field(default_factory=list)
    exit_status: int | None = None
    cursor: int = 0  # events before this one have been waited for

    def steps(self, kind: str) -> list[int]:
        """The first argument, as an int, of each event of this kind."""
        return [int(a[1]) for _, a in self.events if a[0] == kind]

    def wait_for(self, kind: str, arg: str | None = None, *, timeout: float = EVENT_TIMEOUT,
                 fail_on: tuple[str, ...] = ()) -> tuple[float, list[str]]:
        """The next event of this kind (with this first argument, if given); fails on
        an error or exit of the child, or on an event of a kind in fail_on."""
        deadline = time.monotonic() + timeout
        while True:
            while self.cursor < len(self.events):
                when, args = self.events[self.cursor]
                self.cursor += 1
                if args[0] == kind and (arg is None or args[1] == arg):
                    return when, args
                if args[0] in ("error", "exited", *fail_on):
                    pytest.fail(f"{self.noun} {self.pid} stopped while waiting for {kind!r}: "
                                f"{args}")
            self.server.next_event(self, deadline)

    def wait_exit(self) -> int:
        """The exit status, after checking the child reported no error."""
        deadline = time.monotonic() + EVENT_TIMEOUT
        while self.exit_status is None:
            self.server.next_event(self, deadline)
        errors = [a for _, a in self.events if a[0] == "error"]
        assert not errors, f"{self.noun} {self.pid} failed: {json.loads(errors[0][1])}"
        return self.exit_status

    def kill(self) -> None:
        """SIGKILL the child and collect everything it reported before dying."""
        self.server.drain(self)
        if self.exit_status is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)
        self.wait_exit()


C = TypeVar("C", bound=Child)


class ForkServer(Generic[C]):
    """A fork server process (a script in tests/helpers) and the reader of its event
    stream; fork() has it fork a child of type `child_type` for one job."""

    def __init__(self, helper: Path, child_type: type[C]) -> None:
        self.child_type = child_type
        self.proc = subprocess.Popen(
            [sys.executable, str(helper)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        )
        self.lines: queue.Queue[tuple[float, bytes]] = queue.Queue()
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()
        self.current: C | None = None
        _, fields = self._next(time.monotonic() + EVENT_TIMEOUT)
        assert fields[1:] == ["zygote-ready"], fields

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put((time.monotonic(), line))
        self.lines.put((time.monotonic(), b""))

    def _next(self, deadline: float, block: bool = True) -> tuple[float, list[str]]:
        try:
            if block:
                when, line = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            else:
                when, line = self.lines.get_nowait()
        except queue.Empty:
            if block:
                pytest.fail(f"timed out waiting for the {self.child_type.noun}")
            raise
        if not line:
            pytest.fail(f"the fork server exited (status {self.proc.poll()})")
        return when, line.decode().split()

    def next_event(self, child: Child, deadline: float, block: bool = True
                   ) -> tuple[float, list[str]]:
        """Read the next event, which must be the running child's, into child.events."""
        when, fields = self._next(deadline, block)
        pid, args = int(fields[0]), fields[1:]
        if args[0] == "exited":
            assert int(args[1]) == child.pid, fields
            child.exit_status = int(args[2])
        else:
            assert pid == child.pid, f"event from {pid} while {child.pid} runs: {fields}"
        child.events.append((when, args))
        return when, args

    def drain(self, child: Child) -> None:
        """Read the events that have arrived, without waiting for more."""
        while True:
            try:
                self.next_event(child, 0.0, block=False)
            except queue.Empty:
                return

    def fork(self, job: dict[str, Any]) -> C:
        """Have the server fork a child for the job (one child runs at a time)."""
        if self.current is not None and self.current.exit_status is None:
            self.current.kill()  # left running by a failed test
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(job).encode() + b"\n")
        self.proc.stdin.flush()
        # The child may report before the server reports forking it.
        early = []
        deadline = time.monotonic() + EVENT_TIMEOUT
        while True:
            when, fields = self._next(deadline)
            if fields[1] == "forked":
                break
            early.append((int(fields[0]), (when, fields[1:])))
        child = self.child_type(self, int(fields[2]))
        assert all(pid == child.pid for pid, _ in early), early
        child.events += [event for _, event in early]
        self.current = child
        return child

    def close(self) -> None:
        if self.current is not None and self.current.exit_status is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.current.pid, signal.SIGKILL)
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


# --- mounts (root only; the tests that need one skip without) -----------------------------


def _sh(*cmd: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=False)


@dataclass
class Mounter:
    mounted: list[Path]

    def _need(self, *tools: str) -> None:
        if os.geteuid() != 0:
            pytest.skip("mounting a filesystem needs root")
        for tool in tools:
            if shutil.which(tool) is None:
                pytest.skip(f"{tool} is not installed")

    def _mount(self, what: str, *cmd: str) -> None:
        r = _sh(*cmd)
        if r.returncode != 0:
            why = (r.stderr.strip().splitlines() or [f"exit status {r.returncode}"])[0]
            pytest.skip(f"cannot mount {what}: {why}")
        self.mounted.append(Path(cmd[-1]))

    def tmpfs(self, d: Path, size: str) -> Path:
        self._need("mount", "umount")
        d.mkdir(parents=True, exist_ok=True)
        self._mount("a tmpfs", "mount", "-t", "tmpfs", "-o", f"size={size},mode=0755", "tmpfs",
                    str(d))
        return d

    def ext4(self, d: Path, image: Path, mib: int) -> Path:
        self._need("mount", "umount", "mkfs.ext4")
        d.mkdir(parents=True, exist_ok=True)
        with open(image, "wb") as f:
            f.truncate(mib << 20)
        # -m 0: no blocks reserved for root, so root sees the same free space as df.
        r = _sh("mkfs.ext4", "-q", "-F", "-m", "0", str(image))
        if r.returncode != 0:
            pytest.skip(f"mkfs.ext4 failed: {r.stderr.strip()}")
        self._mount("a loop ext4 image", "mount", "-o", "loop", str(image), str(d))
        return d

    def bind_ro(self, src: Path, d: Path) -> Path:
        self._need("mount", "umount")
        d.mkdir(parents=True, exist_ok=True)
        self._mount("a bind mount", "mount", "--bind", str(src), str(d))
        self.remount_ro(d, bind=True)
        return d

    def remount_ro(self, d: Path, *, bind: bool = False) -> None:
        r = _sh("mount", "-o", "remount,bind,ro" if bind else "remount,ro", str(d))
        if r.returncode != 0:
            pytest.skip(f"cannot remount {d} read-only: {r.stderr.strip()}")
        try:
            (d / ".probe").mkdir()
        except OSError:
            return
        pytest.skip(f"{d} is still writable after a read-only remount")

    def unmount_all(self) -> None:
        for d in reversed(self.mounted):
            if _sh("umount", str(d)).returncode != 0:
                _sh("umount", "-l", str(d))
        self.mounted.clear()


def kill_at_hooks(commands: dict[str, list[str]], env: dict[str, str] | None = None) -> None:
    """Run each command (a Python script and its arguments; key: the hook it
    stops at, as tests/helpers/dcp_kill_saver.py does), all at once; SIGKILL
    each as soon as it prints "hook HOOK", failing if it prints anything else
    at its end."""
    children = {hook: subprocess.Popen([sys.executable, *cmd], stdout=subprocess.PIPE,
                                       stderr=subprocess.STDOUT, text=True, env=env)
                for hook, cmd in commands.items()}
    for hook, child in children.items():
        assert child.stdout is not None
        lines = []
        for line in child.stdout:
            lines.append(line)
            if line.startswith("hook "):
                break
        assert lines and lines[-1] == f"hook {hook}\n", lines
        os.kill(child.pid, signal.SIGKILL)
        child.wait(30)


def in_process_saver(max_in_flight: int | None = None) -> Any:
    """A save pipeline of its own to local files (what a Checkpointer has)."""
    from fastpersist.saving.local import LocalSink
    from fastpersist.saving.pipeline import SavePipeline

    return SavePipeline(LocalSink(), max_in_flight)


def daemon_saver(address: str, max_in_flight: int | None = None) -> Any:
    """A save pipeline of its own through fastpersistd at `address`."""
    from fastpersist.saving.pipeline import SavePipeline
    from fastpersist.saving.remote import DaemonSink

    return SavePipeline(DaemonSink(address), max_in_flight)
