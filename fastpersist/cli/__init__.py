"""fpctl: list, inspect, verify, restore and clean up fastpersist checkpoints.

    fpctl ls ROOT                      checkpoints under ROOT, and leftovers of saves
    fpctl inspect CKPT                 files, tensors (dtype, shape, offset, CRC32C,
                                       encoding and ratio when compressed)
    fpctl verify CKPT                  re-read every byte; exit 1 on any corruption
    fpctl restore CKPT --to FILE       one torch.save (or safetensors) file
    fpctl gc ROOT                      remove what interrupted saves left anywhere under ROOT
    fpctl gather DIR... --to CKPT      one checkpoint from a node-local one's node dirs
    fpctl daemon status [--daemon ADDR]  is fastpersistd serving; its root, staging, work

ls, inspect, verify, restore and gc also take s3:// URLs: checkpoints in an
object store (the tier), reached the standard AWS way or at --endpoint-url.

Exit status: 0 success, 1 corruption found by verify, 2 any other error.
Everything goes through fastpersist's own reader (committed.read_manifest,
verifying.verify, load); fpctl never parses the format itself.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Sequence

from .._version import __version__
from ..errors import CheckpointError
from ..storage.commit import os_error
from ..tier.url import is_tier_url
from ._output import EXIT_ERROR, warn

# Commands are imported when run, and only restore and gather import torch:
# ls, inspect and verify read no tensor (tests/test_cli_torch_free.py), and
# `daemon status` is the health probe of a torch-free daemon image.


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fpctl", description="Manage fastpersist checkpoints.",
        epilog="Exit status: 0 success, 1 corruption found by verify, 2 any other error.",
    )
    parser.add_argument("--version", action="version", version=f"fpctl {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    tier_parent = argparse.ArgumentParser(add_help=False)
    tier_parent.add_argument(
        "--endpoint-url", metavar="URL",
        help="for s3:// URLs: the object store's endpoint (default: the standard AWS "
             "configuration, e.g. AWS_ENDPOINT_URL)")

    p = sub.add_parser("ls", help="list the checkpoints under ROOT",
                       parents=[tier_parent],
                       description="List every checkpoint directly under ROOT, corrupt ones, "
                       "and the leftovers of interrupted saves that `gc` would clean.")
    p.add_argument("root", metavar="ROOT")
    p.add_argument("--json", action="store_true", help="print a JSON list")
    p.add_argument("--daemon", metavar="ADDR",
                   help="COPIES: the fastpersistd whose memory (and --tier) to ask "
                        "(default $FASTPERSIST_DAEMON; \"\": none)")
    p.add_argument("--tier", metavar="URL",
                   help="COPIES: the s3:// URL that ROOT is copied to (default: the "
                        "daemon's --tier)")
    p.set_defaults(func="listing:cmd_ls")

    p = sub.add_parser("inspect", help="show a checkpoint's files and tensors",
                       parents=[tier_parent],
                       description="Show a checkpoint's manifest: files, every tensor "
                       "(dtype, shape, bytes, file, offset, CRC32C) and the shape of the "
                       "non-tensor state.")
    p.add_argument("ckpt", metavar="CKPT")
    p.add_argument("--json", action="store_true", help="print the structured form")
    p.set_defaults(func="inspecting:cmd_inspect")

    p = sub.add_parser("verify", help="check every byte against its checksum",
                       parents=[tier_parent],
                       description="Re-read every data file and check each tensor's CRC32C "
                       "and each file's size and header. Compressed tensors: each stored "
                       "frame's CRC32C, then the tensor's own (raw) CRC32C after decoding "
                       "it, as a load does. Exits 1 and names the file and tensor on any "
                       "corruption.")
    p.add_argument("ckpt", metavar="CKPT")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--no-decode", action="store_true",
                   help="compressed tensors: check the stored frames' CRC32Cs only, "
                        "without decoding (faster; proves the bytes on disk intact)")
    p.set_defaults(func="inspecting:cmd_verify")

    p = sub.add_parser("restore", help="write a checkpoint as one torch or safetensors file",
                       parents=[tier_parent],
                       description="Load a checkpoint on the CPU and write it as one file, "
                       "atomically (FILE.tmp, fsync, rename). --format safetensors "
                       "flattens nested keys with dots (optimizer.state.0.exp_avg), writes "
                       "tensors that share memory in full (tied weights are stored twice), and "
                       "keeps non-tensor values as JSON strings in the metadata under their "
                       "dotted key; values JSON cannot hold (bytes, torch dtypes and "
                       "devices, pickled objects) are dropped with a warning, and tuples "
                       "come back as lists.")
    p.add_argument("ckpt", metavar="CKPT")
    p.add_argument("--to", required=True, metavar="FILE", help="the file to write")
    p.add_argument("--format", choices=["torch", "safetensors"], default="torch",
                   help="torch.save (default) or safetensors")
    p.add_argument("--force", action="store_true", help="replace FILE if it exists")
    p.add_argument("--allow-pickle", action="store_true",
                   help="unpickle pickled values in the checkpoint (only if you trust it)")
    p.add_argument("--daemon", metavar="ADDR",
                   help="read the copy in this fastpersistd's memory first, and its --tier "
                        "last (default $FASTPERSIST_DAEMON; \"\": none)")
    p.add_argument("--tier", metavar="URL",
                   help="CKPT's s3:// URL in an object store: read there if the local copy "
                        "is corrupt or gone")
    p.set_defaults(func="restoring:cmd_restore")

    p = sub.add_parser("gc", help="clean up after interrupted saves",
                       parents=[tier_parent],
                       description="Remove, anywhere under ROOT, the staging directories "
                       "and temporary files of saves (and pointer updates, restores) whose "
                       "process is gone, and put back a checkpoint that an interrupted "
                       "replace moved aside. Leftovers of running saves are left alone.")
    p.add_argument("root", metavar="ROOT")
    p.add_argument("--dry-run", action="store_true", help="say what would be done, do nothing")
    p.add_argument("--json", action="store_true", help="print the actions as JSON")
    p.add_argument("--older-than", type=float, default=86400.0, metavar="SECONDS",
                   help="for s3:// URLs: remove uploads without a manifest and abort "
                        "multipart uploads untouched for this long (default one day)")
    p.set_defaults(func="listing:cmd_gc")

    p = sub.add_parser("gather", help="collect a node-local checkpoint into one directory",
                       description="A distributed save with node_local=True leaves on each "
                       "node a directory with that node's data files and the job manifest. "
                       "Copy every node's directory somewhere visible (or mount them), then "
                       "gather writes one checkpoint with all the files, committed "
                       "atomically, that loads anywhere.")
    p.add_argument("dirs", nargs="+", metavar="DIR", help="the node directories")
    p.add_argument("--to", required=True, metavar="CKPT", help="the checkpoint to write")
    p.set_defaults(func="gathering:cmd_gather")

    p = sub.add_parser("daemon", help="ask fastpersistd how it is",
                       description="fpctl daemon status: exit 0 if fastpersistd answers "
                       "SERVING on the standard gRPC health service, 2 otherwise; prints its "
                       "version, root, staging memory and checkpoints in flight. The "
                       "liveness/readiness probe of deploy/.")
    p.add_argument("action", choices=["status"])
    p.add_argument("--daemon", metavar="ADDR",
                   help="unix:///PATH or https://HOST:PORT (default $FASTPERSIST_DAEMON, else "
                        "unix:///run/fastpersist/fastpersistd.sock)")
    p.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for an answer")
    p.add_argument("--json", action="store_true", help="print the status as JSON")
    p.set_defaults(func="daemon:cmd_daemon")
    return parser


def _message(exc: CheckpointError) -> str:
    # The OSError subclasses carry the whole message in strerror; str() would
    # prefix "[Errno 17]".
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    return str(exc)


def main(argv: Sequence[str] | None = None) -> int:
    """Run fpctl with `argv` (default: sys.argv[1:]); returns the exit status."""
    args = build_parser().parse_args(argv)
    target = getattr(args, "root", None) or getattr(args, "ckpt", None)
    if is_tier_url(target):
        if getattr(args, "endpoint_url", None):
            # For every client fpctl makes (load included): the standard variable.
            os.environ["AWS_ENDPOINT_URL"] = args.endpoint_url
        if args.command != "restore":
            args.func = f"remote:cmd_{args.command}"
    try:
        module, name = args.func.split(":")
        func = getattr(importlib.import_module(f".{module}", __package__), name)
        status: int = func(args)
        sys.stdout.flush()
    except BrokenPipeError:  # `fpctl ls | head`
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except CheckpointError as exc:
        warn(f"error: {_message(exc)}")
        return EXIT_ERROR
    except OSError as exc:
        warn(f"error: {_message(os_error(exc, f'fpctl {args.command}'))}")
        return EXIT_ERROR
    except KeyboardInterrupt:
        return 130
    return status


__all__ = ["build_parser", "main"]
