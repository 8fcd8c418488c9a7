"""Writing and reading one data file through an engine.

A data file holds StoredTensors in a safetensors layout (see
format/safetensors_file.py): larger element sizes first, so that every
tensor's offset is a multiple of its element size, as safetensors' own writer
arranges. This module turns tensors into engine segments and engine results
into manifest records; the engine does the I/O.
"""

from __future__ import annotations

import mmap
import os
from dataclasses import dataclass

import torch

from ..engine import Engine, Segment
from ..errors import ChecksumMismatchError
from ..format import dtypes, safetensors_file
from ..format.manifest import FileRecord, TensorRecord
from ..knobs import ALIGNMENT
from .plan import StoredTensor, memory_of

METADATA = {"format": "pt", "producer": "fastpersist"}


@dataclass(frozen=True)
class FileLayout:
    """Where each tensor of a data file goes: `order` is the file order and
    `layout.offsets[i]` the file offset of `order[i]`."""

    order: list[StoredTensor]
    layout: safetensors_file.Layout

    @property
    def data_bytes(self) -> int:
        return self.layout.size - self.layout.data_start


def plan_file(tensors: list[StoredTensor]) -> FileLayout:
    order = sorted(tensors, key=lambda t: -dtypes.itemsize(t.dtype))  # stable
    lay = safetensors_file.layout(
        [safetensors_file.HeaderEntry(t.name, t.dtype, t.shape, t.nbytes) for t in order],
        METADATA,
    )
    return FileLayout(order, lay)


def write(engine: Engine, directory: str, file_name: str, tensors: list[StoredTensor]
          ) -> tuple[FileRecord, list[TensorRecord]]:
    """Write tensors to directory/file_name; durable (fsynced) on return."""
    plan = plan_file(tensors)
    lay = plan.layout
    # Device tensors are copied to the host here, one file at a time; async
    # saves stage them into pinned memory beforehand instead.
    sources = [t.source if t.source.device.type == "cpu" else t.source.cpu() for t in plan.order]
    segments: list[Segment] = [(lay.header, 0)]
    segments += [(memory_of(src), off) for src, off in zip(sources, lay.offsets, strict=True)]
    result = engine.write_file(os.path.join(directory, file_name), segments, lay.size)
    assert result.crcs is not None
    records = {
        t.name: TensorRecord(name=t.name, file=file_name, offset=off, length=t.nbytes,
                             dtype=t.dtype, shape=t.shape, crc32c=crc)
        for t, off, crc in zip(plan.order, lay.offsets, result.crcs[1:], strict=True)
    }
    file_record = FileRecord(name=file_name, size=lay.size, data_start=lay.data_start,
                             header_crc32c=result.crcs[0])
    # Manifest order follows the state, not the file, so inspect reads naturally.
    return file_record, [records[t.name] for t in tensors]


@dataclass(frozen=True)
class Mismatch:
    file: str
    tensor: str  # "<header>" for the safetensors header
    expected: int
    actual: int
    frame: int | None = None  # a compressed tensor's frame, whose stored bytes are wrong

    def what(self) -> str:
        if self.tensor == "<header>":
            return "the safetensors header" if self.file.endswith(".safetensors") else (
                "the packed header")
        return f"tensor {self.tensor!r}" + (
            f" (stored frame {self.frame})" if self.frame is not None else "")


def phase_aligned(nbytes: int, offset: int) -> memoryview:
    """Writable memory of `nbytes` whose address has the phase (mod 4096) of
    file offset `offset`, so that O_DIRECT reads land in it in place (see
    _empty_for_read); the view keeps its anonymous mapping alive."""
    shift = offset % ALIGNMENT
    if nbytes == 0:
        return memoryview(bytearray())
    return memoryview(mmap.mmap(-1, nbytes + shift))[shift:shift + nbytes]


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
    backing = mmap.mmap(-1, record.length + shift)
    flat = torch.frombuffer(backing, dtype=dtype, offset=shift,
                            count=record.length // dtype.itemsize)
    return flat.view(record.shape)


def read(engine: Engine, directory: str, file: FileRecord, records: list[TensorRecord],
         *, verify: bool, header: bool = True) -> tuple[list[torch.Tensor], list[Mismatch]]:
    """Read the given tensors of one file into new CPU tensors.

    With verify, every tensor (and the header, unless header=False) is checked
    against its CRC32C and the mismatches returned; the caller decides whether
    to raise. Raises EOFError when the file is shorter than the records need.
    """
    tensors = [_empty_for_read(r) for r in records]
    with_header = verify and header
    segments: list[Segment] = [(bytearray(file.data_start), 0)] if with_header else []
    segments += [(memory_of(t), r.offset) for t, r in zip(tensors, records, strict=True)]
    result = engine.read_file(os.path.join(directory, file.name), segments, checksum=verify)
    mismatches = []
    if verify:
        assert result.crcs is not None
        crcs = result.crcs
        if with_header:
            if crcs[0] != file.header_crc32c:
                mismatches.append(Mismatch(file.name, "<header>", file.header_crc32c, crcs[0]))
            crcs = crcs[1:]
        for r, crc in zip(records, crcs, strict=True):
            if crc != r.crc32c:
                mismatches.append(Mismatch(file.name, r.name, r.crc32c, crc))
    return tensors, mismatches


def raise_for(mismatches: list[Mismatch], where: str) -> None:
    if not mismatches:
        return
    m = mismatches[0]
    more = f" (and {len(mismatches) - 1} more)" if len(mismatches) > 1 else ""
    raise ChecksumMismatchError(
        f"{where}: {m.what()} in {m.file} is corrupt: CRC32C {m.actual:#010x}, expected "
        f"{m.expected:#010x}{more}",
        file=m.file,
        tensor=m.tensor,
    )
