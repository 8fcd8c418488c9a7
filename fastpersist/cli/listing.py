"""`fpctl ls` and `fpctl gc`: the checkpoints under a root, and the leftovers of
saves that did not finish."""

from __future__ import annotations

import argparse
import contextlib
import os
import socket
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ..errors import CheckpointError, CheckpointNotFoundError, CorruptCheckpointError
from ..format.manifest import MANIFEST_NAME
from ..storage.commit import Leftover, collect, find_leftovers, os_error, restores, walk_leftovers
from ..storage.prepared import read_prepared
from ..tensors.committed import read_manifest
from ._output import EXIT_ERROR, EXIT_OK, human_size, local_time, print_json, print_table, warn


@dataclass(frozen=True)
class Entry:
    """One row of `fpctl ls`; the JSON keys are these field names."""

    name: str
    path: str
    state: str
    bytes: int | None
    tensors: int | None
    created_unix: float | None


def _root(path: str) -> Path:
    root = Path(path)
    if not root.is_dir():
        what = "does not exist" if not root.exists() else "is not a directory"
        raise CheckpointNotFoundError(f"{root} {what}")
    return root


def _disk_usage(path: Path) -> int:
    total = 0
    for dirpath, _, files in os.walk(path):
        for name in files:
            with contextlib.suppress(OSError):  # removed while we looked: a save in progress
                total += os.lstat(os.path.join(dirpath, name)).st_size
    return total


def _owner(leftover: Leftover) -> str:
    if leftover.host != socket.gethostname():
        return "on another host, may be running"
    return "running" if leftover.owner_alive else "dead"


def _leftover_entry(leftover: Leftover) -> Entry:
    if leftover.kind == "prep":
        part = read_prepared(leftover)
        decides = f"node {part.commit_node}'s" if part else "the committing node's"
        state = (f"in doubt (part of distributed checkpoint {leftover.target_name}: committed "
                 f"only if {decides} copy is; fastpersist.distributed.settle decides)")
    elif leftover.kind == "old":
        state = f"replaced (old copy of {leftover.target_name})"
    elif leftover.kind == "del":
        state = f"being deleted (by pid {leftover.pid} on {leftover.host}, {_owner(leftover)})"
    elif not leftover.is_dir:
        state = (f"temporary file (of pid {leftover.pid} on {leftover.host}, "
                 f"{_owner(leftover)})")
    else:
        state = f"incomplete (save by pid {leftover.pid} on {leftover.host}, {_owner(leftover)})"
    size = _disk_usage(leftover.path) if leftover.is_dir else leftover.path.lstat().st_size
    return Entry(leftover.path.name, str(leftover.path), state, size, None, None)


def _checkpoint_entry(path: Path) -> Entry:
    try:
        m = read_manifest(path)
    except CorruptCheckpointError as exc:
        reason = str(exc).removeprefix(f"{path}: ")
        return Entry(path.name, str(path), f"corrupt: {reason}", _disk_usage(path), None, None)
    except CheckpointError as exc:
        return Entry(path.name, str(path), f"unreadable: {exc}", None, None, None)
    # A distributed checkpoint's tensors are its job tensors, not their chunks.
    count = len(m.globals) if m.globals is not None else len(m.tensors)
    return Entry(path.name, str(path), "committed", m.total_bytes, count, m.created_unix)


def list_entries(root: Path) -> list[Entry]:
    """Checkpoints directly under `root`, corrupt ones, and leftovers; by name."""
    leftovers = {lo.path.name: lo for lo in find_leftovers(root)}
    entries = []
    for path in sorted(root.iterdir()):
        if path.name in leftovers:
            entries.append(_leftover_entry(leftovers[path.name]))
        elif path.is_dir() and (path / MANIFEST_NAME).is_file():
            entries.append(_checkpoint_entry(path))
    return entries


def cmd_ls(args: argparse.Namespace) -> int:
    root = _root(args.root)
    try:
        entries = list_entries(root)
    except OSError as exc:
        raise os_error(exc, f"cannot list {root}") from exc
    if args.json:
        print_json([asdict(e) for e in entries])
        return EXIT_OK
    if not entries:
        print(f"no checkpoints in {root}")
        return EXIT_OK
    rows = [[e.name, human_size(e.bytes), "-" if e.tensors is None else str(e.tensors),
             local_time(e.created_unix), e.state] for e in entries]
    print_table(["NAME", "SIZE", "TENSORS", "CREATED", "STATE"], rows,
                right=[False, True, True])
    return EXIT_OK


def _dry_run_action(leftover: Leftover) -> tuple[str, str]:
    if restores(leftover):
        target = leftover.path.parent / leftover.target_name
        return "would-restore", f"would restore {target} from {leftover.path.name}"
    return "would-remove", f"would remove {leftover.path.name}"


def cmd_gc(args: argparse.Namespace) -> int:
    root = _root(args.root)
    results: list[dict[str, Any]] = []
    status = EXIT_OK
    for leftover in walk_leftovers(root):
        if leftover.kind == "prep":
            action = "skipped"
            message = collect(leftover).replace("kept", "skipped", 1)  # never removed here
        elif leftover.owner_alive:
            action = "skipped"
            message = (f"skipped {leftover.path.name}: its save (pid {leftover.pid} on "
                       f"{leftover.host}) may still be running")
        elif args.dry_run:
            action, message = _dry_run_action(leftover)
        else:
            try:
                message = collect(leftover)
                action = message.split(" ", 1)[0]  # "removed" or "restored"
            except OSError as exc:
                action, message = "failed", str(os_error(exc, f"cannot clean {leftover.path}"))
                status = EXIT_ERROR
        results.append({"name": leftover.path.name, "path": str(leftover.path),
                        "kind": leftover.kind, "pid": leftover.pid, "host": leftover.host,
                        "action": action, "message": message})
    if args.json:
        print_json(results)
    elif not results:
        print(f"nothing to clean in {root}")
    else:
        for r in results:
            if r["action"] == "failed":
                warn(r["message"])
            else:
                print(r["message"])
    return status


__all__ = ["Entry", "cmd_gc", "cmd_ls", "list_entries"]
