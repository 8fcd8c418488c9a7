# Type stub for the C extension built from csrc/codec/ (fpc_module.c).
from collections.abc import Sequence

from typing_extensions import Buffer

NOT_SMALLER: int
UNSUPPORTED: int

def split(raw: Buffer, unit: int, rotate: bool, out: Buffer, /) -> None: ...
def merge(planes: Sequence[Buffer], unit: int, rotate: bool, out: Buffer, /) -> None: ...
def zstd_literals(plane: Buffer, /) -> bytes | int: ...
