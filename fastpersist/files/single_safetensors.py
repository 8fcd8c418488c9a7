"""One standard safetensors file: save(obj, "x.safetensors") and its load.

The file is what safetensors.torch.load_file reads, written as a
checkpoint's data files are (format/safetensors_file.py, tensors/datafile.py):
by the engine, with O_DIRECT where the filesystem allows, the header padded
with spaces so that the data starts on a 4 KiB boundary. Each tensor's
CRC32C is in the header's "__metadata__" under CRC_KEY (a JSON object, name
-> 8 hex digits): the engine computes them as it writes, so the header is
written first with zeros in their place and rewritten, the same length, once
they are known. A load checks them where the file has them (files other
writers made have none), and checks every file's layout: entries must tile
the data section exactly and the file must end where it does (safetensors'
own rules).

Only a flat dict of tensors by string name is a safetensors file. Unlike
safetensors' save_file, tensors that share memory (tied weights) and
non-contiguous ones are accepted: each is written as its own contiguous
bytes, and loads back as a separate tensor (safetensors has no aliasing).
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from ..checksum import crc32c
from ..engine import get_engine
from ..errors import (
    ChecksumMismatchError,
    CorruptCheckpointError,
    TruncatedFileError,
    UnsupportedValueError,
)
from ..format import dtypes, safetensors_file
from ..format.manifest import FileRecord, TensorRecord
from ..tensors import datafile
from ..tensors.factory import MapLocation, TensorFactory
from ..tensors.mismatch import Mismatch, raise_for
from ..tensors.plan import StoredTensor

CRC_KEY = "fastpersist.crc32c"


def stored_tensors(obj: Any, where: str) -> list[StoredTensor]:
    """The tensors of a flat {name: tensor} dict, as a data file stores them."""
    if not isinstance(obj, Mapping):
        raise UnsupportedValueError(
            f"{where}: a .safetensors file holds a flat dict of tensors by name, not a "
            f"{type(obj).__name__}; save to a directory (a checkpoint) or a .pt name instead")
    out = []
    for name, t in obj.items():
        if not isinstance(name, str) or name == "__metadata__":
            raise UnsupportedValueError(
                f"{where}: key {name!r}: safetensors names are strings other than "
                "'__metadata__'")
        if not isinstance(t, torch.Tensor) or type(t) not in (torch.Tensor, torch.nn.Parameter):
            raise UnsupportedValueError(
                f"{where}: {name!r} is a {type(t).__name__}; a .safetensors file holds only "
                "tensors (a flat dict of them): save nested state to a directory or a .pt name")
        dtype = dtypes.to_name(t.dtype)
        if dtype is None:
            raise UnsupportedValueError(f"{where}: {name!r} has dtype {t.dtype}, which "
                                        "safetensors cannot hold")
        if t.device.type == "meta":
            raise UnsupportedValueError(f"{where}: {name!r} is on the meta device (no data)")
        t = t.detach()
        t = t if t.is_contiguous() else t.contiguous()
        out.append(StoredTensor(name, dtype, tuple(t.shape), t, t.nbytes))
    return out


def _metadata(crcs: dict[str, str]) -> dict[str, str]:
    return {**safetensors_file.DATA_FILE_METADATA,
            CRC_KEY: json.dumps(crcs, separators=(",", ":"))}


def write(tensors: list[StoredTensor], path: Path) -> None:
    """A new safetensors file at `path` (a new name) holding `tensors`, its
    CRC32Cs in the metadata; fsynced on return."""
    placeholder = _metadata({t.name: "0" * 8 for t in tensors})
    file_record, records = datafile.write(get_engine(), str(path.parent), path.name, tensors,
                                          placeholder)
    final = _metadata({r.name: f"{r.crc32c:08x}" for r in records})
    header = datafile.plan_file(tensors, final).layout.header
    assert len(header) == file_record.data_start  # only hex digits changed
    fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
    try:
        view = memoryview(header)
        while view:  # (a regular file takes it whole; a short write is not an error)
            view = view[os.pwrite(fd, view, len(header) - len(view)):]
        os.fsync(fd)
    finally:
        os.close(fd)


class Parsed:
    """A safetensors file's header, checked against the file's size."""

    def __init__(self, head: bytes, size: int, where: str) -> None:
        if len(head) >= 8 and struct.unpack("<Q", head[:8])[0] > safetensors_file.MAX_HEADER_BYTES:
            raise CorruptCheckpointError(f"{where}: not a valid safetensors file: its header "
                                         "length is over safetensors' 100 MiB limit")
        if size < 8 or (len(head) >= 8 and 8 + struct.unpack("<Q", head[:8])[0] > size):
            need = "8" if size < 8 else str(8 + struct.unpack("<Q", head[:8])[0])
            raise TruncatedFileError(f"{where}: a safetensors file that is truncated: its "
                                     f"header needs {need} bytes, the file has {size}")
        try:
            self.data_start, entries, self.metadata = safetensors_file.parse_header(head)
        except safetensors_file.HeaderError as exc:
            raise CorruptCheckpointError(f"{where}: not a valid safetensors file: {exc}") from None
        self.entries = sorted(entries.values(), key=lambda e: (e.begin, e.end))
        cursor = 0
        for e in self.entries:
            n = math.prod(e.shape) * dtypes.itemsize(e.dtype)
            if e.begin != cursor or e.end - e.begin != n:
                raise CorruptCheckpointError(
                    f"{where}: not a valid safetensors file: tensor {e.name!r} lies at "
                    f"{e.begin}..{e.end} of the data, expected {cursor}..{cursor + n}")
            cursor = e.end
        if self.data_start + cursor > size:
            raise TruncatedFileError(
                f"{where}: a safetensors file that is truncated: {size} bytes, its header "
                f"says {self.data_start + cursor}")
        if self.data_start + cursor < size:
            raise CorruptCheckpointError(
                f"{where}: not a valid safetensors file: {size - self.data_start - cursor} "
                "bytes after the last tensor")
        self.crcs = self._crcs(where)

    def _crcs(self, where: str) -> dict[str, int] | None:
        text = self.metadata.get(CRC_KEY) if isinstance(self.metadata, dict) else None
        if text is None:
            return None
        try:
            raw = json.loads(text)
            crcs = {k: int(v, 16) for k, v in raw.items() if len(v) == 8}
        except (TypeError, ValueError, AttributeError):
            raise CorruptCheckpointError(f"{where}: the header's {CRC_KEY} is not valid "
                                         f"JSON of CRC32Cs") from None
        if set(crcs) != {e.name for e in self.entries}:
            raise CorruptCheckpointError(f"{where}: the header's {CRC_KEY} does not name "
                                         "each tensor once")
        return crcs

    def records(self, file: str) -> list[TensorRecord]:
        return [TensorRecord(e.name, file, self.data_start + e.begin, e.end - e.begin, e.dtype,
                             e.shape, self.crcs[e.name] if self.crcs else 0)
                for e in self.entries]


def _raise_for(mismatches: list[Mismatch], where: str) -> None:
    """raise_for, saying why a valid file can fail its CRCs: they are only in
    the metadata, which tools copy into files they write (an edited copy)."""
    try:
        raise_for(mismatches, where)
    except ChecksumMismatchError as exc:
        raise ChecksumMismatchError(
            f"{exc}: the file's metadata carries fastpersist CRC32Cs ({CRC_KEY}) that its "
            "bytes do not match; a damaged file, or one written by another tool whose "
            "metadata was copied from another file (safetensors' save_file(..., "
            "metadata=f.metadata()) after editing a tensor). Such a file loads with "
            "verify=False", file=exc.file, tensor=exc.tensor) from None


def _named(tensors: list[torch.Tensor], parsed: Parsed, map_location: MapLocation,
           where: str) -> dict[str, torch.Tensor]:
    factory = TensorFactory(tensors, map_location, where)
    return {e.name: factory({"t": "tensor", "e": i}) for i, e in enumerate(parsed.entries)}


def load(path: Path, map_location: MapLocation, verify: bool, where: str
         ) -> dict[str, torch.Tensor]:
    """The tensors of the safetensors file at `path`, by name, with their
    CRC32Cs checked (verify, and the file has them)."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) == 8:
            n = struct.unpack("<Q", head)[0]
            head += f.read(min(n, safetensors_file.MAX_HEADER_BYTES + 1))
    parsed = Parsed(head, size, where)
    file = FileRecord(path.name, size, parsed.data_start, 0)
    check = verify and parsed.crcs is not None
    tensors, mismatches = datafile.read(get_engine(), str(path.parent), file,
                                        parsed.records(path.name), verify=check, header=False)
    _raise_for(mismatches, where)
    return _named(tensors, parsed, map_location, where)


