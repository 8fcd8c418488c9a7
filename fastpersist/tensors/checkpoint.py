"""Reading a committed checkpoint's tensors (its manifest and files:
committed.py; verification: verifying.py; the data files' own headers:
headers.py)."""

from __future__ import annotations

from collections.abc import Callable, Container, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch

from ..engine import Engine, IOResult
from ..errors import CorruptCheckpointError, ManifestError
from ..format.manifest import FileRecord, Manifest, TensorRecord
from . import datafile, packed
from .committed import (
    BATCH_BYTES,
    FILES_IN_FLIGHT,
    batches,
    check_size,
    read_errors,
    read_manifest,
    records_by_file,
)
from .headers import check_against_header, check_header_bytes
from .mismatch import raise_for


def read_tensors(path: Path, manifest: Manifest, engine: Engine, *, verify: bool,
                 progress: Callable[[int], None] | None = None,
                 spans: Mapping[int, packed.Span] | None = None,
                 skip: Container[int] = ()) -> list[torch.Tensor]:
    """Every stored tensor, on the CPU, in manifest order; raises on corruption.

    Each file's records must agree with the file's own header (names, dtypes,
    shapes, places, encodings), so that a manifest can only name bytes that
    were written for the tensor it says, even with verify=False.
    progress(n) is called as each file or batch of n tensor bytes has been read.
    spans: record index -> the raw bytes start..end the caller needs of it; a
    compressed record is then decoded only where its frames overlap the span
    (the rest is zeros, and each frame's stored CRC32C is what is checked).
    Raw records are read whole, so that their CRC32C is checked.
    skip: records not to read (their places hold None; load's into= has read
    them, read_into.py).
    """
    result: list[torch.Tensor | None] = [None] * len(manifest.tensors)
    if len(manifest.files) > 1 and all(r.frames is None for r in manifest.tensors):
        _read_overlapped(path, manifest, engine, verify, result, progress, skip)
        return result  # type: ignore[return-value]  # every record belongs to one file
    for f, indices in records_by_file(manifest, skip):
        check_size(path, f)
        records = [manifest.tensors[i] for i in indices]
        check_against_header(path, f, records, verify=verify)
        # Batches only when someone watches; one engine call per file otherwise.
        limit = BATCH_BYTES if progress else max(1, sum(r.length for r in records))
        for batch in batches(list(zip(indices, records, strict=True)), limit):
            batch_records = [r for _, r in batch]
            for i, t in _read_batch(path, f, batch, engine, verify, spans or {}):
                result[i] = t
            if progress:
                progress(sum(r.length for r in batch_records))
    # Every record belongs to one listed file.
    assert all(t is not None or i in skip for i, t in enumerate(result))
    return result  # type: ignore[return-value]


def _read_overlapped(path: Path, manifest: Manifest, engine: Engine, verify: bool,
                     result: list[torch.Tensor | None],
                     progress: Callable[[int], None] | None, skip: Container[int]) -> None:
    """read_tensors of raw records, several files: the engine reads up to
    FILES_IN_FLIGHT files on reader threads (the GIL released) while this
    thread allocates the next. Each file's header is read with its tensors
    and checked against the records before any of them is returned (a
    separate read of it first waited behind the other file's reads, on this
    thread). Errors come in file order, and progress a file at a time, on
    this thread."""
    in_flight: list[tuple[list[int], datafile.PendingRead, Future[IOResult]]] = []
    with ThreadPoolExecutor(FILES_IN_FLIGHT, thread_name_prefix="fastpersist-read") as readers:
        # (Leaving the block waits for reads still running: nothing frees their memory.)
        try:
            for f, indices in records_by_file(manifest, skip):
                check_size(path, f)
                records = [manifest.tensors[i] for i in indices]
                if len(in_flight) >= FILES_IN_FLIGHT:
                    _finish_read(path, *in_flight.pop(0), result, progress)
                pending = datafile.start_read(str(path), f, records, verify=verify)
                in_flight.append((indices, pending,
                                  readers.submit(datafile.run_read, engine, pending)))
        except BaseException:
            while in_flight:  # an earlier file's error goes first
                _finish_read(path, *in_flight.pop(0), result, progress)
            raise
        while in_flight:
            _finish_read(path, *in_flight.pop(0), result, progress)


def _finish_read(path: Path, indices: list[int], pending: datafile.PendingRead,
                 future: Future[IOResult], result: list[torch.Tensor | None],
                 progress: Callable[[int], None] | None) -> None:
    with read_errors(path, pending.file):
        done = future.result()
    tensors = finish_with_header(path, pending, done)
    for i, t in zip(indices, tensors, strict=True):
        result[i] = t
    if progress:
        progress(sum(r.length for r in pending.records))


def finish_with_header(path: Path, pending: datafile.PendingRead, result: IOResult,
                       file_records: list[TensorRecord] | None = None) -> list[torch.Tensor]:
    """finish_read of a read that took the file's header (start_read's header):
    a corrupt header, then a header that disagrees with the records (all of
    the file's, `file_records`, where the read took only some), then the
    tensors' CRC32C mismatches raise, in that order."""
    header = pending.take_header()
    tensors, mismatches = datafile.finish_read(pending, result)
    if mismatches and mismatches[0].tensor == "<header>":
        raise_for(mismatches[:1], str(path))
    check_header_bytes(path, pending.file, file_records or pending.records, header,
                       verify=pending.verify)
    raise_for(mismatches, str(path))
    return tensors


def _read_batch(path: Path, f: FileRecord, batch: list[tuple[int, TensorRecord]],
                engine: Engine, verify: bool, spans: Mapping[int, packed.Span]
                ) -> list[tuple[int, torch.Tensor]]:
    raw = [(i, r) for i, r in batch if r.frames is None]
    encoded = [(i, r) for i, r in batch if r.frames is not None]
    out: list[tuple[int, torch.Tensor]] = []
    with read_errors(path, f):
        if raw:
            tensors, mismatches = datafile.read(engine, str(path), f, [r for _, r in raw],
                                                verify=verify, header=False)
            raise_for(mismatches, str(path))
            out += zip((i for i, _ in raw), tensors, strict=True)
        if encoded:
            tensors, outcome = packed.read(packed.local_reader(engine, str(path), f),
                                           f, [r for _, r in encoded],
                                           verify=verify,
                                           spans=[spans.get(i) for i, _ in encoded])
            raise_for(outcome.mismatches, str(path))
            if outcome.undecodable:
                raise CorruptCheckpointError(f"{path}: {outcome.undecodable[0]}")
            out += zip((i for i, _ in encoded), tensors, strict=True)
    return out


__all__ = ["ManifestError", "read_manifest", "read_tensors"]
