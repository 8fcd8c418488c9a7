"""Raw records read into the caller's tensors (load's into=, into.py).

Each data file's records are one engine call whose segments are the caller's
tensors themselves; FILES_IN_FLIGHT files are read at once, on reader threads,
as a load reads files. The caller's memory rarely has the 4 KiB phase of the
bytes in the file, so the engine reads those through its bounce buffers
(bounded by FASTPERSIST_BUFFER_BUDGET) and copies them into place: no other
memory is allocated, whatever the state's size.

(Reading each batch into reused scratch memory with one O_DIRECT region, and
copying out after the CRC32C check, was tried: as fast where that memory had
been in use for a while, 1.2-4.9x slower in a fresh process, whose new pages
lie scattered in physical memory and split each O_DIRECT read into requests
of ~1 MiB on this project's virtual disk; see the README's benchmarks.)

The CRC32Cs are checked once a file's bytes are in place: when a load raises
ChecksumMismatchError, the tensor it names holds the bad bytes, and other
tensors of `into` may hold the checkpoint's values (into.py).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch

from ..engine import Engine, IOResult, Segment
from ..format.manifest import Manifest, TensorRecord
from . import datafile
from .checkpoint import finish_with_header
from .committed import FILES_IN_FLIGHT, check_size, read_errors, records_by_file
from .plan import memory_of


def read_into(path: Path, manifest: Manifest, engine: Engine, dests: Mapping[int, torch.Tensor],
              *, verify: bool, progress: Callable[[int], None] | None = None) -> None:
    """Read each record i in `dests` (raw; dests[i] a contiguous CPU tensor of
    its dtype and size) into dests[i]; raises as checkpoint.read_tensors does
    (errors in file order)."""
    in_flight: list[tuple[datafile.PendingRead, list[TensorRecord], Future[IOResult]]] = []
    readers = ThreadPoolExecutor(FILES_IN_FLIGHT, thread_name_prefix="fastpersist-read")
    try:
        for f, indices in records_by_file(manifest):
            mine = [i for i in indices if i in dests]
            if not mine:
                continue
            check_size(path, f)
            records = [manifest.tensors[i] for i in mine]
            tensors = [dests[i] for i in mine]
            # The header is read with the tensors and checked before the call returns.
            segments: list[Segment] = [(bytearray(f.data_start), 0)]
            segments += [(memory_of(t), r.offset) for t, r in zip(tensors, records, strict=True)]
            pending = datafile.PendingRead(os.path.join(path, f.name), f, records, tensors,
                                           segments, verify, with_header=True)
            if len(in_flight) >= FILES_IN_FLIGHT:
                _finish(path, *in_flight.pop(0), progress)
            in_flight.append((pending, [manifest.tensors[i] for i in indices],
                              readers.submit(datafile.run_read, engine, pending)))
        while in_flight:
            _finish(path, *in_flight.pop(0), progress)
    finally:  # an error reads no further file; the running ones are waited for
        readers.shutdown(wait=True, cancel_futures=True)


def _finish(path: Path, pending: datafile.PendingRead, file_records: list[TensorRecord],
            future: Future[IOResult], progress: Callable[[int], None] | None) -> None:
    with read_errors(path, pending.file):
        done = future.result()
    finish_with_header(path, pending, done, file_records)
    if progress:
        progress(sum(r.length for r in pending.records))
