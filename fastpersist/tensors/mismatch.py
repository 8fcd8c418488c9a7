"""CRC32C mismatches: which stored bytes (a file's header, a tensor, a
compressed tensor's frame) do not have the checksum their manifest records,
and the error a load raises for them. Torch-free (see committed.py)."""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import ChecksumMismatchError
from ..format.manifest import FileRecord, TensorRecord


@dataclass(frozen=True)
class Mismatch:
    file: str
    tensor: str  # "<header>" for the safetensors header
    expected: int
    actual: int
    frame: int | None = None  # a compressed tensor's frame, whose stored bytes are wrong

    def what(self) -> str:
        if self.tensor == "<header>":
            return "the safetensors header" if self.file.endswith(".safetensors") else (
                "the packed header")
        return f"tensor {self.tensor!r}" + (
            f" (stored frame {self.frame})" if self.frame is not None else "")




def mismatches_of(file: FileRecord, records: list[TensorRecord], with_header: bool,
                  crcs: list[int]) -> list[Mismatch]:
    """The records (after the header's, with_header) whose CRC32C is not theirs."""
    mismatches = []
    if with_header:
        if crcs[0] != file.header_crc32c:
            mismatches.append(Mismatch(file.name, "<header>", file.header_crc32c, crcs[0]))
        crcs = crcs[1:]
    for r, crc in zip(records, crcs, strict=True):
        if crc != r.crc32c:
            mismatches.append(Mismatch(file.name, r.name, r.crc32c, crc))
    return mismatches


def raise_for(mismatches: list[Mismatch], where: str) -> None:
    if not mismatches:
        return
    m = mismatches[0]
    more = f" (and {len(mismatches) - 1} more)" if len(mismatches) > 1 else ""
    raise ChecksumMismatchError(
        f"{where}: {m.what()} in {m.file} is corrupt: CRC32C {m.actual:#010x}, expected "
        f"{m.expected:#010x}{more}",
        file=m.file,
        tensor=m.tensor,
    )


__all__ = ["Mismatch", "mismatches_of", "raise_for"]
