"""Loading straight to an accelerator through a bounded ring of host buffers.

Without this, load(path, map_location="cuda:N") reads every tensor into host
memory and then copies it over: the whole state in host memory at once. Here
each data file is read a chunk at a time (at most a ring slot, a file's
consecutive tensors together) into one of a few reused host buffers, pinned
where the device is CUDA, and each chunk is copied to its place in the
device tensors, asynchronously, while the next chunk is read; a slot is read
into again only after its copy has finished. Host memory: the ring
(FASTPERSIST_LOAD_RING_BYTES), whatever the size of the state. A tensor
larger than a slot is read in several chunks; its CRC32C is combined from
its pieces' and checked once its last piece is in. With load's into=, a
tensor of the caller's on the device takes the place of a new one.

Only raw (safetensors) data files are read this way; api.py reads compressed
checkpoints, and distributed ones, the usual way. On the CPU the same code
runs with plain buffers and synchronous copies, which is how the tests run
it without a GPU.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..checksum import combine
from ..engine import Engine
from ..format import dtypes
from ..format.manifest import FileRecord, Manifest, TensorRecord
from . import state
from .committed import check_size, read_errors, records_by_file
from .headers import check_against_header
from .mismatch import Mismatch, raise_for
from .plan import memory_of

SLOTS = 4  # ring slots: one read while the others' copies drain
# Whole tensors below this size that lie together in a chunk share one device
# allocation and one host-to-device copy: a state of 100,000 small tensors
# would otherwise pay an allocation and a copy launch for each.
SHARED_BELOW = 1 << 20
_SHARED_ALIGN = 64  # a shared allocation starts at a file offset aligned to this


@dataclass(frozen=True)
class _Piece:
    index: int  # manifest record
    at: int  # offset in the record's bytes
    file_offset: int
    length: int


def _chunks(records: list[tuple[int, TensorRecord]], slot: int) -> Iterator[list[_Piece]]:
    """The records' bytes in file order, cut into chunks that each lie within
    `slot` bytes of the file (with the padding between tensors)."""
    chunk: list[_Piece] = []
    start = 0
    for i, r in sorted(records, key=lambda x: x[1].offset):
        at = 0
        while at < r.length:
            offset = r.offset + at  # records' offsets are the file's
            if chunk and offset - start >= slot:
                yield chunk
                chunk = []
            if not chunk:
                start = offset
            n = min(r.length - at, start + slot - offset)
            chunk.append(_Piece(i, at, offset, n))
            at += n
    if chunk:
        yield chunk


class _Ring:
    """SLOTS host buffers of `slot` bytes; a slot is handed out again once the
    copies out of it have finished."""

    def __init__(self, device: torch.device, slot: int) -> None:
        self.device = device
        pin = device.type == "cuda"
        self.buffers = [torch.empty(slot, dtype=torch.uint8, pin_memory=pin)
                        for _ in range(SLOTS)]
        self.views = [memory_of(b) for b in self.buffers]  # the ring keeps them alive
        self.done: list[Any] = [None] * SLOTS  # a CUDA event per slot in use
        self.turn = 0

    def take(self) -> int:
        k = self.turn
        self.turn = (k + 1) % SLOTS
        self._wait(k)
        return k

    def _wait(self, k: int) -> None:
        if self.done[k] is not None:
            self.done[k].synchronize()
            self.done[k] = None

    def copied(self, k: int) -> None:
        if self.device.type == "cuda":
            event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            event.record(torch.cuda.current_stream(self.device))
            self.done[k] = event

    def drain(self) -> None:
        for k in range(SLOTS):
            self._wait(k)


def read_to_device(path: Path, manifest: Manifest, engine: Engine, device: torch.device, *,
                   verify: bool, ring_bytes: int,
                   dests: Mapping[int, torch.Tensor] | None = None) -> list[torch.Tensor]:
    """Every stored tensor, on `device`, in manifest order, through a ring of
    ring_bytes of host memory; raises as checkpoint.read_tensors does.
    dests: record -> a contiguous tensor on `device` of its dtype and shape
    (load's into=) that the record is copied into instead of a new one."""
    dests = dests or {}
    slot = max(1, ring_bytes // SLOTS)
    ring = _Ring(device, slot)
    result: list[torch.Tensor | None] = [None] * len(manifest.tensors)
    try:
        for f, indices in records_by_file(manifest):
            check_size(path, f)
            records = [manifest.tensors[i] for i in indices]
            check_against_header(path, f, records, verify=verify)
            _read_file(path, f, list(zip(indices, records, strict=True)), engine, ring, device,
                       verify, result, dests)
    finally:
        ring.drain()  # no copy may still read a buffer that is freed
    assert all(t is not None for t in result)  # every record belongs to one listed file
    return result  # type: ignore[return-value]


def _read_file(path: Path, f: FileRecord, records: list[tuple[int, TensorRecord]],
               engine: Engine, ring: _Ring, device: torch.device, verify: bool,
               result: list[torch.Tensor | None], dests: Mapping[int, torch.Tensor]) -> None:
    by_index = dict(records)
    flat: dict[int, torch.Tensor] = {}  # a tensor of its own, as bytes, by record
    for i, r in records:
        if i in dests:
            result[i], flat[i] = dests[i], dests[i].reshape(-1).view(torch.uint8)
        elif not r.length:  # nothing to read
            result[i] = torch.empty(r.shape, dtype=dtypes.from_name(r.dtype), device=device)
    crcs: dict[int, list[tuple[int, int]]] = {i: [] for i, _ in records}
    for chunk in _chunks(records, len(ring.views[0])):
        k = ring.take()
        view, start = ring.views[k], chunk[0].file_offset
        segments = [(view[p.file_offset - start:p.file_offset - start + p.length],
                     p.file_offset) for p in chunk]
        size = chunk[-1].file_offset + chunk[-1].length - start
        with read_errors(path, f):
            out = engine.read_file(str(path / f.name), segments, checksum=verify,
                                   region=(view[:size], start))
        host = ring.buffers[k]
        for run in _runs(chunk, by_index, dests):
            if len(run) > 1:
                _copy_shared(run, by_index, host, start, device, result)
                continue
            p = run[0]
            if p.index not in flat:
                r = by_index[p.index]
                t = torch.empty(r.shape, dtype=dtypes.from_name(r.dtype), device=device)
                result[p.index], flat[p.index] = t, t.reshape(-1).view(torch.uint8)
            pos = p.file_offset - start
            flat[p.index][p.at:p.at + p.length].copy_(host[pos:pos + p.length],
                                                       non_blocking=True)
        if verify:
            assert out.crcs is not None
            for j, p in enumerate(chunk):
                crcs[p.index].append((out.crcs[j], p.length))
        ring.copied(k)
    if verify:
        actual = {i: combine(crcs[i]) for i, _ in records}  # an empty tensor's: 0
        raise_for([Mismatch(f.name, r.name, r.crc32c, actual[i])
                   for i, r in records if actual[i] != r.crc32c], str(path))


def _runs(chunk: list[_Piece], by_index: dict[int, TensorRecord],
          dests: Mapping[int, torch.Tensor]) -> Iterator[list[_Piece]]:
    """The chunk's pieces in order: runs of consecutive small whole tensors
    (which can share a device allocation), every other piece (and every piece
    of a tensor with a destination of its own) alone."""
    run: list[_Piece] = []
    for p in chunk:
        r = by_index[p.index]
        # (a view at its file offset must be aligned to its element size)
        if p.length == r.length < SHARED_BELOW and p.index not in dests and \
                not p.file_offset % dtypes.from_name(r.dtype).itemsize:
            run.append(p)
            continue
        if run:
            yield run
            run = []
        yield [p]
    if run:
        yield run


def _copy_shared(run: list[_Piece], by_index: dict[int, TensorRecord], host: torch.Tensor,
                 start: int, device: torch.device, result: list[torch.Tensor | None]) -> None:
    """Small tensors that lie together in the file: one device allocation and
    one copy for all, each tensor a view of it at its place in the file. A
    tensor kept alive keeps the allocation (at most a ring slot) with it."""
    base = run[0].file_offset - run[0].file_offset % _SHARED_ALIGN  # keeps alignment
    end = run[-1].file_offset + run[-1].length
    shared = torch.empty(end - base, dtype=torch.uint8, device=device)
    first = run[0].file_offset
    shared[first - base:].copy_(host[first - start:end - start], non_blocking=True)
    for p in run:
        r = by_index[p.index]
        at = p.file_offset - base
        result[p.index] = shared[at:at + p.length].view(dtypes.from_name(r.dtype)).view(r.shape)


def enabled(map_location: Any, manifest: Manifest, ring_bytes: int) -> torch.device | None:
    """The device a load should ring its tensors to, or None (the usual way):
    raw files only, a ring, and one CUDA device: map_location's, or with
    map_location=None the one most of the bytes were saved from (tensors
    saved elsewhere, such as a CPU RNG state, are moved there by the factory
    as usual)."""
    if ring_bytes <= 0 or manifest.globals is not None or any(
            r.frames is not None for r in manifest.tensors):
        return None
    if map_location is None:
        # Walking the tree costs ~2 us a tensor: not where no GPU could take it.
        return _saved_accelerator(manifest) if torch.cuda.is_available() else None
    if not isinstance(map_location, (str, torch.device)):
        return None
    try:
        device = torch.device(map_location)
    except (RuntimeError, TypeError):
        return None
    return _usable(device)


def _usable(device: torch.device) -> torch.device | None:
    """`device` if it is a CUDA device this process has; else None, and the
    usual load says what is wrong (a CUDA checkpoint on a machine without)."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    return device if (device.index or 0) < torch.cuda.device_count() else None


def _saved_accelerator(manifest: Manifest) -> torch.device | None:
    by_device: dict[str, int] = {}
    for n in state.tree_nodes(manifest.tree):
        e = n.get("e")
        if n.get("t") == "tensor" and isinstance(e, int) and 0 <= e < len(manifest.tensors):
            where = "cpu" if "np" in n else str(n.get("device", "cpu"))
            by_device[where] = by_device.get(where, 0) + manifest.tensors[e].length
    accelerators = [d for d in by_device if d != "cpu"]
    if len(accelerators) != 1 or by_device[accelerators[0]] < by_device.get("cpu", 0):
        return None
    try:
        device = torch.device(accelerators[0])
    except (RuntimeError, TypeError):
        return None  # the factory names it
    return _usable(device)
