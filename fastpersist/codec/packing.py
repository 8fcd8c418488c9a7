"""A packed data file planned from raw tensor bytes: encoded, laid out, recorded.

Both writers of packed files use this: the torch side (tensors/packed.py,
in-process saves with compression="zstd") and fastpersistd, which compresses
the staged bytes a client hands it (daemon/writer.py). One plan, so the two
write the same bytes for the same tensors. The caller's engine writes the
plan's segments; records() turns the CRC32Cs the engine computed into the
manifest's records.

Tensors of at least MIN_ENCODED_BYTES are encoded in frames (frames.py, all
frames of the file in parallel); smaller ones are stored raw, first, so each
sits at a multiple of its element size. Within each kind, larger elements go
first, as datafile.py orders a safetensors file.

Torch-free (numpy and zstandard): the daemon imports this.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any, TypeVar

from ..format import dtypes, packed_file
from ..format.frames import MIN_ENCODED_BYTES, RAW, ZSTD_BYTEGROUP
from ..format.manifest import FileRecord, TensorRecord
from ..format.safetensors_file import DATA_FILE_METADATA
from .frames import Copy, Encoded, encode_tensors

T = TypeVar("T")


@dataclass(frozen=True)
class RawTensor:
    """A tensor's bytes as they are in memory, with what the manifest says of it."""

    name: str
    dtype: str  # safetensors' name, e.g. "BF16"
    shape: tuple[int, ...]
    data: Any  # a contiguous buffer of exactly its bytes (memoryview, bytes)

    @property
    def nbytes(self) -> int:
        return memoryview(self.data).nbytes


@dataclass(frozen=True)
class PackedPlan:
    """What to write for one packed file: `segments` (the header first, then
    every raw tensor and every stored frame at its file offset) make a file
    of `size` bytes."""

    name: str
    tensors: tuple[RawTensor, ...]  # as given
    order: tuple[RawTensor, ...]  # file order
    offsets: tuple[int, ...]  # file offset of order[i]
    encoded: dict[str, Encoded]  # by name; a tensor not here is stored raw
    data_start: int
    size: int
    segments: list[tuple[Any, int]]

    def records(self, crcs: Sequence[int]) -> tuple[FileRecord, list[TensorRecord]]:
        """The file's record and its tensors' (in the order given), from the
        engine's CRC32Cs of `segments`: the header's, then the raw tensors'
        (the frames' stored CRC32Cs come from the codec, as do the raw
        CRC32Cs of the encoded tensors, combined from their frames')."""
        raw_crcs = iter(crcs[1:1 + sum(1 for t in self.order if t.name not in self.encoded)])
        out = {}
        for t, off in zip(self.order, self.offsets, strict=True):
            rec = TensorRecord(name=t.name, file=self.name, offset=off, length=t.nbytes,
                               dtype=t.dtype, shape=t.shape, crc32c=0)
            e = self.encoded.get(t.name)
            out[t.name] = (replace(rec, crc32c=next(raw_crcs)) if e is None else
                           replace(rec, crc32c=e.crc32c, encoding=ZSTD_BYTEGROUP,
                                   stored_length=e.stored_length, frames=e.frames))
        file_record = FileRecord(name=self.name, size=self.size, data_start=self.data_start,
                                 header_crc32c=crcs[0])
        return file_record, [out[t.name] for t in self.tensors]


def file_order(items: Sequence[T], nbytes: Callable[[T], int], dtype: Callable[[T], str]
               ) -> tuple[list[T], list[T]]:
    """A packed file's tensors as (stored raw, encoded), each in file order:
    larger elements first, stably, as a safetensors data file orders them.
    The daemon gets a file's tensors in that order, a save in the state's,
    and the tier (tier/compress.py) a manifest's records: all must write the
    same file."""
    by_size = sorted(items, key=lambda t: -dtypes.itemsize(dtype(t)))
    return ([t for t in by_size if nbytes(t) < MIN_ENCODED_BYTES],
            [t for t in by_size if nbytes(t) >= MIN_ENCODED_BYTES])


def plan(name: str, tensors: Sequence[RawTensor], frame_bytes: int,
         copy: Copy | None = None) -> PackedPlan:
    """Encode `tensors` (names unique) and lay out the packed file `name`.
    `copy`: how the encoder reads the tensors' bytes (frames.encode_tensors);
    the ones stored raw stay in `segments` as given, for the engine to read."""
    small, big = file_order(tensors, lambda t: t.nbytes, lambda t: t.dtype)
    encoded = dict(zip((t.name for t in big), encode_tensors(
        [(memoryview(t.data).cast("B"), t.dtype) for t in big], frame_bytes, copy),
        strict=True))
    order = small + big
    entries = [packed_file.PackedEntry(
        t.name, t.dtype, t.shape,
        encoded[t.name].stored_length if t.name in encoded else t.nbytes,
        ZSTD_BYTEGROUP if t.name in encoded else RAW) for t in order]
    lay = packed_file.layout(entries, DATA_FILE_METADATA)
    segments: list[tuple[Any, int]] = [(lay.header, 0)]
    for t, off in zip(order, lay.offsets, strict=True):
        e = encoded.get(t.name)
        if e is None:
            segments.append((t.data, off))
        else:
            segments += [(part, off + fr.stored_offset)
                         for fr, part in zip(e.frames, e.parts, strict=True)]
    return PackedPlan(name, tuple(tensors), tuple(order), tuple(lay.offsets), encoded,
                      lay.data_start, lay.size, segments)


__all__ = ["PackedPlan", "RawTensor", "file_order", "plan"]
