"""A committed checkpoint's files, without torch: its manifest (and, where
there is none, why), each data file's records and size, reads in batches,
and read errors as checkpoint errors. fpctl's ls, inspect and verify read
through this module, headers.py, mismatch.py and verifying.py, none of which
imports torch (a command that reads no tensor need not pay torch's second of
import); tests/test_cli_torch_free.py holds them to it."""

from __future__ import annotations

import os
from collections.abc import Container, Iterator
from contextlib import contextmanager
from pathlib import Path

from ..errors import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
    ManifestError,
    TruncatedFileError,
)
from ..format.bounds import MAX_MANIFEST_BYTES
from ..format.manifest import MANIFEST_NAME, FileRecord, Manifest, TensorRecord
from ..storage.commit import find_leftovers, os_error, parse_leftover


def _not_found(path: Path) -> CheckpointNotFoundError:
    if parse_leftover(path) is not None:
        return CheckpointNotFoundError(
            f"{path} is the staging directory of a save that did not finish; it is not a "
            "checkpoint (`fpctl gc` removes it)"
        )
    hint = ""
    if path.parent.is_dir():
        aside = [lo for lo in find_leftovers(path.parent)
                 if lo.is_for(path.name) and lo.kind == "old"]
        if aside:
            hint = (f"; a replace of it was interrupted and the previous checkpoint is in "
                    f"{aside[0].path.name} (`fpctl gc {path.parent}` puts it back)")
    if not path.exists():
        return CheckpointNotFoundError(f"no checkpoint at {path}: the path does not exist{hint}")
    if not path.is_dir():
        return CheckpointNotFoundError(f"{path} is a file, not a checkpoint directory")
    return CheckpointNotFoundError(
        f"{path} is not a committed checkpoint: it has no {MANIFEST_NAME}{hint}"
    )


def read_manifest(path: str | os.PathLike[str]) -> Manifest:
    """The validated manifest of the checkpoint at `path`."""
    return read_manifest_bytes(path)[0]


def read_manifest_bytes(path: str | os.PathLike[str]) -> tuple[Manifest, bytes]:
    """read_manifest, and the bytes it was read from (which copy is which
    checkpoint: loading/chain.py)."""
    p = Path(path)
    manifest_path = p / MANIFEST_NAME
    if parse_leftover(p) is not None or not manifest_path.is_file():
        raise _not_found(p)
    try:
        size = manifest_path.stat().st_size
        if size > MAX_MANIFEST_BYTES:  # refused before it is read into memory
            raise ManifestError(f"{p}: the manifest is {size} bytes, more than the "
                                f"{MAX_MANIFEST_BYTES} this version reads")
        data = manifest_path.read_bytes()
    except OSError as exc:
        raise os_error(exc, f"cannot read {manifest_path}") from exc
    return Manifest.from_json(data, str(p)), data


# Reads that report progress of compressed files, and verify's reads (to bound
# their memory), go in batches of at most this many tensor bytes.
BATCH_BYTES = 256 << 20
# Files (or verify's batches) whose engine reads run at once. Two keep the disk
# busy across a file's uneven last reads and the next one's start, and let the
# caller check and allocate a file while others are read.
FILES_IN_FLIGHT = 2


def records_by_file(manifest: Manifest, skip: Container[int] = ()
                    ) -> Iterator[tuple[FileRecord, list[int]]]:
    """Each data file with the indices of its records, less those in `skip` (a
    file all of whose records are skipped is left out)."""
    by_file: dict[str, list[int]] = {f.name: [] for f in manifest.files}
    skipped: set[str] = set()
    for i, t in enumerate(manifest.tensors):
        if i in skip:
            skipped.add(t.file)
        else:
            by_file[t.file].append(i)
    for f in manifest.files:
        if by_file[f.name] or f.name not in skipped:
            yield f, by_file[f.name]


def check_size(path: Path, f: FileRecord) -> None:
    file_path = path / f.name
    try:
        actual = file_path.stat().st_size
    except FileNotFoundError:
        raise CorruptCheckpointError(f"{path}: data file {f.name} is missing") from None
    if actual < f.size:
        raise TruncatedFileError(
            f"{path}: data file {f.name} is truncated: {actual} bytes, the manifest says {f.size}"
        )
    if actual > f.size:
        raise CorruptCheckpointError(
            f"{path}: data file {f.name} is {actual} bytes, the manifest says {f.size}"
        )


def damage(path: Path, manifest: Manifest) -> str | None:
    """Why the data files of the committed checkpoint at `path` cannot all be
    read, judged from their sizes alone (no byte is read): a file missing,
    shorter or longer than the manifest says. None when each is there at its
    size. A node-local checkpoint's files that another node holds (FileRecord.node)
    are not looked for: they are elsewhere by design."""
    for f in manifest.files:
        try:
            check_size(path, f)
        except CorruptCheckpointError as exc:
            if f.node is not None and not os.path.lexists(path / f.name):
                continue
            return str(exc)
    return None


@contextmanager
def read_errors(path: Path, f: FileRecord) -> Iterator[None]:
    """A data file's read errors as checkpoint errors: a short file is a
    TruncatedFileError, any other OSError names the file."""
    try:
        yield
    except EOFError as exc:
        raise TruncatedFileError(f"{path}: {exc}") from None
    except OSError as exc:
        raise os_error(exc, f"cannot read {path / f.name}") from exc


def batches(items: list[tuple[int, TensorRecord]], limit: int
            ) -> Iterator[list[tuple[int, TensorRecord]]]:
    """Consecutive groups of at most `limit` bytes (or one larger tensor); at least one."""
    batch: list[tuple[int, TensorRecord]] = []
    size = 0
    for item in items:
        if batch and size + item[1].length > limit:
            yield batch
            batch, size = [], 0
        batch.append(item)
        size += item[1].length
    yield batch


__all__ = ["BATCH_BYTES", "FILES_IN_FLIGHT", "batches", "check_size", "damage", "read_errors",
           "read_manifest", "read_manifest_bytes", "records_by_file"]
