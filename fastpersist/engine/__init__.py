"""The I/O engines: write and read lists of (buffer, file offset) with CRC32C.

Two engines share one interface. `native` is the C extension (parallel
O_DIRECT, GIL released). `python` is the reference: plain buffered writes in
file order, checksums from the `crc32c` package. The reference is the oracle
of the differential tests and the fallback where the extension is missing.
FASTPERSIST_ENGINE picks one; `native` is the default.
"""

from __future__ import annotations

import warnings

from .. import knobs
from .types import Engine, IOResult, Segment, Unkept

# Imported with the package, not inside a process's first save (issue 37).
_native_error: ImportError | None = None
try:
    from .native import NativeEngine
except ImportError as exc:  # the C extension is missing: get_engine falls back
    _native_error = exc

_warned_fallback = False


def get_engine(name: str | None = None) -> Engine:
    """The engine `name` (default: FASTPERSIST_ENGINE), falling back to the
    reference engine with one warning when the C extension cannot be imported."""
    global _warned_fallback
    name = name or knobs.current().engine
    if name == "native":
        if _native_error is None:
            return NativeEngine()
        if not _warned_fallback:
            warnings.warn(
                f"fastpersist's C engine is unavailable ({_native_error}); using the slower "
                "pure-Python reference engine",
                RuntimeWarning,
                stacklevel=2,
            )
            _warned_fallback = True
    from .reference import ReferenceEngine

    return ReferenceEngine()


__all__ = ["Engine", "IOResult", "Segment", "Unkept", "get_engine"]
