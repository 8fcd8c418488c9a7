"""fpctl ls, inspect, verify and gc of s3:// URLs: checkpoints in the object store.

The store is reached the standard AWS way (environment, config files), or at
--endpoint-url. A checkpoint there is a directory of objects with a manifest,
at any depth (the daemon uploads ROOT/run1/step-5 to PREFIX/run1/step-5); a
directory with checkpoints below it is a run; a directory of objects with
neither is an upload in progress or abandoned ("incomplete"), which gc
removes once it is older than --older-than, together with abandoned multipart
uploads (tier/listing.py). A key that is not a valid path (put there by
another tool) is named in a warning and left alone.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from ..errors import CheckpointError, CorruptCheckpointError
from ..format.manifest import Manifest
from ..tensors import tier_read
from ..tier.client import S3, client_for
from ..tier.listing import INCOMPLETE, RUN, listing
from ..tier.remote import read_manifest
from ..tier.retention import delete_incomplete, sweep_uploads
from ..tier.url import TierURL
from ._output import (
    EXIT_ERROR,
    EXIT_OK,
    human_size,
    local_time,
    print_json,
    print_table,
    warn,
)
from .inspecting import describe, print_description, run_verify


def _where(text: str) -> tuple[S3, TierURL]:
    try:
        return client_for(), TierURL.parse(text)
    except ValueError as exc:
        raise CheckpointError(str(exc)) from None


def remote_manifest(text: str) -> Manifest:
    s3, url = _where(text)
    return read_manifest(s3, url)[0]


def _odd(url: TierURL, keys: tuple[str, ...], doing: str) -> list[dict[str, Any]]:
    """A warning per odd key (one that names no valid path below `url`), and its row."""
    rows = []
    for key in keys:
        warn(f"{doing} s3://{url.bucket}/{key!r}: not a valid path below {url} "
             "(not made by fastpersist); left alone")
        rows.append({"name": key[len(url.dir_prefix):], "path": f"s3://{url.bucket}/{key}",
                     "bytes": None, "tensors": None, "created_unix": None,
                     "state": "odd key (not a valid path; left alone)"})
    return rows


def cmd_ls(args: argparse.Namespace) -> int:
    s3, url = _where(args.root)
    found = listing(s3, url)
    rows: list[dict[str, Any]] = []
    for e in found.entries:
        row: dict[str, Any] = {"name": e.name, "path": str(url.child(e.name)), "bytes": e.bytes,
                               "tensors": None, "created_unix": None}
        if e.kind == RUN:
            row["state"] = f"run ({e.checkpoints} checkpoint(s) below)"
        elif e.kind == INCOMPLETE:
            row["state"] = ("incomplete (no manifest: an upload in progress or abandoned; "
                            "`fpctl gc` removes it once old)")
        else:
            try:
                m = read_manifest(s3, url.child(e.name))[0]
            except CorruptCheckpointError as exc:
                row["state"] = f"corrupt: {str(exc).removeprefix(row['path'] + ': ')}"
            else:
                row.update(state="committed", created_unix=m.created_unix, tensors=(
                    len(m.globals) if m.globals is not None else len(m.tensors)))
        rows.append(row)
    rows += _odd(url, found.odd, "skipped")
    uploads = sum(1 for _ in s3.multipart_uploads(url))
    if args.json:
        print_json(rows)
        return EXIT_OK
    if found.is_checkpoint:
        print(f"{url} is a checkpoint (`fpctl inspect` it)")
    elif not rows:
        print(f"no checkpoints in {url}")
    if rows:
        print_table(["NAME", "SIZE", "TENSORS", "CREATED", "STATE"],
                    [[r["name"], "-" if r["bytes"] is None else human_size(r["bytes"]),
                      "-" if r["tensors"] is None else str(r["tensors"]),
                      local_time(r["created_unix"]), r["state"]] for r in rows],
                    right=[False, True, True])
    if uploads:
        print(f"{uploads} multipart upload(s) in progress or abandoned")
    return EXIT_OK


def cmd_inspect(args: argparse.Namespace) -> int:
    info = describe(args.ckpt, remote_manifest(args.ckpt))
    if args.json:
        print_json(info)
    else:
        print_description(args.ckpt, info)
    return EXIT_OK


def cmd_verify(args: argparse.Namespace) -> int:
    s3, url = _where(args.ckpt)
    return run_verify(str(url), url.name, args.json, lambda: read_manifest(s3, url)[0],
                      lambda manifest, progress: tier_read.verify(s3, url, progress=progress,
                                                                  decode=not args.no_decode,
                                                                  manifest=manifest))


def cmd_gc(args: argparse.Namespace) -> int:
    s3, url = _where(args.root)
    results = []
    status = EXIT_OK
    cutoff = time.time() - args.older_than
    found = listing(s3, url)
    for e in found.entries:
        if e.kind != INCOMPLETE or e.modified > cutoff:
            continue
        target = url.child(e.name)
        action = "would-remove" if args.dry_run else "removed"
        if not args.dry_run:
            try:
                delete_incomplete(s3, url, e)
            except CheckpointError as exc:
                action, status = f"failed: {exc}", EXIT_ERROR
        results.append({"path": str(target), "kind": "incomplete", "action": action})
    for row in _odd(url, found.odd, "not removing"):
        results.append({"path": row["path"], "kind": "odd-key", "action": "skipped"})
    if args.dry_run:
        old = [k for k, _, t in s3.multipart_uploads(url) if t <= cutoff]
    else:
        old = sweep_uploads(s3, url, args.older_than)
    results += [{"path": f"s3://{url.bucket}/{k}", "kind": "multipart-upload",
                 "action": "would-abort" if args.dry_run else "aborted"} for k in old]
    if args.json:
        print_json(results)
    elif not results:
        print(f"nothing to clean in {url}")
    else:
        for r in results:
            if r["kind"] == "odd-key":
                continue  # warned above
            (warn if r["action"].startswith("failed") else print)(
                f"{r['action']} {r['kind']} {r['path']}")
    return status


__all__ = ["cmd_gc", "cmd_inspect", "cmd_ls", "cmd_verify", "remote_manifest"]
