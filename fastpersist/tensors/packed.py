"""Packed data files: tensors compressed with the codec, written and read.

A save with compression="zstd" writes each data file as a packed file
(format/packed_file.py): every tensor of at least MIN_ENCODED_BYTES is
encoded in frames of FASTPERSIST_FRAME_BYTES (codec/frames.py, all frames
of the file in parallel) and recorded with encoding "zstd-bytegroup-v1" and
its frame index; smaller ones are stored raw, as in a safetensors file. The
engine then writes the header, the raw tensors and every frame's stored bytes.

Reading, the engine (or, from the tier, ranged GETs: the caller passes the
reader) reads the stored bytes of the frames wanted, and the
codec checks each frame's CRC32C, decodes the frames in parallel straight
into the new tensor's memory, and (whole tensors, with verify) the tensor's
raw CRC32C is combined from its frames' and checked against the record's,
as for a raw tensor. A partial read (`span`) decodes only the frames that
overlap the span; the rest of the tensor is zeros. The codec (numpy) is
imported only when a packed file is written or read.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from ..engine import Engine, Segment
from ..format import dtypes
from ..format.manifest import FileRecord, TensorRecord
from .datafile import phase_aligned
from .mismatch import Mismatch
from .plan import StoredTensor, memory_of

Span = tuple[int, int]  # raw bytes start..end of a record


def write(engine: Engine, directory: str, file_name: str, tensors: list[StoredTensor],
          frame_bytes: int) -> tuple[FileRecord, list[TensorRecord]]:
    """Write tensors to directory/file_name as a packed file; durable on return."""
    from ..codec import packing  # numpy: only where compression is used
    from . import packed_stream

    if packed_stream.streams(tensors, frame_bytes):  # one tensor too large to hold encoded
        return packed_stream.write(directory, file_name, tensors[0], frame_bytes)

    raws = [packing.RawTensor(t.name, t.dtype, t.shape, memory_of(
        t.source if t.source.device.type == "cpu" else t.source.cpu())) for t in tensors]
    laid = packing.plan(file_name, raws, frame_bytes)
    result = engine.write_file(os.path.join(directory, file_name), laid.segments, laid.size)
    assert result.crcs is not None
    return laid.records(result.crcs)


@dataclass
class Outcome:
    """What reading compressed records found besides their tensors."""

    mismatches: list[Mismatch]
    undecodable: list[str]  # "tensor 'x' in F: frame i: why"
    frames_decoded: int = 0


def _wanted(r: TensorRecord, span: Span | None) -> range:
    """The indices of the frames of `r` that hold bytes of `span` (all: None)."""
    assert r.frames is not None
    if span is None:
        return range(len(r.frames))
    start, end = span
    first = next((i for i, f in enumerate(r.frames) if f.raw_offset + f.raw_length > start),
                 len(r.frames))
    last = first
    while last < len(r.frames) and r.frames[last].raw_offset < end:
        last += 1
    return range(first, last)


StoredReader = Callable[[list[Segment]], None]
"""Fills each (buffer, file offset) with the stored bytes of one data file
there: the engine for a local file (local_reader), ranged GETs for an object
in the tier (tensors/tier_read.py). EOFError when the file is too short."""


def local_reader(engine: Engine, directory: str, file: FileRecord) -> StoredReader:
    path = os.path.join(directory, file.name)

    def read_stored(segments: list[Segment]) -> None:
        engine.read_file(path, segments, checksum=False)

    return read_stored


def read(read_stored: StoredReader, file: FileRecord, records: Sequence[TensorRecord],
         *, verify: bool, spans: Sequence[Span | None] | None = None,
         decode: bool = True) -> tuple[list[torch.Tensor], Outcome]:
    """Read compressed records of one file into new CPU tensors, their stored
    bytes fetched by `read_stored` (local_reader, or the tier's).

    With verify, each frame's stored CRC32C is checked before it is decoded,
    and each whole tensor's raw CRC32C after. decode=False checks the stored
    CRCs only (fpctl verify's quick mode) and returns empty tensors. Raises
    EOFError when the file is shorter than the records need, OSError otherwise.
    """
    from ..checksum import combine
    from ..codec.frames import DecodeJob, decode_frames  # numpy: only here

    spans = spans if spans is not None else [None] * len(records)
    wanted = [_wanted(r, s) for r, s in zip(records, spans, strict=True)]
    stored: list[memoryview] = []
    segments: list[Segment] = []
    for r, frames in zip(records, wanted, strict=True):
        assert r.frames is not None
        if not frames:
            stored.append(memoryview(b""))
            continue
        lo = r.frames[frames[0]].stored_offset
        hi = r.frames[frames[-1]].stored_offset + r.frames[frames[-1]].stored_length
        buf = phase_aligned(hi - lo, r.offset + lo)
        stored.append(buf)
        segments.append((buf, r.offset + lo))
    if segments:
        read_stored(segments)
    tensors, jobs, owners = [], [], []
    for k, (r, frames, span) in enumerate(zip(records, wanted, spans, strict=True)):
        dtype = dtypes.from_name(r.dtype)
        whole = span is None or len(frames) == len(r.frames or ())
        t = torch.empty(r.shape, dtype=dtype) if whole and decode else torch.zeros(
            r.shape if decode else (0,), dtype=dtype)
        tensors.append(t)
        out = memory_of(t) if decode else None
        assert r.frames is not None
        base = r.frames[frames[0]].stored_offset if frames else 0
        for i in frames:
            fr = r.frames[i]
            piece = stored[k][fr.stored_offset - base:fr.stored_offset - base + fr.stored_length]
            target = (out[fr.raw_offset:fr.raw_offset + fr.raw_length] if out is not None
                      else None)
            jobs.append(DecodeJob(piece, r.dtype, target, fr.crc32c if verify else None))
            owners.append((k, i))
    results = decode_frames(jobs, raw_crc=verify and decode)
    outcome = Outcome([], [], frames_decoded=len(jobs) if decode else 0)
    raw_crcs: dict[int, list[tuple[int, int]]] = {}
    for (k, i), res in zip(owners, results, strict=True):
        r = records[k]
        assert r.frames is not None
        fr = r.frames[i]
        if res.bad_stored_crc32c is not None:
            outcome.mismatches.append(Mismatch(file.name, r.name, fr.crc32c,
                                               res.bad_stored_crc32c, frame=i))
        elif res.error is not None:
            outcome.undecodable.append(f"tensor {r.name!r} in {file.name}: frame {i} "
                                       f"cannot be decoded: {res.error}")
        elif res.raw_crc32c is not None:
            raw_crcs.setdefault(k, []).append((res.raw_crc32c, fr.raw_length))
    if verify and decode:
        for k, r in enumerate(records):
            pieces = raw_crcs.get(k, [])
            if len(pieces) == len(r.frames or ()) and len(wanted[k]) == len(pieces):
                actual = combine(pieces) if pieces else 0
                if actual != r.crc32c:
                    outcome.mismatches.append(Mismatch(file.name, r.name, r.crc32c, actual))
    return tensors, outcome


def check_compression(compression: str | None) -> str | None:
    """The `compression` argument of a save, checked: None (raw) or "zstd"."""
    if compression not in (None, "zstd"):
        raise ValueError(f"compression must be None or 'zstd', not {compression!r}")
    return compression
