"""Many tensors' frames, encoded or decoded in parallel, with their checksums.

A tensor's raw bytes are cut into frames of `frame_bytes` (the last one
shorter), each encoded on its own (frame.py), so that a reader decodes only
the frames it needs and all of them at once. Each task also computes the
CRC32C of its frame's stored bytes (what the manifest's frame index records,
and what `fpctl verify` checks without decoding) and of its raw bytes; a
tensor's raw CRC32C, the one a load checks, is combined from its frames'.
The work runs on a pool of FASTPERSIST_CODEC_THREADS threads: zstandard,
numpy and the CRC release the GIL.
"""

from __future__ import annotations

import functools
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import NamedTuple, TypeVar

from ..background import lower_this_thread
from ..checksum import crc32c, crc32c_combine
from ..format.frames import Frame
from ..knobs import current as current_knobs
from . import frame
from .planes import grouping_for

T = TypeVar("T")

# copy(dst, src) -> CRC32C: reads a frame's raw bytes into dst (encode_tensors).
Copy = Callable[[memoryview, memoryview], int]

_pool: ThreadPoolExecutor | None = None
_pool_key = (0, 0)  # (threads, pid): a forked child has none of its parent's threads
_pool_lock = threading.Lock()


def _executor() -> ThreadPoolExecutor:
    global _pool, _pool_key
    key = (current_knobs().codec_threads, os.getpid())
    with _pool_lock:
        if _pool is None or _pool_key != key:
            old = _pool
            # Niced whoever starts them (background.py): mostly the background's work.
            _pool = ThreadPoolExecutor(key[0], thread_name_prefix="fastpersist-codec",
                                       initializer=lower_this_thread)
            if old is not None and _pool_key[1] == key[1]:
                old.shutdown(wait=False)
            _pool_key = key
        return _pool


def run_all(tasks: Sequence[Callable[[], T]]) -> list[T]:
    """Run `tasks` on the codec pool; their results in order. The first
    failure is raised once every task has finished (none is left running on
    memory the caller may free)."""
    if len(tasks) <= 1:
        return [t() for t in tasks]
    futures: list[Future[T]] = [_executor().submit(t) for t in tasks]
    error: BaseException | None = None
    results = []
    for f in futures:
        try:
            results.append(f.result())
        except BaseException as exc:
            error = error or exc
    if error is not None:
        raise error
    return results


def cut(length: int, frame_bytes: int) -> list[tuple[int, int]]:
    """(raw offset, raw length) of each frame of a `length`-byte tensor."""
    return [(off, min(frame_bytes, length - off)) for off in range(0, length, frame_bytes)]


@dataclass(frozen=True)
class Encoded:
    """A tensor in its stored form: `parts[i]` is frame i's stored bytes, at
    frames[i].stored_offset from the tensor's start in the file."""

    frames: tuple[Frame, ...]
    parts: tuple[bytes, ...]
    crc32c: int  # of the raw bytes

    @property
    def stored_length(self) -> int:
        return sum(len(p) for p in self.parts)


_copies = threading.local()


def _private(n: int) -> memoryview:
    """n bytes this thread reuses for a frame's raw bytes (not frame.py's
    scratch, which the planes are split into)."""
    buf: bytearray | None = getattr(_copies, "buf", None)
    if buf is None or len(buf) < n:
        buf = _copies.buf = bytearray(n)
    return memoryview(buf)[:n]


def encode_tensors(tensors: Sequence[tuple[memoryview, str]], frame_bytes: int,
                   copy: Copy | None = None) -> list[Encoded]:
    """Encode each (raw bytes, safetensors dtype) in frames, all in parallel.

    With `copy`, each frame's raw bytes are first copied by it into memory
    of the task's own (it returns their CRC32C, computed on the way), and
    the encoder reads that copy: fastpersistd encodes from a client's shared
    memory, which the client may truncate meanwhile, and only the engine's
    copy survives the fault (SIGBUS becomes its OSError); the split and zstd
    cannot be interrupted safely. One frame per codec thread at a time:
    codec threads x frame_bytes of memory."""
    jobs: list[tuple[int, int, int]] = []  # tensor, raw offset, raw length
    for i, (raw, _) in enumerate(tensors):
        jobs += [(i, off, n) for off, n in cut(len(raw), frame_bytes)]

    def task(i: int, off: int, n: int) -> tuple[bytes, int, int]:
        raw, dtype = tensors[i]
        piece = raw[off:off + n]
        if copy is None:
            raw_crc = crc32c(piece)
        else:
            piece, shared = _private(n), piece
            raw_crc = copy(piece, shared)
        stored = frame.encode(piece, grouping_for(dtype))
        return stored, crc32c(stored), raw_crc

    done = run_all([functools.partial(task, *j) for j in jobs])
    out: list[Encoded] = []
    k = 0
    for i in range(len(tensors)):
        frames: list[Frame] = []
        parts: list[bytes] = []
        crc, stored_at = 0, 0
        while k < len(jobs) and jobs[k][0] == i:
            _, off, n = jobs[k]
            stored, stored_crc, raw_crc = done[k]
            frames.append(Frame(off, n, stored_at, len(stored), stored_crc))
            parts.append(stored)
            crc = crc32c_combine(crc, raw_crc, n) if frames[1:] else raw_crc
            stored_at += len(stored)
            k += 1
        out.append(Encoded(tuple(frames), tuple(parts), crc if frames else 0))
    return out


class DecodeJob(NamedTuple):
    """One frame to decode: its stored bytes, the tensor's dtype, where its
    raw bytes go (None: check the stored CRC32C only), and the stored CRC32C
    to check first (None: no check)."""

    stored: memoryview
    dtype: str
    out: memoryview | None
    stored_crc32c: int | None


class Decoded(NamedTuple):
    """What decoding a frame found: the CRC32C of its stored bytes when
    checked and wrong (else None), and of its raw bytes (when asked)."""

    bad_stored_crc32c: int | None
    raw_crc32c: int | None
    error: str | None  # the frame could not be decoded


def decode_frames(jobs: Sequence[DecodeJob], *, raw_crc: bool) -> list[Decoded]:
    """Decode every frame, in parallel. A frame whose stored CRC32C is wrong
    is not decoded (its `out` is zeroed); nor is one that fails to decode."""

    def task(job: DecodeJob) -> Decoded:
        out = job.out
        if job.stored_crc32c is not None:
            actual = crc32c(job.stored)
            if actual != job.stored_crc32c:
                if out is not None:
                    out[:] = bytes(len(out))
                return Decoded(actual, None, None)
        if out is None:
            return Decoded(None, None, None)
        try:
            frame.decode(job.stored, grouping_for(job.dtype), out)
        except frame.CodecError as exc:
            out[:] = bytes(len(out))
            return Decoded(None, None, str(exc))
        return Decoded(None, crc32c(out) if raw_crc else None, None)

    return run_all([functools.partial(task, j) for j in jobs])


def checksum(data: memoryview | bytes) -> int:
    """The CRC32C of `data`."""
    return int(crc32c(data))
