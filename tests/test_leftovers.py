"""Every temporary fastpersist creates is a recognisable leftover that gc removes.

Each case runs the real operation in a child process and SIGKILLs it at the
moment its temporary exists (a patched function kills the process from
inside). Afterwards `fpctl ls` shows what was left, `fpctl gc ROOT` removes it
(from anywhere under ROOT) and nothing unrecognisable remains: only committed
checkpoints and the `latest` pointer. A new kind of temporary that does not use
commit.leftover_name fails the last check.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import fastpersist
from fastpersist.cli import main
from fastpersist.format.manifest import MANIFEST_NAME
from fastpersist.storage.commit import leftover_name, walk_leftovers

KILL = "os.kill(os.getpid(), signal.SIGKILL)"

# name -> (setup run first in the child, the killed operation)
CASES: dict[str, tuple[str, str]] = {
    "staging directory of a save": ("", f"""
        real = datafile.write
        def write(*a, **k):
            real(*a, **k)
            {KILL}
        datafile.write = write
        fastpersist.save(state(2), RUN / "step-2")
    """),
    "the latest pointer's temporary file": ("", f"""
        real = os.replace
        def replace(src, dst, *a, **k):
            if Path(dst).name == "latest":
                {KILL}
            real(src, dst, *a, **k)
        os.replace = replace
        with fastpersist.Checkpointer(RUN) as ck:
            ck.save(2, state(2)).result()
    """),
    "a checkpoint being deleted by retention": ("", f"""
        from fastpersist.storage import dirs
        real = dirs.remove_tree
        def remove_tree(name, *a, **k):
            if ".fp-del-" in str(name):
                {KILL}
            real(name, *a, **k)
        dirs.remove_tree = remove_tree
        with fastpersist.Checkpointer(RUN, keep_last=1) as ck:
            ck.save(2, state(2)).result()
    """),
    "fpctl restore's temporary file": ("", f"""
        real = os.replace
        def replace(src, dst, *a, **k):
            {KILL}
        os.replace = replace
        from fastpersist.cli import main
        main(["restore", str(RUN / "step-00000001"), "--to", str(RUN / "out.pt")])
    """),
    "fastpersistd's O_DIRECT probe file": ("", f"""
        from fastpersist.daemon.rootfs import Root
        real = os.open
        def open_(path, flags, *a, **k):
            if flags & getattr(os, "O_DIRECT", 0):
                {KILL}
            return real(path, flags, *a, **k)
        os.open = open_
        Root(RUN).probe_direct_io()
    """),
}

PRELUDE = """
import os, shutil, signal, sys
from pathlib import Path
import torch
import fastpersist
from fastpersist.storage import commit
from fastpersist.tensors import datafile
RUN = Path(sys.argv[1])
def state(step):
    return {"step": step, "w": torch.full((1000,), float(step))}
