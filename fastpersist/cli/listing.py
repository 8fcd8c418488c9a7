"""`fpctl ls` and `fpctl gc`: the checkpoints under a root, and the leftovers of
saves that did not finish.

Both look at any depth below the root (a daemon's --root holds runs in
subdirectories, ROOT/run1/step-N), never inside a checkpoint or a leftover,
and never through a symbolic link. ls reads manifests and stats data files;
it reads no tensor byte, and imports no torch."""

from __future__ import annotations

import argparse
import contextlib
import os
import socket
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from ..errors import CheckpointError, CheckpointNotFoundError, CorruptCheckpointError
from ..format.manifest import MANIFEST_NAME
from ..storage.commit import Leftover, collect, os_error, parse_leftover, restores, walk_leftovers
from ..storage.prepared import read_prepared
from ..storage.retention import LATEST
from ..tensors.committed import damage, read_manifest
from ._output import EXIT_ERROR, EXIT_OK, human_size, local_time, print_json, print_table, warn


@dataclass(frozen=True)
class Entry:
    """One row of `fpctl ls`; the JSON keys are these field names."""

    name: str  # relative to the root listed: run1/step-00000005
    path: str
    state: str
    bytes: int | None
    tensors: int | None
    created_unix: float | None
    latest: bool = False  # named by its directory's `latest` pointer
    # Where its copies are, fastest first: "memory", "disk", "peer", "s3" (copies.py)
    copies: tuple[str, ...] = ()


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


def _leftover_entry(leftover: Leftover, name: str) -> Entry:
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
    return Entry(name, str(leftover.path), state, size, None, None)


def _checkpoint_entry(path: Path, name: str) -> Entry:
    try:
        m = read_manifest(path)
    except CorruptCheckpointError as exc:
        reason = str(exc).removeprefix(f"{path}: ")
        return Entry(name, str(path), f"corrupt: {reason}", _disk_usage(path), None, None)
    except CheckpointError as exc:
        return Entry(name, str(path), f"unreadable: {exc}", None, None, None)
    # A distributed checkpoint's tensors are its job tensors, not their chunks.
    count = len(m.globals) if m.globals is not None else len(m.tensors)
    damaged = damage(path, m)  # sizes only: `fpctl verify` reads every byte
    state = "committed" if damaged is None else "damaged: " + damaged.removeprefix(f"{path}: ")
    return Entry(name, str(path), state, m.total_bytes, count, m.created_unix)


def _unmanifested_entry(path: Path, name: str) -> Entry | None:
    """A directory without a manifest that holds data files: a checkpoint whose
    manifest was lost (never what a save leaves: it writes the manifest before
    the directory gets its name). Any other directory is not ours to show."""
    try:
        with os.scandir(path) as it:
            data = any(e.name.startswith("data-") and e.name.endswith((".safetensors", ".fpz"))
                       for e in it)
    except OSError:
        return None
    if not data:
        return None
    return Entry(name, str(path), f"damaged: data files without a {MANIFEST_NAME} (not loadable)",
                 _disk_usage(path), None, None)


def _pointed(directory: Path) -> str | None:
    try:
        return (directory / LATEST).read_text().strip() or None
    except (OSError, UnicodeDecodeError):
        return None


def list_entries(root: Path) -> list[Entry]:
    """Checkpoints at any depth under `root` (damaged ones too) and leftovers,
    each named relative to root; a directory's `latest` pointer marks the
    checkpoint it names. Sorted by name."""
    entries = []
    for dirpath, dirnames, filenames in os.walk(root):  # os.walk follows no link
        here = Path(dirpath)
        pointed = _pointed(here) if LATEST in filenames else None
        keep = []
        for child in sorted(dirnames + filenames):
            path = here / child
            name = str(path.relative_to(root))
            leftover = parse_leftover(path)
            if leftover is not None:
                entries.append(_leftover_entry(leftover, name))
            elif child not in dirnames:
                continue
            elif (path / MANIFEST_NAME).is_file():
                entries.append(replace(_checkpoint_entry(path, name), latest=child == pointed))
            elif (lost := _unmanifested_entry(path, name)) is not None:
                entries.append(lost)
            else:
                keep.append(child)  # a run directory, or anything else: look inside
        dirnames[:] = keep
    return sorted(entries, key=lambda e: e.name)


def cmd_ls(args: argparse.Namespace) -> int:
    root = _root(args.root)
    try:
        entries = list_entries(root)
    except OSError as exc:
        raise os_error(exc, f"cannot list {root}") from exc
    from .copies import copies

    readable = [e.name for e in entries if e.created_unix is not None]  # a manifest here
    where = copies(root, readable, daemon=args.daemon, tier=args.tier,
                   endpoint_url=args.endpoint_url)
    entries = [replace(e, copies=tuple(where.get(e.name, ()))) for e in entries]
    if args.json:
        print_json([asdict(e) for e in entries])
        return EXIT_OK
    if not entries:
        print(f"no checkpoints in {root}")
        return EXIT_OK
    rows = [[e.name, human_size(e.bytes), "-" if e.tensors is None else str(e.tensors),
             local_time(e.created_unix), ",".join(e.copies) or "-",
             e.state + (", latest" if e.latest else "")]
            for e in entries]
    print_table(["NAME", "SIZE", "TENSORS", "CREATED", "COPIES", "STATE"], rows,
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
