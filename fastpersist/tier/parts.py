"""One object uploaded from bytes appended in order, in multipart parts.

Parts 2.. are uploaded as they fill (FASTPERSIST_TIER_PART_BYTES each,
FASTPERSIST_TIER_CONCURRENCY in flight: memory stays bounded; streams that
share `slots` share that bound, so their uploads may overlap), part 1 last,
with whatever header the writer knows only at the end (compress.py: the
packed header; a raw file: none); S3 assembles parts by number, not by
arrival. Less than two parts of bytes is a single put.

An upload whose uploader was killed resumes: the object's newest open
multipart upload is taken up, and each part whose size and ETag (the MD5 of
its bytes, as S3 computes it without KMS) are those of the part about to be
sent is kept instead of sent again. A file's bytes, and their encoding, are
deterministic, so with the same knobs the parts come out the same; any that
differ are sent again (and parts the store cannot prove the same, e.g. ETags
that are not MD5s).
An upload that failed while its uploader lived was aborted: it starts over.

Torch-free: the daemon imports this module.
"""

from __future__ import annotations

import contextlib
import hashlib
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from ..errors import CheckpointError
from .client import S3
from .url import TierURL


class PartStream:
    """Bytes appended in order become one object: parts 2.. are uploaded as
    they fill, part 1 (header + its first bytes) once the header is known
    (finish); with `late_header=False`, there is no header and part 1 goes as
    soon as it fills, like the rest."""

    def __init__(self, s3: S3, url: TierURL, name: str, metadata: dict[str, str],
                 pool: ThreadPoolExecutor, *, late_header: bool = True,
                 slots: threading.BoundedSemaphore | None = None) -> None:
        self.s3, self.url, self.name, self.metadata, self.pool = s3, url, name, metadata, pool
        self.late_header = late_header
        self.first = bytearray()  # part 1's bytes, held for the header
        self.current = bytearray()  # less than one part
        self.upload_id: str | None = None
        self.futures: list[Future[Any]] = []  # the parts' {PartNumber, ETag}; a put's None
        # At most this many parts held in flight; streams that share `slots`
        # (one save's data files, uploaded overlapping) share that bound.
        self.slots = slots or threading.BoundedSemaphore(s3.concurrency)
        self.kept_lock = threading.Lock()
        self.next_part = 2 if late_header else 1
        self.size = 0
        self.sealed = False
        self.single = False  # sealed as one put (less than a part)
        self.kept = 0  # bytes of parts an earlier, interrupted upload had sent already
        self.earlier: dict[int, tuple[str, int]] = {}  # its parts: number -> (ETag, size)

    def write(self, data: bytes | bytearray | memoryview) -> None:
        """Append `data`; every whole part is sent before this returns, so the
        caller may reuse `data`'s memory then. A part is copied once from
        `data` when it lies within it, twice when it spans writes."""
        view = memoryview(data)
        if view.format != "B" or view.ndim != 1:
            view = view.cast("B")
        self.size += len(view)
        part = self.s3.part_bytes
        if self.late_header and len(self.first) < part:
            take = min(part - len(self.first), len(view))
            self.first += view[:take]
            view = view[take:]
        while view:
            if not self.current and len(view) >= part:
                self._send(bytes(view[:part]))
                view = view[part:]
                continue
            take = min(part - len(self.current), len(view))
            self.current += view[:take]
            view = view[take:]
            if len(self.current) == part:
                body, self.current = bytes(self.current), bytearray()
                self._send(body)

    def _start(self) -> str:
        if self.upload_id is None:
            unfinished = self.s3.unfinished_upload(self.url, self.name)
            if unfinished is None:
                self.upload_id = self.s3.start_upload(self.url, self.name, self.metadata)
            else:
                self.upload_id, self.earlier = unfinished
        return self.upload_id

    def _part(self, number: int, body: bytes) -> dict[str, Any]:
        """Send part `number`, unless the interrupted upload holds it already."""
        upload_id = self._start()
        had = self.earlier.get(number)
        if had is not None and had[1] == len(body) and \
                had[0].strip('"') == hashlib.md5(body, usedforsecurity=False).hexdigest():
            with self.kept_lock:
                self.kept += len(body)
            return {"PartNumber": number, "ETag": had[0]}
        return self.s3.upload_part(self.url, self.name, upload_id, number, body)

    def _send(self, body: bytes) -> None:
        self._start()
        number = self.next_part
        self.next_part += 1
        self._submit(lambda: self._part(number, body))

    def _submit(self, request: Callable[[], Any]) -> None:
        self.slots.acquire()  # bounded: see __init__

        def run() -> Any:
            try:
                return request()
            finally:
                self.slots.release()

        self.futures.append(self.pool.submit(run))

    def seal(self) -> None:
        """No more bytes (`late_header=False` only): what is left goes now,
        as the last part or, with less than a part in all, as one put in
        flight like a part; finish() then waits for them."""
        assert not self.late_header
        if self.sealed:
            return
        self.sealed = True
        if self.upload_id is None:
            body = bytes(self.current)
            self.single = True
            self._submit(lambda: self.s3.put(self.url, self.name, body, self.metadata))
        elif self.current:
            self._send(bytes(self.current))
        self.current = bytearray()

    def finish(self, header: bytes = b"") -> None:
        """Send what is left (with late_header, the header goes first in the
        object) and complete the object. May run on another thread than the
        writes, once they are done (and the stream sealed)."""
        if not self.late_header:
            self.seal()
            parts = [f.result() for f in self.futures]
            if not self.single:
                self.s3.complete_upload(self.url, self.name, self._start(), parts)
            return
        if self.upload_id is None:
            self.s3.put(self.url, self.name, header + bytes(self.first) + bytes(self.current),
                        self.metadata)
            return
        if self.current:
            self._send(bytes(self.current))
        parts = [f.result() for f in self.futures]
        parts.append(self._part(1, header + bytes(self.first)))
        self.s3.complete_upload(self.url, self.name, self._start(), parts)

    def abort(self) -> None:
        for f in self.futures:
            if f.cancel():
                self.slots.release()  # its run() never will: the slots may be shared
        for f in self.futures:
            if not f.cancelled():
                f.exception()  # wait: no part is sent after the abort
        if self.upload_id is not None:
            # An upload that cannot be aborted now (the store went away) is swept
            # later (retention.sweep_uploads); the error that brought us here is
            # the one to raise.
            with contextlib.suppress(CheckpointError):
                self.s3.abort_upload(self.url.bucket, self.url.key(self.name), self.upload_id)
