"""A packed file of one tensor too large to encode whole under the staging budget.

packed.write encodes a file's tensors first and writes every stored frame at
once, so it holds the file's encoded bytes until the write: with a staging
budget B, files are cut at B/3 for that (saving/local.cut), but a single
tensor larger than the cut gets a file of its own and was encoded whole (a
256 MiB tensor held about 250 MiB of frames against B = 64 MiB). Here such a
file is written as it is encoded, a batch of frames at a time (one frame per
codec thread, twice over), and its header last: the header's padded length,
and so where the data starts, is the same for every stored length the
tensor's frames can reach (checked, else the caller encodes it whole), so
the frames can go to their places before their total is known. The file is
byte for byte the one packed.write would write.

The batches go through the page cache (os.pwrite) and the file is fsynced
at the end: the engine writes a file from one list of segments, known in
full at its call. Compression is CPU-bound here, well under the disk's speed.
"""

from __future__ import annotations

import os

import torch

from ..checksum import crc32c, crc32c_combine
from ..codec.frames import encode_tensors
from ..format import packed_file
from ..format.frames import MIN_ENCODED_BYTES, ZSTD_BYTEGROUP, Frame
from ..format.manifest import FileRecord, TensorRecord
from ..format.safetensors_file import DATA_FILE_METADATA
from ..knobs import current as current_knobs
from .plan import StoredTensor, memory_of

# Stored bytes of a frame at most (frame.py stores an incompressible frame as it
# is, with a few bytes of framing): the bound that fixes the header's length.
_FRAME_OVERHEAD = 64


def streams(tensors: list[StoredTensor], frame_bytes: int) -> bool:
    """Whether a packed file of `tensors` is written as it is encoded: one
    tensor to encode, over a third of FASTPERSIST_STAGING_BUDGET (the
    compressed cut, local.cut), and a header whose length does not depend
    on how well it compresses."""
    budget = current_knobs().staging_budget
    if not budget or len(tensors) != 1:
        return False
    t = tensors[0]
    if t.nbytes <= max(budget // 3, MIN_ENCODED_BYTES):
        return False
    return _data_start(t, frame_bytes) is not None


def _entry(t: StoredTensor, stored: int) -> packed_file.PackedEntry:
    return packed_file.PackedEntry(t.name, t.dtype, t.shape, stored, ZSTD_BYTEGROUP)


def _data_start(t: StoredTensor, frame_bytes: int) -> int | None:
    frames = -(-t.nbytes // frame_bytes)
    most = t.nbytes + frames * _FRAME_OVERHEAD
    low = packed_file.layout([_entry(t, 0)], DATA_FILE_METADATA)
    high = packed_file.layout([_entry(t, most)], DATA_FILE_METADATA)
    return low.data_start if low.data_start == high.data_start else None


def _raw_bytes(source: torch.Tensor, start: int, end: int) -> memoryview:
    """Bytes start..end of the tensor's memory, on the host (a device tensor's
    batch is copied; the whole tensor never is)."""
    flat = source.reshape(-1).view(torch.uint8)
    part = flat[start:end]
    return memory_of(part if part.device.type == "cpu" else part.cpu())


def write(directory: str, file_name: str, t: StoredTensor, frame_bytes: int
          ) -> tuple[FileRecord, list[TensorRecord]]:
    """Write `t` to directory/file_name as a packed file (streams() said so);
    durable on return."""
    data_start = _data_start(t, frame_bytes)
    assert data_start is not None
    batch = frame_bytes * max(2 * current_knobs().codec_threads, 1)
    frames: list[Frame] = []
    raw_crc, stored_at = 0, 0
    path = os.path.join(directory, file_name)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
    try:
        for start in range(0, t.nbytes, batch):
            end = min(start + batch, t.nbytes)
            encoded = encode_tensors([(_raw_bytes(t.source, start, end), t.dtype)],
                                     frame_bytes)[0]
            for f, part in zip(encoded.frames, encoded.parts, strict=True):
                frames.append(f._replace(raw_offset=start + f.raw_offset,
                                         stored_offset=stored_at + f.stored_offset))
                _pwrite_all(fd, part, data_start + stored_at + f.stored_offset)
            raw_crc = (crc32c_combine(raw_crc, encoded.crc32c, end - start) if start
                       else encoded.crc32c)
            stored_at += encoded.stored_length
        laid = packed_file.layout([_entry(t, stored_at)], DATA_FILE_METADATA)
        assert laid.data_start == data_start  # _data_start's bound held
        _pwrite_all(fd, laid.header, 0)
        os.fsync(fd)
    finally:
        os.close(fd)
    file_record = FileRecord(name=file_name, size=laid.size, data_start=data_start,
                             header_crc32c=crc32c(laid.header))
    record = TensorRecord(name=t.name, file=file_name, offset=data_start, length=t.nbytes,
                          dtype=t.dtype, shape=t.shape, crc32c=raw_crc, encoding=ZSTD_BYTEGROUP,
                          stored_length=stored_at, frames=tuple(frames))
    return file_record, [record]


def _pwrite_all(fd: int, data: bytes | memoryview, offset: int) -> None:
    view = memoryview(data).cast("B")
    while view:
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n
