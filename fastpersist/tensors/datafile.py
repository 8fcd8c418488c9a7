"""Writing and reading one data file through an engine.

A data file holds StoredTensors in a safetensors layout (see
format/safetensors_file.py): larger element sizes first, so that every
tensor's offset is a multiple of its element size, as safetensors' own writer
arranges. This module turns tensors into engine segments and engine results
into manifest records; the engine does the I/O.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import weakref
from dataclasses import dataclass

import torch

from .. import gcpause
from ..anonmem import anonymous, loads_bounce
from ..checksum import block_spans, combine
from ..engine import Engine, IOResult, Segment
from ..format import dtypes, safetensors_file
from ..format.manifest import FileRecord, TensorRecord
from ..knobs import ALIGNMENT
from .mismatch import Mismatch, mismatches_of
from .plan import StoredTensor, memory_of

METADATA = safetensors_file.DATA_FILE_METADATA


@dataclass(frozen=True)
class FileLayout:
    """Where each tensor of a data file goes: `order` is the file order and
    `layout.offsets[i]` the file offset of `order[i]`."""

    order: list[StoredTensor]
    layout: safetensors_file.Layout

    @property
    def data_bytes(self) -> int:
        return self.layout.size - self.layout.data_start


def file_order(tensors: list[StoredTensor]) -> list[StoredTensor]:
    """The order of `tensors` in their data file: larger elements first, else
    as given (a stable sort). The data section holds them back to back in it."""
    return sorted(tensors, key=_larger_elements_first)


def _larger_elements_first(t: StoredTensor) -> int:
    return -dtypes.itemsize(t.dtype)


def plan_file(tensors: list[StoredTensor], metadata: dict[str, str] = METADATA) -> FileLayout:
    order = file_order(tensors)
    lay = safetensors_file.layout(
        [safetensors_file.HeaderEntry(t.name, t.dtype, t.shape, t.nbytes) for t in order],
        metadata,
    )
    return FileLayout(order, lay)


def write(engine: Engine, directory: str, file_name: str, tensors: list[StoredTensor],
          metadata: dict[str, str] = METADATA) -> tuple[FileRecord, list[TensorRecord]]:
    """Write tensors to directory/file_name, a new file; durable (fsynced) on
    return. metadata: the header's "__metadata__" (a checkpoint's data files
    have METADATA; fpctl restore writes its own)."""
    file_record, records, _ = write_in_blocks(engine, directory, file_name, tensors, 0, metadata)
    return file_record, records


def write_in_blocks(engine: Engine, directory: str, file_name: str,
                    tensors: list[StoredTensor], block: int,
                    metadata: dict[str, str] = METADATA
                    ) -> tuple[FileRecord, list[TensorRecord], list[list[int]]]:
    """write(), and also the CRC32C of each `block`-sized piece of each tensor
    (block_spans; in the order of `tensors`), for readers that verify part of
    a tensor (the DCP reader's resharding). The engine computes every CRC in
    the same pass as the write; a tensor's whole CRC is combined from them."""
    with gcpause.paused():  # bookkeeping of many small objects (not the I/O below)
        plan = plan_file(tensors, metadata)
        lay = plan.layout
        # Device tensors are copied to the host here, one file at a time; async
        # saves stage them into pinned memory beforehand instead.
        sources = [t.source if t.source.device.type == "cpu" else t.source.cpu()
                   for t in plan.order]
        spans = [block_spans(t.nbytes, block) for t in plan.order]
        segments: list[Segment] = [(lay.header, 0)]
        for src, off, pieces in zip(sources, lay.offsets, spans, strict=True):
            memory = memory_of(src)
            segments += [(memory[a:a + n], off + a) for a, n in pieces]
    result = engine.write_file(os.path.join(directory, file_name), segments, lay.size)
    del segments, sources
    assert result.crcs is not None
    with gcpause.paused():
        crcs = iter(result.crcs[1:])
        records: dict[str, tuple[TensorRecord, list[int]]] = {}
        for t, off, pieces in zip(plan.order, lay.offsets, spans, strict=True):
            blocks = [next(crcs) for _ in pieces]
            whole = blocks[0] if len(blocks) == 1 else combine(
                [(c, n) for c, (_, n) in zip(blocks, pieces, strict=True)])
            records[t.name] = (TensorRecord(t.name, file_name, off, t.nbytes, t.dtype, t.shape,
                                            whole), blocks)
        file_record = FileRecord(name=file_name, size=lay.size, data_start=lay.data_start,
                                 header_crc32c=result.crcs[0])
        # Manifest order follows the state, not the file, so inspect reads naturally.
        in_order = [records[t.name] for t in tensors]
        return file_record, [r for r, _ in in_order], [b for _, b in in_order]


def phase_aligned(nbytes: int, offset: int) -> memoryview:
    """Writable memory of `nbytes` whose address has the phase (mod 4096) of
    file offset `offset`, so that O_DIRECT reads land in it in place (see
    _empty_for_read); the view keeps its anonymous mapping alive."""
    shift = offset % ALIGNMENT
    if nbytes == 0:
        return memoryview(bytearray())
    return memoryview(anonymous(nbytes + shift, huge=True))[shift:shift + nbytes]


# Tensors at least this large are allocated so that O_DIRECT can read straight
# into them (see _empty_for_read); smaller ones are cheaper to bounce.
_IN_PLACE_MIN = 1 << 20


def _empty_for_read(record: TensorRecord) -> torch.Tensor:
    """An empty CPU tensor for `record` whose memory has the same alignment
    phase (address mod 4096) as its bytes in the file.

    The engine reads such a tensor in place with O_DIRECT instead of through a
    bounce buffer, which saves a memory copy and measured ~1.5x faster loads
    here. The memory is an anonymous mapping that the tensor keeps alive; the
    tensor's storage is exactly its bytes.
    """
    dtype = dtypes.from_name(record.dtype)
    if record.length < _IN_PLACE_MIN:
        return torch.empty(record.shape, dtype=dtype)
    shift = record.offset % ALIGNMENT
    backing = anonymous(record.length + shift, huge=True)
    flat = torch.frombuffer(backing, dtype=dtype, offset=shift,
                            count=record.length // dtype.itemsize)
    return flat.view(record.shape)


# Smaller tensors are carved out of shared blocks ("arenas") of at most this
# many bytes, each mapped with its pages already in (MAP_POPULATE): one system
# call instead of a page fault or two per tensor, which was most of the time of
# allocating 100,000 small tensors here. Each tensor still has a storage of its
# own (exactly its bytes); a block's memory goes back to the OS when the last
# tensor in it is freed.
_ARENA_BYTES = 4 << 20
_ARENA_ALIGN = 64  # as torch's CPU allocator aligns
_ARENA_FLAGS = mmap.MAP_PRIVATE | getattr(mmap, "MAP_POPULATE", 0)


def empties_for_read(records: list[TensorRecord]
                     ) -> tuple[list[torch.Tensor], list[memoryview]]:
    """New CPU tensors for `records`, in order, and a writable byte view of
    each (for the engine): large ones as _empty_for_read makes them, small
    ones from arenas."""
    out: list[torch.Tensor | None] = [None] * len(records)
    views: list[memoryview | None] = [None] * len(records)
    pending: list[tuple[int, TensorRecord, int]] = []  # (index, record, offset in arena)
    used = 0
    for i, r in enumerate(records):
        if r.length >= _IN_PLACE_MIN or r.length == 0:
            out[i] = t = _empty_for_read(r)
            views[i] = memory_of(t)
            continue
        start = -(-used // _ARENA_ALIGN) * _ARENA_ALIGN
        if pending and start + r.length > _ARENA_BYTES:
            _carve(mmap.mmap(-1, used, flags=_ARENA_FLAGS), pending, out, views)
            pending, start = [], 0
        pending.append((i, r, start))
        used = start + r.length
    if pending:
        _carve(mmap.mmap(-1, used, flags=_ARENA_FLAGS), pending, out, views)
    return out, views  # type: ignore[return-value]  # every index was filled


def _carve(buffer: mmap.mmap, pending: list[tuple[int, TensorRecord, int]],
           out: list[torch.Tensor | None], views: list[memoryview | None], *,
           give_back: bool = False) -> None:
    """For each (index, record, start): a tensor over buffer[start:start +
    length] into out[index] and a writable view of those bytes into
    views[index]. give_back: tensors of at least _GIVE_BACK_MIN bytes give
    their pages back when freed (see _owner)."""
    whole = memoryview(buffer)
    torch_dtypes: dict[str, torch.dtype] = {}
    frombuffer = torch.frombuffer
    for i, r, start in pending:
        dtype = torch_dtypes.get(r.dtype) or torch_dtypes.setdefault(
            r.dtype, dtypes.from_name(r.dtype))
        if give_back and r.length >= _GIVE_BACK_MIN:
            t = frombuffer(_owner(buffer, start, r.length), dtype=dtype)
        else:
            t = frombuffer(buffer, dtype=dtype, offset=start, count=r.length // dtype.itemsize)
        out[i] = t if len(r.shape) == 1 else t.view(r.shape)
        views[i] = whole[start : start + r.length]


def read(engine: Engine, directory: str, file: FileRecord, records: list[TensorRecord],
         *, verify: bool, header: bool = True) -> tuple[list[torch.Tensor], list[Mismatch]]:
    """Read the given tensors of one file into new CPU tensors.

    With verify, every tensor (and the header, unless header=False) is checked
    against its CRC32C and the mismatches returned; the caller decides whether
    to raise. Raises EOFError when the file is shorter than the records need.
    """
    pending = start_read(directory, file, records, verify=verify, header=header)
    return finish_read(pending, run_read(engine, pending))


def run_read(engine: Engine, pending: PendingRead) -> IOResult:
    """The engine's read of a started read (any thread; releases the GIL)."""
    return engine.read_file(pending.path, pending.segments, checksum=pending.verify,
                            region=pending.region, bounce=pending.bounce)


@dataclass
class PendingRead:
    """A read of one file's tensors, split so that the engine's call (which
    releases the GIL) can run on another thread: start_read allocates the
    tensors and makes the segments, the engine reads `segments` of `path`
    (with checksums if `verify`), finish_read compares the CRCs."""

    path: str
    file: FileRecord
    records: list[TensorRecord]
    tensors: list[torch.Tensor]
    segments: list[Segment]
    verify: bool
    with_header: bool  # segments[0] is the file's header (its CRC32C checked if verify)
    region: Segment | None = None  # the engine's region hint (see start_read)
    bounce: bool = False  # the engine's bounce hint (see start_read)

    def take_header(self) -> bytes:
        """The header bytes read with the file (before finish_read). A region
        gives back the pages that held them: no tensor lies before data_start."""
        assert self.with_header
        data = bytes(self.segments[0][0])
        if self.region is not None:
            self.region[0].madvise(mmap.MADV_DONTNEED, 0, len(data) // ALIGNMENT * ALIGNMENT)
        return data


def start_read(directory: str, file: FileRecord, records: list[TensorRecord], *,
               verify: bool, header: bool = True) -> PendingRead:
    """Allocate the tensors for a read of `records` of `file` and make the
    engine's segments (the header's first, if `header`).

    A read of most of a file's bytes (a load) puts the file into one mapping
    laid out as the file, each tensor a view of it, and hands the mapping to
    the engine as its region: the engine then reads the file with block-sized
    O_DIRECT reads straight into place, with no bounce copies and no small
    reads at tensor boundaries. The mapping is unmapped when the last tensor
    of the file is freed; a tensor of at least _GIVE_BACK_MIN bytes gives its
    own pages back to the OS when it is freed (see _owner).

    Where anonmem.loads_bounce(), the engine reads all of it through its
    bounce buffers and copies the bytes into the new memory (bounce hint).
    """
    with_header = header
    header_bytes = file.data_start if with_header else 0
    span = region_span(records, header_bytes)
    region: Segment | None = None
    if span is None:
        tensors, views = empties_for_read(records)
        segments: list[Segment] = [(bytearray(header_bytes), 0)] if with_header else []
    else:
        mapping, tensors, views = _empties_in_region(records, *span)
        region = (mapping, span[0])
        segments = [(memoryview(mapping)[:header_bytes], 0)] if with_header else []
    segments += [(v, r.offset) for v, r in zip(views, records, strict=True)]
    return PendingRead(os.path.join(directory, file.name), file, records, tensors, segments,
                       verify, with_header, region, loads_bounce())


# A read whose bytes fill at least this share of their span reads the span
# into one mapping (start_read); sparser reads allocate tensor by tensor.
_REGION_MIN_FILL = 0.5


def region_span(records: list[TensorRecord], header_bytes: int) -> tuple[int, int] | None:
    """The page-aligned file span [lo, hi) of start_read's mapping, or None."""
    if not records:
        return None
    lo = 0 if header_bytes else min(r.offset for r in records)
    hi = max(r.offset + r.length for r in records)
    filled = header_bytes + sum(r.length for r in records)
    if not filled or filled < _REGION_MIN_FILL * (hi - lo):
        return None
    return lo // ALIGNMENT * ALIGNMENT, -(-hi // ALIGNMENT) * ALIGNMENT


# Tensors of at least this many bytes in a region give their pages back when
# freed, so that keeping one tensor of a loaded file does not keep the file's
# memory: a load followed by optimizer.load_state_dict keeps the optimizer's
# tensors and frees the model's. (Smaller ones would cost more in bookkeeping
# than they hold; their pages go with the mapping.)
_GIVE_BACK_MIN = 256 << 10


def _owner(mapping: mmap.mmap, start: int, length: int) -> ctypes.Array[ctypes.c_ubyte]:
    """A buffer over mapping[start:start + length] that torch keeps alive for
    exactly as long as the tensor made from it has storage; when it dies the
    pages wholly inside it are given back (the pages at its ends may hold
    neighbours' bytes and go with the mapping)."""
    owner = (ctypes.c_ubyte * length).from_buffer(mapping, start)
    first = -(-start // ALIGNMENT) * ALIGNMENT
    last = (start + length) // ALIGNMENT * ALIGNMENT
    if last > first:
        weakref.finalize(owner, mapping.madvise, mmap.MADV_DONTNEED, first,
                         last - first).atexit = False
    return owner


def _empties_in_region(records: list[TensorRecord], lo: int, hi: int
                       ) -> tuple[mmap.mmap, list[torch.Tensor], list[memoryview]]:
    """A mapping for file bytes [lo, hi) and, for each record, a tensor over
    its bytes there and a writable view of them. A record whose offset is not a
    multiple of its element size (not something this writer makes) gets memory
    of its own, as empties_for_read makes it, so no tensor is misaligned."""
    mapping = anonymous(hi - lo, huge=True)
    out: list[torch.Tensor | None] = [None] * len(records)
    views: list[memoryview | None] = [None] * len(records)
    inside: list[tuple[int, TensorRecord, int]] = []  # (index, record, offset in mapping)
    apart: list[int] = []
    for i, r in enumerate(records):
        start = r.offset - lo
        if r.length == 0 or start % dtypes.itemsize(r.dtype):
            apart.append(i)
        else:
            inside.append((i, r, start))
    _carve(mapping, inside, out, views, give_back=True)
    if apart:
        tensors, own = empties_for_read([records[i] for i in apart])
        for i, t, v in zip(apart, tensors, own, strict=True):
            out[i], views[i] = t, v
    return mapping, out, views  # type: ignore[return-value]  # every index was filled


def finish_read(pending: PendingRead, result: IOResult
                ) -> tuple[list[torch.Tensor], list[Mismatch]]:
    pending.segments = []  # (a memoryview of an arena would keep it from being unmapped)
    pending.region = None
    if not pending.verify:
        return pending.tensors, []
    assert result.crcs is not None
    return pending.tensors, mismatches_of(pending.file, pending.records, pending.with_header,
                                          result.crcs)
