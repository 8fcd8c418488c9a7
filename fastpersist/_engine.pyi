# Type stub for the C extension built from csrc/fp_module.c.
from collections.abc import Sequence
from typing import Any

DIRECT_OFF: int
DIRECT_ON: int
DIRECT_AUTO: int
BACKEND_POOL: int
BACKEND_URING: int
BACKEND_AUTO: int
MAX_QUEUE_DEPTH: int
ALIGNMENT: int
CRC32C_IMPL: str
AT_FDCWD: int
RESOLVE_NO_XDEV: int
RESOLVE_NO_MAGICLINKS: int
RESOLVE_NO_SYMLINKS: int
RESOLVE_BENEATH: int

def write_file(
    path: str, segments: Sequence[tuple[Any, int]], size: int, block_size: int, threads: int,
    direct: int, fsync: bool = ..., *, backend: int = ..., queue_depth: int = ...,
    dir_fd: int = ...,
) -> tuple[list[int], bool]: ...
def read_file(
    path: str, segments: Sequence[tuple[Any, int] | tuple[None, int, int]], block_size: int,
    threads: int, direct: int,
    checksum: bool = ..., *, backend: int = ..., queue_depth: int = ...,
    region: tuple[Any, int] | None = ...,
    bounce: bool = ...,
) -> tuple[list[int] | None, bool]: ...
def crc32c(data: Any, value: int = ...) -> int: ...
def crc32c_combine(crc1: int, crc2: int, len2: int) -> int: ...
def fsync_dir(path: str) -> None: ...
def rename_exchange(a: str, b: str, *, dir_fd: int = ...) -> None: ...
def openat2(dir_fd: int, path: str, flags: int, mode: int, resolve: int) -> int: ...
def uring_available() -> bool: ...
def release_buffers() -> None: ...
def set_huge_buffers(on: bool) -> None: ...
def cached_buffer_bytes() -> int: ...
def gather(dst: Any, addresses: Sequence[int], offsets: Sequence[int],
           lengths: Sequence[int], threads: int = 1) -> None: ...
