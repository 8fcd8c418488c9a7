"""The C engine behind the Engine interface."""

from __future__ import annotations

import os
import warnings
from collections.abc import Sequence
from typing import Any

from .. import _engine, knobs
from .types import IOResult, Segment, Unkept

_DIRECT_MODES = {"auto": _engine.DIRECT_AUTO, "on": _engine.DIRECT_ON, "off": _engine.DIRECT_OFF}
_BACKENDS = {
    "auto": _engine.BACKEND_AUTO, "uring": _engine.BACKEND_URING, "pool": _engine.BACKEND_POOL
}
# Filesystems (by st_dev) already warned about, so a refusal is said once.
_warned_devices: set[int] = set()


def _warn_buffered(path: str, dir_fd: int | None) -> None:
    directory = os.path.dirname(os.path.abspath(path)) if dir_fd is None else "a directory"
    try:
        device = os.stat(directory).st_dev if dir_fd is None else os.fstat(dir_fd).st_dev
    except OSError:
        device = -1
    if device in _warned_devices:
        return
    _warned_devices.add(device)
    warnings.warn(
        f"the filesystem of {directory} refuses O_DIRECT; fastpersist uses buffered I/O "
        "and fsync there (durable, but slower and through the page cache)",
        RuntimeWarning,
        stacklevel=4,
    )


class NativeEngine:
    name = "native"

    def __init__(self) -> None:
        k = knobs.current()
        self._block_size = k.block_size
        self._threads = k.io_threads
        self._mode = k.direct
        # AUTO falls back to the pool with all of io_threads; io_uring caps them at the CPUs.
        self._backend = _BACKENDS[k.io_backend]
        self._queue_depth = k.io_queue_depth
        # Huge pages make each bounce buffer a few physically contiguous runs,
        # which O_DIRECT requests need to stay large (csrc/fp_util.c).
        _engine.set_huge_buffers(knobs.huge_pages() != "off")

    def write_file(
        self, path: str, segments: Sequence[Segment], size: int, *, fsync: bool = True,
        dir_fd: int | None = None, buffered: bool = False,
    ) -> IOResult:
        mode = _engine.DIRECT_OFF if buffered else _DIRECT_MODES[self._mode]
        crcs, direct = _engine.write_file(
            path, segments, size, self._block_size, self._threads, mode,
            fsync, backend=self._backend, queue_depth=self._queue_depth,
            dir_fd=_engine.AT_FDCWD if dir_fd is None else dir_fd,
        )
        if not direct and not buffered and self._mode == "auto":
            _warn_buffered(path, dir_fd)
        return IOResult(crcs=crcs, direct=direct)

    def copy(self, dst: Any, src: Any) -> int:
        return _engine.copy(dst, src)

    def read_file(
        self, path: str, segments: Sequence[Segment | Unkept], *, checksum: bool = True,
        region: Segment | None = None, bounce: bool = False,
    ) -> IOResult:
        crcs, direct = _engine.read_file(
            path, segments, self._block_size, self._threads, _DIRECT_MODES[self._mode], checksum,
            backend=self._backend, queue_depth=self._queue_depth, region=region, bounce=bounce,
        )
        return IOResult(crcs=crcs, direct=direct)
