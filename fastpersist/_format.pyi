# Type stub for the C extension built from csrc/format/ (fpf.h).
from collections.abc import Sequence
from typing import Any

from typing_extensions import Buffer

from .format.records import TensorRecord

def scan_records(text: Buffer, start: int, stop: int, files: dict[str, tuple[int, int, int]],
                 itemsizes: dict[str, int], record_type: type[TensorRecord], raw: str,
                 limits: tuple[int, int, int, int], /) -> list[Any] | None: ...
def header_json(entries: Sequence[tuple[str, str, Sequence[int], int]], prefix: bytes,
                /) -> bytes | None: ...
