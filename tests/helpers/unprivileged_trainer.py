"""A trainer that runs as another uid, for tests/test_daemon_ownership.py.

    python unprivileged_trainer.py JOB_JSON      (started as root)

It takes the uid, gid and supplementary groups of the job (numeric ids need no
/etc/passwd entry), then runs a Checkpointer through the daemon at `address`
and prints one JSON line with what it saw. Where the interpreter's files are
readable by that uid it drops privileges before importing anything; where they
are not (a Python under /root, 0700), it imports what it needs first, still as
root, and drops privileges before it touches anything of fastpersist's: every
checkpoint, socket and segment operation runs as the unprivileged uid either way.
"""

from __future__ import annotations

import json
import os
import sys

JOB = json.loads(sys.argv[1])


def drop_privileges() -> None:
    os.setgroups(JOB["groups"])
    os.setgid(JOB["gid"])
    os.setuid(JOB["uid"])


if JOB["drop_first"]:
    drop_privileges()

import importlib  # noqa: E402
import pkgutil  # noqa: E402

import torch  # noqa: E402

import fastpersist  # noqa: E402
from fastpersist import CheckpointError  # noqa: E402
from fastpersist.protocol.client import DaemonClient  # noqa: E402


def import_everything_first() -> None:
    """Still as root, where the unprivileged uid cannot read the interpreter's
    files: import every module the run may import later, lazily (fastpersist's
    own, and gRPC's channel machinery, by making a call on a channel)."""
    for m in pkgutil.walk_packages(fastpersist.__path__, "fastpersist."):
        if not m.name.startswith(("fastpersist.daemon", "fastpersist.cli")):
            importlib.import_module(m.name)
    client = DaemonClient(JOB["address"])
    try:
        client.info()
        client.health()
    finally:
        client.close()


if not JOB["drop_first"]:
    import_everything_first()
    drop_privileges()


def state(step: int) -> dict[str, object]:
    return {"step": step, "w": torch.full((4096,), float(step)),
            "b": torch.arange(step, step + 100, dtype=torch.int64)}


def main() -> None:
    root = JOB["root"]
    out: dict[str, object] = {"uid": os.getuid(), "gid": os.getgid(),
                              "groups": sorted(os.getgroups())}
    # The deployment under test: the daemon's root is not ours to write.
    try:
        with open(os.path.join(os.path.dirname(root), "trainer-was-here"), "x"):
            pass
        out["root_writable"] = True
    except PermissionError:
        out["root_writable"] = False
    ckpt = fastpersist.Checkpointer(root, keep_last=JOB["keep_last"], daemon=JOB["address"])
    out["latest_before"] = None if ckpt.latest() is None else str(ckpt.latest())
    errors: list[str] = []
    for step in range(JOB["steps"]):
        try:
            ckpt.save(step, state(step)).result()
        except CheckpointError as exc:
            errors.append(f"step {step}: {type(exc).__name__}: {exc}")
    try:
        ckpt.close()
    except CheckpointError as exc:
        errors.append(f"close: {type(exc).__name__}: {exc}")
    out["errors"] = errors
    print("\n".join(errors), file=sys.stderr, flush=True)  # in case what follows fails
    out["steps"] = ckpt.steps()
    latest = ckpt.latest()
    out["latest"] = None if latest is None else os.path.basename(latest)
    if latest is not None:
        loaded = ckpt.load_latest()
        expected = state(int(loaded["step"]))
        out["loaded_step"] = int(loaded["step"])
        out["loaded_equal"] = all(torch.equal(loaded[k], expected[k]) for k in ("w", "b"))
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
