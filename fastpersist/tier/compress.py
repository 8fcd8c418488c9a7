"""Compressing a raw checkpoint on its way to the store (tier_compression="zstd").

Each local data file (safetensors) becomes one packed object, NAME.fpz, the
same bytes a local save with compression="zstd" writes (format/packed_file.py,
codec/): its tensors of MIN_ENCODED_BYTES or more byte-grouped and
zstd-compressed in frames of FASTPERSIST_FRAME_BYTES, smaller ones raw. The
remote manifest is the local one with these files' records and the tensors'
encoding, offsets, stored lengths and frame indexes; everything else (tree,
globals, CRC32Cs of the raw bytes) is unchanged, and it is validated before
it is written.

Memory stays bounded: a file is read from disk a batch of frames at a time
(FASTPERSIST_CODEC_THREADS x 2 frames, at most 64 MiB), the batch is encoded
in parallel on the codec's threads, and the stored bytes are streamed out as
multipart parts of FASTPERSIST_TIER_PART_BYTES, FASTPERSIST_TIER_CONCURRENCY
in flight, while the next batch is encoded. The packed header, which holds
every stored length, is only known at the end: the first part (the header
and the first part's worth of stored bytes) is kept in memory and sent last;
S3 assembles parts by number, not by arrival. A file of less than two
parts of stored bytes is a single put.

An upload a killed uploader left open is taken up where it stopped (parts.py).

The raw bytes read are checked against the local manifest's CRC32Cs as they
are encoded (combined from the frames'): a file corrupted on the local disk
is refused (checked.LocalCorruption, naming the file and tensor), never
laundered into frames with fresh CRCs.

Torch-free (numpy and zstandard through codec/): the daemon imports this.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

from ..checksum import combine
from ..codec.frames import checksum, cut, encode_tensors
from ..codec.packing import file_order
from ..format import packed_file
from ..format.frames import RAW, ZSTD_BYTEGROUP, Frame
from ..format.manifest import FileRecord, Manifest, TensorRecord
from ..format.safetensors_file import DATA_FILE_METADATA
from ..knobs import current as current_knobs
from .checked import LocalCorruption
from .client import S3
from .parts import PartStream
from .url import TierURL

_BATCH_BYTES = 64 << 20


def packed_name(name: str) -> str:
    stem = name.removesuffix(".safetensors")
    return stem + packed_file.SUFFIX


def _pread(fd: int, offset: int, n: int, where: str) -> bytes:
    data = os.pread(fd, n, offset)
    if len(data) != n:
        raise LocalCorruption(f"{where}: the file ends before byte {offset + n}; not uploaded",
                              file=where.rpartition("/")[2])
    return data


def _upload_file(s3: S3, url: TierURL, fd: int, f: FileRecord,
                 records: list[TensorRecord], metadata: dict[str, str],
                 pool: ThreadPoolExecutor, where: str
                 ) -> tuple[FileRecord, list[TensorRecord], int]:
    """Compress and upload one local data file; its new records, and the bytes
    an interrupted upload had sent already (not sent again)."""
    name = packed_name(f.name)
    small, big = file_order(records, lambda r: r.length, lambda r: r.dtype)
    k = current_knobs()
    frame_bytes = k.frame_bytes
    batch_frames = max(2, min(2 * k.codec_threads, _BATCH_BYTES // frame_bytes))
    stream = PartStream(s3, url, name, metadata, pool)
    stored: dict[str, tuple[int, tuple[Frame, ...] | None]] = {}  # name -> length, frames
    try:
        for r in small:
            data = _pread(fd, r.offset, r.length, f"{where}/{f.name}")
            if checksum(data) != r.crc32c:
                raise LocalCorruption(f"{where}: tensor {r.name!r} in {f.name} is corrupt on "
                                      "the local disk (does not match its CRC32C); not "
                                      "uploaded (`fpctl verify` it)", file=f.name, tensor=r.name)
            stream.write(data)
            stored[r.name] = (r.length, None)
        jobs = [(r, off, n) for r in big for off, n in cut(r.length, frame_bytes)]
        frames: dict[str, list[Frame]] = {r.name: [] for r in big}
        raw_crcs: dict[str, list[tuple[int, int]]] = {r.name: [] for r in big}
        for i in range(0, len(jobs), batch_frames):
            batch = jobs[i:i + batch_frames]
            raw = [memoryview(_pread(fd, r.offset + off, n, f"{where}/{f.name}"))
                   for r, off, n in batch]
            encoded = encode_tensors([(m, r.dtype) for m, (r, _, _) in zip(raw, batch,
                                                                             strict=True)],
                                     frame_bytes)
            for (r, off, n), e in zip(batch, encoded, strict=True):
                (fr,), (part,) = e.frames, e.parts
                mine = frames[r.name]
                at = mine[-1].stored_offset + mine[-1].stored_length if mine else 0
                mine.append(Frame(off, n, at, fr.stored_length, fr.crc32c))
                raw_crcs[r.name].append((e.crc32c, n))
                stream.write(part)
        for r in big:
            if combine(raw_crcs[r.name]) != r.crc32c:
                raise LocalCorruption(f"{where}: tensor {r.name!r} in {f.name} is corrupt on "
                                      "the local disk (does not match its CRC32C); not "
                                      "uploaded (`fpctl verify` it)", file=f.name, tensor=r.name)
            mine = frames[r.name]
            stored[r.name] = (mine[-1].stored_offset + mine[-1].stored_length, tuple(mine))
        order = small + big
        lay = packed_file.layout([packed_file.PackedEntry(
            r.name, r.dtype, r.shape, stored[r.name][0],
            RAW if stored[r.name][1] is None else ZSTD_BYTEGROUP) for r in order],
            DATA_FILE_METADATA)
        stream.finish(lay.header)
    except BaseException:
        stream.abort()
        raise
    placed = {}
    for r, off in zip(order, lay.offsets, strict=True):
        length, index = stored[r.name]
        placed[r.name] = replace(r, file=name, offset=off) if index is None else replace(
            r, file=name, offset=off, encoding=ZSTD_BYTEGROUP, stored_length=length,
            frames=index)
    return (FileRecord(name, lay.size, lay.data_start, checksum(lay.header)),
            [placed[r.name] for r in records], stream.kept)


def upload_compressed(s3: S3, url: TierURL, manifest: Manifest,
                      files: list[tuple[str, int, int]], metadata: dict[str, str],
                      where: str) -> tuple[bytes, int]:
    """Upload every data file of a raw checkpoint (open as `files`: name,
    fd, size) compressed; returns the remote manifest's bytes (not yet
    written) and the bytes sent (not those an interrupted upload had sent)."""
    fds = {name: fd for name, fd, _ in files}
    by_file: dict[str, list[int]] = {f.name: [] for f in manifest.files}
    for i, t in enumerate(manifest.tensors):
        by_file[t.file].append(i)
    tensors: list[TensorRecord | None] = [None] * len(manifest.tensors)
    new_files = []
    kept = 0
    with ThreadPoolExecutor(s3.concurrency, thread_name_prefix="fp-tier-part") as pool:
        for f in manifest.files:
            records = [manifest.tensors[i] for i in by_file[f.name]]
            new_file, new_records, kept_here = _upload_file(s3, url, fds[f.name], f, records,
                                                            metadata, pool, where)
            kept += kept_here
            new_files.append(new_file)
            for i, r in zip(by_file[f.name], new_records, strict=True):
                tensors[i] = r
    assert all(t is not None for t in tensors)
    remote = replace(manifest, files=tuple(new_files),
                     tensors=tuple(t for t in tensors if t is not None))
    data = remote.to_json()
    Manifest.from_json(data, f"the manifest made for {url}")  # valid, as any reader will check
    return data, sum(f.size for f in new_files) - kept
