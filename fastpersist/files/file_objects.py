"""save(obj, fileobj) and load(fileobj): open binary files and io.BytesIO.

A file object gets torch.save's format (torch_file.py): what users of
torch.save(obj, buffer) already send and store, readable by torch.load, and
equal to what was saved after a load (nested dicts, tuples, optimizer
state). A load tells the stream's kind by its first bytes, so it also reads
a safetensors file's bytes. Buffered, through Python's file object: no
O_DIRECT, no fsync (the caller owns the file and says when it is durable).
"""

from __future__ import annotations

import io
from typing import IO, Any

from ..errors import UnknownFileFormatError, UnsupportedPathError
from ..tensors.factory import MapLocation
from . import single_safetensors, torch_file
from .kinds import PREFIX_BYTES, Kind, describe, kind_of


def name_of(f: IO[bytes]) -> str:
    name = getattr(f, "name", None)
    return f"file object {name!r}" if isinstance(name, str) else f"a {type(f).__name__}"


def _check_binary(f: IO[bytes], doing: str) -> None:
    """UnsupportedPathError for a text-mode file object, before any I/O (torch
    would fail in its first write or read, with a TypeError or a decode error)."""
    # (not by a mode without "b": binary readers such as zipfile's say "r")
    if isinstance(f, io.TextIOBase):
        raise UnsupportedPathError(
            f"cannot {doing} {name_of(f)}: it is open in text mode; torch.save and "
            "safetensors bytes need a file opened in binary mode ('wb', 'rb') or an "
            "io.BytesIO")


def save(obj: Any, f: IO[bytes], allow_pickle: bool) -> None:
    _check_binary(f, "save to")
    torch_file.save(obj, f, allow_pickle, name_of(f))


def _seekable(f: IO[bytes]) -> IO[bytes]:
    try:
        if f.seekable():
            return f
    except (AttributeError, ValueError):
        pass
    return io.BytesIO(f.read())  # a pipe or socket: torch.load needs to seek


def load(f: IO[bytes], map_location: MapLocation, allow_pickle: bool, verify: bool) -> Any:
    where = name_of(f)
    _check_binary(f, "load from")
    f = _seekable(f)
    start = f.tell()
    prefix = f.read(PREFIX_BYTES)
    f.seek(start)
    kind = kind_of(prefix)
    if kind is None:
        raise UnknownFileFormatError(
            f"{where} holds neither a torch.save stream nor a safetensors file "
            f"({describe(prefix)})")
    if kind is Kind.SAFETENSORS:
        return single_safetensors.load_bytes(f.read(), map_location, verify, where)
    return torch_file.load(f, kind, map_location, allow_pickle, where)
