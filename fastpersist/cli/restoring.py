"""`fpctl restore`: a checkpoint -> one torch.save or safetensors file.

The output is written beside its final name (FILE.tmp), fsynced, renamed over
FILE and the directory fsynced, so FILE is either absent, the old file, or the
whole new one.
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from ..engine import get_engine
from ..errors import CheckpointError, CheckpointExistsError
from ..format import dtypes
from ..loading.load import load_from, source_for
from ..storage.commit import fsync_dir, fsync_file, leftover_name, os_error
from ..tensors import datafile
from ..tensors.plan import StoredTensor
from ._output import EXIT_OK, human_size, warn

RESERVED_KEY = "__metadata__"  # the safetensors header's own metadata entry


@dataclass
class Flat:
    """A nested state flattened for safetensors: tensors and JSON metadata by dotted key."""

    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    metadata: dict[str, str] = field(default_factory=dict)
    dropped: list[str] = field(default_factory=list)  # values JSON cannot hold

    def _claim(self, key: str) -> None:
        if key in self.tensors or key in self.metadata or key == RESERVED_KEY:
            raise CheckpointError(
                f"cannot flatten the state for safetensors: two values map to the key {key!r}; "
                "restore with --format torch instead"
            )


def _has_tensor(obj: Any) -> bool:
    if isinstance(obj, torch.Tensor):
        return True
    if isinstance(obj, dict):
        return any(_has_tensor(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return any(_has_tensor(v) for v in obj)
    return False


def _json(obj: Any) -> str | None:
    try:
        return json.dumps(obj)
    except (TypeError, ValueError):
        return None


def _walk(obj: Any, key: str, flat: Flat) -> None:
    name = key or "<root>"
    if isinstance(obj, torch.Tensor):
        flat._claim(name)
        flat.tensors[name] = obj
        return
    # A subtree without tensors (param_groups, a config) stays one JSON value.
    text = None if _has_tensor(obj) else _json(obj)
    if text is not None:
        flat._claim(name)
        flat.metadata[name] = text
    elif isinstance(obj, dict):
        for k, v in obj.items():
            _walk(v, f"{key}.{k}" if key else str(k), flat)
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            _walk(v, f"{key}.{i}" if key else str(i), flat)
    else:
        flat.dropped.append(name)


def _contiguous(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Each tensor detached and contiguous: a safetensors entry is its bytes in
    order. Tensors that share memory (tied weights, views of one storage) are
    each written in full, with no copy made here (write_safetensors)."""
    return {key: t.detach().contiguous() for key, t in tensors.items()}


def flatten(obj: Any) -> Flat:
    """The safetensors form of `obj`: {"model": {"w": t}} -> {"model.w": t}.

    Non-tensor values become JSON strings in the metadata under their dotted key;
    values JSON cannot hold (bytes, dtypes, pickled objects) are listed in `dropped`.
    """
    flat = Flat()
    _walk(obj, "", flat)
    flat.tensors = _contiguous(flat.tensors)
    return flat


def _tensors_in(obj: Any) -> Iterator[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors_in(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors_in(v)


def write_safetensors(path: Path, tensors: dict[str, torch.Tensor],
                      metadata: dict[str, str]) -> None:
    """A new safetensors file at `path` holding `tensors` (contiguous, on the
    CPU) and `metadata`, durable on return. Written by the engine, with
    parallel O_DIRECT writes (safetensors.torch.save_file writes through the
    page cache on one thread: 3.1 s of a 1 GiB restore's 3.9 here); the header
    is padded with spaces to 4 KiB, which every safetensors reader accepts, as
    for a checkpoint's data files."""
    stored = []
    for name, t in tensors.items():
        dtype = dtypes.to_name(t.dtype)
        if dtype is None:
            raise CheckpointError(f"cannot write {path}: {name!r} has dtype {t.dtype}, which "
                                  "safetensors cannot hold")
        stored.append(StoredTensor(name, dtype, tuple(t.shape), t, t.nbytes))
    datafile.write(get_engine(), str(path.parent), path.name, stored, metadata)


def write_atomically(target: Path, write: Callable[[Path], None]) -> None:
    """write(tmp) then fsync, rename over `target`, fsync the directory. The
    temporary is a hidden leftover name, so `fpctl gc` removes it after a crash."""
    tmp = target.with_name(leftover_name(target.name, "tmp"))  # `fpctl gc` knows the name
    try:
        write(tmp)
        fsync_file(tmp)
        os.replace(tmp, target)
        fsync_dir(target.parent)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _check_target(target: Path, force: bool) -> None:
    if target.is_dir():
        raise CheckpointExistsError(errno.EISDIR, f"{target} is a directory")
    if os.path.lexists(target) and not force:
        raise CheckpointExistsError(errno.EEXIST, f"{target} exists; pass --force to replace it")
    if not target.parent.is_dir():
        raise CheckpointError(f"cannot write {target}: {target.parent} is not a directory")


def cmd_restore(args: argparse.Namespace) -> int:
    target = Path(os.path.abspath(args.to))
    _check_target(target, args.force)
    start = time.perf_counter()
    try:
        source = source_for(args.ckpt, args.endpoint_url, daemon=args.daemon, tier=args.tier)
    except ValueError as exc:  # a malformed s3:// URL
        raise CheckpointError(str(exc)) from None
    total = source.manifest().tensor_bytes  # read once: the load below takes it
    with tqdm(total=total, desc=f"load {Path(args.ckpt).name}", unit="B", unit_scale=True,
              unit_divisor=1024, disable=None, file=sys.stderr, leave=False) as bar:
        obj = load_from(source, map_location="cpu", allow_pickle=args.allow_pickle,
                        progress=bar.update)
    # torch.save and safetensors report no progress; say what is going on.
    if sys.stderr.isatty():
        print(f"writing {target.name} ({args.format}) ...", file=sys.stderr, flush=True)
    try:
        if args.format == "torch":
            count = len({id(t) for t in _tensors_in(obj)})
            write_atomically(target, lambda tmp: torch.save(obj, tmp))
        else:
            flat = flatten(obj)
            count = len(flat.tensors)
            metadata = {"format": "pt", **flat.metadata}
            write_atomically(target, lambda tmp: write_safetensors(
                tmp, flat.tensors, metadata))
    except OSError as exc:
        raise os_error(exc, f"cannot write {target}") from exc
    seconds = time.perf_counter() - start
    if args.format == "safetensors" and flat.dropped:
        warn(f"{len(flat.dropped)} values have no JSON form and were not written: "
             + ", ".join(flat.dropped[:10]) + (", ..." if len(flat.dropped) > 10 else ""))
    size = target.stat().st_size
    print(f"restored {args.ckpt} -> {target} ({args.format}, {count} tensors, "
          f"{human_size(size)} in {seconds:.2f} s)")
    return EXIT_OK


__all__ = ["Flat", "cmd_restore", "flatten", "write_atomically"]
