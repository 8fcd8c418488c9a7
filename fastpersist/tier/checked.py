"""A local data file read for upload as it is, every byte checked on the way.

An uploaded file is only as good as the bytes read from the local disk: a
file that rotted there must never reach the store under a manifest that
vouches for it. So a data file sent as it is (tier_compression="none", or a
file saved compressed) is read here, in order, a part at a time, and each
span the manifest has a CRC32C for is checked as its last byte is read:

    [0, data_start)          the file's header (FileRecord.header_crc32c)
    a raw record             its bytes (TensorRecord.crc32c)
    a compressed record      each stored frame (Frame.crc32c, of the stored bytes)

A CRC per part of each span is computed on the reading thread, and the
span's CRC is combined from them. The bytes between spans (alignment
padding, which no reader looks at and no CRC covers) are sent as zeros, so
everything that goes up is either checked or a zero we wrote, never a stale
byte of whatever the disk held there. A mismatch, or a file shorter than its
manifest says, raises LocalCorruption naming the file and the tensor (or
header, or frame): the upload is aborted before the object is completed,
and its manifest is never written. (compress.py checks the raw bytes it
encodes the same way, and raises the same error.)

Torch-free: the daemon imports this module.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from ..checksum import crc32c, crc32c_combine
from ..errors import CorruptCheckpointError, TierError
from ..format.manifest import FileRecord, TensorRecord

HEADER = "<header>"


class LocalCorruption(TierError, CorruptCheckpointError):
    """A local checkpoint does not match its manifest (a CRC32C, a size, a
    missing file): it is never uploaded, and retrying does not help.
    `file` and `tensor` ("<header>" for a file's header) name what is wrong,
    where it is known."""

    def __init__(self, message: str, *, file: str | None = None,
                 tensor: str | None = None) -> None:
        super().__init__(message)
        self.file = file
        self.tensor = tensor


@dataclass
class _Span:
    start: int
    end: int
    crc32c: int  # expected
    tensor: str
    frame: int | None = None
    got: int = 0  # the CRC32C of [start, start + seen)
    seen: int = 0

    def what(self, file: str) -> str:
        if self.tensor == HEADER:
            return f"the header of {file}"
        frame = f" (stored frame {self.frame})" if self.frame is not None else ""
        return f"tensor {self.tensor!r}{frame} in {file}"


def spans(f: FileRecord, records: list[TensorRecord]) -> list[_Span]:
    """What the manifest has a CRC32C for in file `f`, in file order."""
    out = [_Span(0, f.data_start, f.header_crc32c, HEADER)]
    for r in records:
        if r.frames is None:
            out.append(_Span(r.offset, r.offset + r.length, r.crc32c, r.name))
        else:
            out += [_Span(r.offset + fr.stored_offset, r.offset + fr.stored_offset
                          + fr.stored_length, fr.crc32c, r.name, i)
                    for i, fr in enumerate(r.frames)]
    out.sort(key=lambda s: s.start)
    return out


class CheckedFile:
    """File `f` (open as `fd`) read in order, each span checked (see above)."""

    def __init__(self, fd: int, f: FileRecord, records: list[TensorRecord], where: str) -> None:
        self.fd, self.file, self.where = fd, f, where
        self.spans = [s for s in spans(f, records) if s.end > s.start]
        self.next = 0  # the first span not checked yet
        self.pos = 0  # the next byte read() expects
        ends = [s.end for s in self.spans]
        if any(b.start < a_end for a_end, b in zip(ends, self.spans[1:], strict=False)) or \
                any(e > f.size for e in ends):
            raise LocalCorruption(f"{where}: the manifest's records of {f.name} overlap or "
                                      "run past its end; not uploaded", file=f.name)

    def read(self, offset: int, n: int) -> bytearray:
        """Bytes [offset, offset + n), which must follow the last read's: checked
        where a CRC32C covers them, zeros between."""
        buf = bytearray(n)
        self.read_into(offset, memoryview(buf))
        return buf

    def read_into(self, offset: int, view: memoryview) -> None:
        """read(offset, len(view)) into view (a buffer reused from read to read)."""
        if offset != self.pos:
            raise ValueError(f"read at {offset}, expected {self.pos}: reads go in order")
        n = len(view)
        got = 0
        while got < n:
            k = os.preadv(self.fd, [view[got:]], offset + got)
            if k == 0:
                raise LocalCorruption(f"{self.where}: {self.file.name} ends at byte "
                                      f"{offset + got}, its manifest says {self.file.size}; "
                                      "not uploaded", file=self.file.name)
            got += k
        end = offset + n
        covered = offset  # bytes before this one are checked or zeroed
        i = self.next
        while i < len(self.spans) and self.spans[i].start < end:
            s = self.spans[i]
            lo, hi = max(s.start, offset), min(s.end, end)
            if lo > covered:
                view[covered - offset:lo - offset] = bytes(lo - covered)
            crc = crc32c(view[lo - offset:hi - offset])
            s.got = crc32c_combine(s.got, crc, hi - lo) if s.seen else crc
            s.seen += hi - lo
            covered = hi
            if hi < s.end:
                break  # the rest of this span comes with the next read
            if s.got != s.crc32c:
                raise LocalCorruption(
                    f"{self.where}: {s.what(self.file.name)} is corrupt on the local disk "
                    f"(CRC32C {s.got:#010x}, expected {s.crc32c:#010x}); not uploaded "
                    "(`fpctl verify` it)", file=self.file.name, tensor=s.tensor)
            i += 1
        self.next = i
        if covered < end:
            view[covered - offset:] = bytes(end - covered)
        self.pos = end


__all__ = ["HEADER", "CheckedFile", "LocalCorruption", "spans"]
