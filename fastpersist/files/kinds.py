"""What a file holds, told by its first bytes (a suffix can lie).

Torch-free: fpctl and the read path may ask without importing torch.
"""

from __future__ import annotations

import enum
import os
import struct
from pathlib import Path

from ..errors import CheckpointIOError, UnknownFileFormatError
from ..format.safetensors_file import MAX_HEADER_BYTES

# torch.save's zip format (torch >= 1.6) is a zip archive; its legacy format
# starts with the pickled magic number 0x1950a86a20f9469cfc6c (a PROTO opcode,
# then LONG1 of 10 bytes).
ZIP_MAGIC = b"PK\x03\x04"
LEGACY_MAGIC = b"\x8a\x0al\xfc\x9cF\xf9 j\xa8P\x19"
PREFIX_BYTES = 64  # enough of a file to tell its kind

TORCH_SUFFIXES = (".pt", ".pth", ".bin")
SAFETENSORS_SUFFIX = ".safetensors"


class Kind(enum.Enum):
    TORCH_ZIP = "a torch.save file"
    TORCH_LEGACY = "a torch.save file (legacy format)"
    SAFETENSORS = "a safetensors file"

    @property
    def is_torch(self) -> bool:
        return self is not Kind.SAFETENSORS


def kind_of(prefix: bytes) -> Kind | None:
    """The kind of file that starts with `prefix` (at least PREFIX_BYTES of
    it, or all of a shorter file), or None."""
    if prefix.startswith(ZIP_MAGIC):
        return Kind.TORCH_ZIP
    # (protocol 4 and later put a FRAME opcode and its 8-byte length between)
    if prefix[:1] == b"\x80" and LEGACY_MAGIC in (prefix[2:2 + len(LEGACY_MAGIC)],
                                                  prefix[11:11 + len(LEGACY_MAGIC)]):
        return Kind.TORCH_LEGACY
    # safetensors: a u64 header length, then the header's JSON object (its
    # own writer emits no leading space; ours neither).
    if len(prefix) >= 9 and prefix[8:9] == b"{":
        (n,) = struct.unpack("<Q", prefix[:8])
        if 2 <= n <= MAX_HEADER_BYTES:
            return Kind.SAFETENSORS
    return None


def describe(prefix: bytes) -> str:
    """A few words on what an unrecognised file starts with, for errors."""
    if not prefix:
        return "it is empty"
    shown = prefix[:16]
    text = shown.decode("ascii", "replace") if all(32 <= b < 127 for b in shown) else shown.hex()
    return f"it starts with {text!r}"


def read_prefix(path: Path) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read(PREFIX_BYTES)
    except OSError as exc:
        raise CheckpointIOError(exc.errno or 5, f"cannot read {path}: {exc.strerror}") from None


def file_kind(path: Path) -> Kind:
    """The kind of the regular file at `path`; UnknownFileFormatError for
    anything else (naming the file and what it starts with)."""
    prefix = read_prefix(path)
    kind = kind_of(prefix)
    if kind is None:
        raise UnknownFileFormatError(
            f"{path} is a file, but neither a torch.save file, a safetensors file nor a "
            f"fastpersist checkpoint directory ({describe(prefix)})")
    return kind


def is_file_object(obj: object) -> bool:
    """An open binary file or io.BytesIO, not a path."""
    return not isinstance(obj, (str, bytes, os.PathLike)) and (
        hasattr(obj, "read") or hasattr(obj, "write"))
