"""Reading checkpoints in a store: manifests, object sizes, bytes into memory
(what lies below a URL: listing.py).

A remote checkpoint exists when its manifest.json does: the uploader writes
it last (upload.py), so objects below a prefix without one are an upload in
progress or abandoned, never a checkpoint. The manifest is validated as a
local one is (format/), before anything else is read.

fetch() reads byte ranges of one object straight into the caller's buffers
(the tensors' memory) with parallel ranged GETs of FASTPERSIST_TIER_PART_BYTES,
FASTPERSIST_TIER_CONCURRENCY at once, and returns each buffer's CRC32C,
computed on the reading threads. Each GET covers about a part of the object
and its body is read (readinto) directly into the consecutive buffers it
covers, skipping the padding between them: no bounce buffer, and few
requests for many small tensors.

Torch-free.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any

from ..errors import CheckpointNotFoundError
from ..format.bounds import MAX_MANIFEST_BYTES
from ..format.manifest import MANIFEST_NAME, Manifest
from .client import S3, read_exact

# Listings moved to listing.py; these names stay importable from here.
from .listing import RemoteEntry as RemoteEntry
from .listing import entries as entries
from .url import TierURL

try:
    from .. import _engine

    _combine: Callable[[int, int, int], int] | None = _engine.crc32c_combine
    _crc: Callable[[memoryview], int] = _engine.crc32c
except ImportError:  # no C engine: the reference engine's package (not in the daemon's image)
    import crc32c

    _combine = None
    _crc = crc32c.crc32c

# Bytes between two buffers that one GET reads and drops rather than
# starting another GET (alignment padding is at most 4 KiB).
GAP = 1 << 20


def read_manifest(s3: S3, url: TierURL) -> tuple[Manifest, bytes]:
    """The validated manifest of the checkpoint at `url`, and its bytes."""
    data = s3.get(url, MANIFEST_NAME, MAX_MANIFEST_BYTES)
    if data is None:
        raise CheckpointNotFoundError(
            f"no checkpoint at {url}: it has no {MANIFEST_NAME} (nothing was uploaded there, "
            "or its upload has not finished: the manifest is written last)")
    return Manifest.from_json(data, str(url)), data


def object_sizes(s3: S3, url: TierURL) -> dict[str, int]:
    """Name -> size of the objects directly in `url`."""
    out = {}
    for key, size, _ in s3.objects(url):
        rel = url.relative(key)
        if "/" not in rel:
            out[rel] = size
    return out


# -- reading bytes -----------------------------------------------------------------


@dataclass
class _Piece:
    """One ranged GET, bytes [offset, offset+length) of the object, streamed
    into `spans` in order: (buffer index, start within the buffer, bytes,
    object offset). The bytes between spans (alignment padding) are skipped."""

    offset: int
    length: int
    spans: list[tuple[int, int, int, int]]


def plan(segments: Sequence[tuple[memoryview, int]], part: int) -> list[_Piece]:
    """Ranged GETs of about `part` bytes covering every segment: neighbours
    share a GET, a large segment is cut across several; a gap wider than
    GAP starts a new GET instead of being read and dropped."""
    pieces: list[_Piece] = []
    cur: _Piece | None = None
    for i in sorted(range(len(segments)), key=lambda j: segments[j][1]):
        buf, offset = segments[i]
        n, done = len(buf), 0
        while done < n:  # nothing for an empty buffer (its CRC32C is 0)
            at = offset + done
            if cur is None or at - (cur.offset + cur.length) > GAP or at - cur.offset >= part:
                cur = _Piece(at, 0, [])
                pieces.append(cur)
            take = min(n - done, cur.offset + part - at)
            cur.spans.append((i, done, take, at))
            cur.length = at + take - cur.offset
            done += take
    return pieces


def _skip(body: Any, n: int) -> None:
    scratch = memoryview(bytearray(min(n, 1 << 16)))
    while n > 0:
        k = body.readinto(scratch[:min(n, len(scratch))])
        if not k:
            raise EOFError("the object ended early")
        n -= k


class Fetch:
    """Reads of one object into buffers, on a shared pool; CRCs per buffer."""

    def __init__(self, s3: S3, url: TierURL, name: str,
                 segments: Sequence[tuple[memoryview, int]], *, checksum: bool) -> None:
        self.s3, self.url, self.name = s3, url, name
        self.segments = segments
        self.checksum = checksum
        self.pieces = plan(segments, s3.part_bytes)
        self._crcs: dict[tuple[int, int], tuple[int, int]] = {}  # (buffer, start) -> crc, n
        self._lock = threading.Lock()

    def run(self, piece: _Piece) -> int:
        """One GET, streamed straight into the buffers; returns the bytes read."""
        def read(body: Any) -> None:
            pos = piece.offset
            for i, start, n, at in piece.spans:
                if at > pos:
                    _skip(body, at - pos)
                view = self.segments[i][0][start:start + n]
                read_exact(body, view, f"{self.name} at byte {at}")
                if self.checksum:
                    crc = _crc(view)
                    with self._lock:
                        self._crcs[(i, start)] = (crc, n)
                pos = at + n

        self.s3.read_range(self.url, self.name, piece.offset, piece.length, read)
        return sum(n for _, _, n, _ in piece.spans)

    def crcs(self) -> list[int]:
        """Each buffer's CRC32C, once every piece has run."""
        parts: dict[int, list[tuple[int, int, int]]] = {}
        for (i, start), (crc, n) in self._crcs.items():
            parts.setdefault(i, []).append((start, crc, n))
        out = []
        for i, (buf, _) in enumerate(self.segments):
            mine = sorted(parts.get(i, []))
            if len(mine) == 1:
                out.append(mine[0][1])
            elif not mine:
                out.append(0)  # empty
            elif _combine is None:
                out.append(_crc(buf))
            else:
                crc = mine[0][1]
                for _, c, n in mine[1:]:
                    crc = _combine(crc, c, n)
                out.append(crc)
        return out


def fetch_all(s3: S3, fetches: Sequence[Fetch],
              progress: Callable[[int], None] | None = None) -> None:
    """Run every piece of `fetches` on FASTPERSIST_TIER_CONCURRENCY threads;
    the first error is raised (the remaining pieces are cancelled)."""
    with ThreadPoolExecutor(max_workers=s3.concurrency,
                            thread_name_prefix="fp-tier-get") as pool:
        futures: list[Future[int]] = [pool.submit(f.run, p) for f in fetches for p in f.pieces]
        pending = set(futures)
        while pending:
            done, pending = wait(pending, return_when=FIRST_EXCEPTION)
            for fut in done:
                if fut.exception() is not None:
                    for other in pending:
                        other.cancel()
                    raise fut.exception()  # type: ignore[misc]
                if progress:
                    progress(fut.result())