"""


def _run_killed(run: Path, body: str) -> None:
    code = PRELUDE + textwrap.dedent(body)
    proc = subprocess.run([sys.executable, "-c", code, str(run)], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, (
        f"the child was not killed at the planted moment (rc {proc.returncode}):\n"
        f"{proc.stderr}")


def _everything_under(root: Path) -> list[str]:
    """Every path under root, relative, not looking inside checkpoints."""
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        rel = Path(dirpath).relative_to(root)
        if MANIFEST_NAME in filenames:
            dirnames[:] = []
            continue
        out += [str(rel / n) for n in dirnames + filenames]
    return sorted(out)


@pytest.mark.parametrize("case", list(CASES))
def test_a_killed_operation_leaves_only_what_gc_removes(
        case: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = tmp_path / "root"
    run = root / "runs" / "run1"  # nested: gc ROOT must look below the top level
    with fastpersist.Checkpointer(run) as ck:
        ck.save(1, {"step": 1, "w": torch.full((1000,), 1.0)}).result()
    before = _everything_under(root)
    _, body = CASES[case]
    _run_killed(run, body)

    leftovers = walk_leftovers(root)
    assert leftovers, f"{case}: the kill left no recognisable leftover"
    assert all(not lo.owner_alive for lo in leftovers)
    rc = main(["ls", str(run), "--json"])
    listed = {e["name"] for e in json.loads(capsys.readouterr().out)}
    assert rc == 0 and {lo.path.name for lo in leftovers} <= listed

    rc = main(["gc", str(root), "--json"])
    actions = json.loads(capsys.readouterr().out)
    assert rc == 0 and {a["action"] for a in actions} == {"removed"}, actions
    assert walk_leftovers(root) == []
    # Nothing else is left: what was there before, and at most what the killed
    # operation committed (a checkpoint, the pointer).
    after = _everything_under(root)
    new = sorted(set(after) - set(before))
    for rel in new:
        p = root / rel
        assert p.name == "latest" or (p / MANIFEST_NAME).is_file(), (
            f"{case}: {rel} is neither a checkpoint nor a known leftover")
    if "retention" not in case:  # (retention was deleting it, and gc finished that)
        assert (run / "step-00000001" / MANIFEST_NAME).is_file()


def test_a_live_owners_temporary_file_is_left_alone(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    tmp = tmp_path / leftover_name("latest", "tmp")  # ours: this process is alive
    tmp.write_text("step-00000001\n")
    rc = main(["gc", str(tmp_path), "--json"])
    (action,) = json.loads(capsys.readouterr().out)
    assert rc == 0 and action["action"] == "skipped" and tmp.exists()


def test_a_symlink_with_a_leftover_name_is_not_a_leftover(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_text("keep")
    link = tmp_path / "d" / leftover_name("x", "tmp")
    link.parent.mkdir()
    link.symlink_to(victim)
    assert walk_leftovers(tmp_path) == []


def test_a_starting_daemon_removes_dead_processes_temporary_files(tmp_path: Path) -> None:
    """The daemon's startup cleanup knows the same leftovers as gc, files too
    (its own pointer updates and probes, a killed trainer's), anywhere under
    its root; a live process's, and files of other names, stay."""
    from daemon_support import Daemon

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    dead_pid = int(dead.stdout)
    root = tmp_path / "root"
    run = root / "runs" / "run1"
    run.mkdir(parents=True)
    gone = run / leftover_name("latest", "tmp").replace(f"-{os.getpid()}-", f"-{dead_pid}-")
    gone.write_text("step-00000001\n")
    alive = run / leftover_name("latest", "tmp")  # this process's
    alive.write_text("step-00000002\n")
    other = run / "notes.txt"
    other.write_text("mine")
    d = Daemon(tmp_path, root=root).start()
    try:
        assert not gone.exists()
        assert alive.exists() and other.exists()
        assert any(gone.name in e["action"] for e in d.events("cleanup"))
    finally:
        d.cleanup()


def test_a_daemon_killed_as_it_moves_latest_leaves_only_what_gc_removes(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Through a daemon, the Checkpointer's pointer is the daemon's temporary:
    the same leftover pattern, collected by the restarted daemon."""
    from daemon_support import Daemon, is_lock_file

    kill_at_the_pointer = textwrap.dedent(f"""
        import os, signal
        real = os.replace
        def replace(src, dst, *a, **k):
            if str(dst) == "latest":
                {KILL}
            return real(src, dst, *a, **k)
        os.replace = replace
    """)
    d = Daemon(tmp_path, prelude=kill_at_the_pointer).start()
    monkeypatch.setenv("FASTPERSIST_SHM_DIR", str(d.shm_dir))
    run = d.root / "runs" / "run1"
    try:
        ck = fastpersist.Checkpointer(run, keep_last=1, daemon=d.address)
        # Commit is answered while the daemon's writer commits: the writer's
        # kill at `latest` may beat the reply (then save(), which waits for the
        # hand-over, reports it) or not (then the future does).
        with pytest.raises(fastpersist.CheckpointError):
            ck.save(1, {"step": 1, "w": torch.full((1000,), 1.0)}).result()
        with contextlib.suppress(fastpersist.CheckpointError):
            ck.close()
        assert d.proc is not None and d.proc.wait(30) == -signal.SIGKILL
        (leftover,) = walk_leftovers(d.root)
        assert leftover.target_name == "latest" and not leftover.is_dir
        assert not leftover.owner_alive and leftover.pid == d.proc.pid
        assert (run / "step-00000001" / MANIFEST_NAME).is_file()  # committed before
        d.start()
        assert walk_leftovers(d.root) == []
        assert [p for p in _everything_under(d.root) if not is_lock_file(p)] == [
            "runs", "runs/run1", "runs/run1/step-00000001"]
    finally:
        d.cleanup()