def load_bytes(data: bytes, map_location: MapLocation, verify: bool, where: str
               ) -> dict[str, torch.Tensor]:
    """load() of a safetensors file held in memory (read from a file object)."""
    parsed = Parsed(data[:8 + safetensors_file.MAX_HEADER_BYTES + 8], len(data), where)
    buffer = bytearray(data)  # tensors own writable memory, as a load's do
    tensors, mismatches = [], []
    for r in parsed.records("<stream>"):
        dtype = dtypes.from_name(r.dtype)
        t = (torch.frombuffer(buffer, dtype=dtype, offset=r.offset,
                              count=r.length // dtype.itemsize).view(r.shape)
             if r.length and r.offset % dtype.itemsize == 0 else
             torch.empty(r.shape, dtype=dtype))
        if r.length and r.offset % dtype.itemsize:
            t.view(-1).view(torch.uint8).copy_(torch.frombuffer(buffer, dtype=torch.uint8,
                                                                offset=r.offset, count=r.length))
        tensors.append(t)
        if verify and parsed.crcs is not None:
            actual = crc32c(memoryview(buffer)[r.offset:r.offset + r.length])
            if actual != r.crc32c:
                mismatches.append(Mismatch(r.file, r.name, r.crc32c, actual))
    _raise_for(mismatches, where)
    return _named(tensors, parsed, map_location, where)
