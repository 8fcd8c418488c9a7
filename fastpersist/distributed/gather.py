"""Collect a node-local checkpoint's directories into one checkpoint.

A node-local save leaves, on each node, a directory with that node's data
files and the job manifest. gather copies every data file (from whichever
directory has it) into a new checkpoint and commits it with the usual atomic
commit: it then loads anywhere, like a checkpoint saved to shared storage.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import replace
from pathlib import Path

from ..errors import CheckpointError, CheckpointNotFoundError, CorruptCheckpointError
from ..storage.commit import Staging, fsync_file, os_error
from ..tensors.committed import read_manifest


def gather(sources: list[Path], to: Path) -> int:
    """Copy the job's files from `sources` into a new checkpoint at `to`;
    returns the bytes copied. Every source must hold the same job manifest."""
    if not sources:
        raise CheckpointError("gather needs at least one node directory")
    manifest = read_manifest(sources[0])
    if manifest.globals is None:
        raise CheckpointError(f"{sources[0]} is not a distributed checkpoint")
    for s in sources[1:]:
        other = read_manifest(s)
        if (other.created_unix, other.files) != (manifest.created_unix, manifest.files):
            raise CheckpointError(f"{s} holds another checkpoint than {sources[0]} "
                                  "(their manifests differ)")
    where: dict[str, Path] = {}
    for f in manifest.files:
        for s in sources:
            p = s / f.name
            if p.exists():
                if p.stat().st_size != f.size:
                    raise CorruptCheckpointError(
                        f"{p} is {p.stat().st_size} bytes, the manifest says {f.size}")
                where[f.name] = p
                break
        else:
            node = f" (written on node {f.node})" if f.node else ""
            raise CheckpointNotFoundError(f"data file {f.name}{node} is in none of "
                                          f"{', '.join(map(str, sources))}")
    target = Path(os.path.abspath(to))
    staging = Staging.create(target)
    copied = 0
    try:
        for name, src in where.items():
            dst = staging.path / name
            shutil.copyfile(src, dst)
            fsync_file(dst)
            copied += dst.stat().st_size
        files = tuple(replace(f, node=None) for f in manifest.files)
        staging.commit(replace(manifest, files=files).to_json())
    except OSError as exc:
        staging.abort()
        raise os_error(exc, f"cannot gather into {target}") from exc
    except BaseException:
        staging.abort()
        raise
    return copied
