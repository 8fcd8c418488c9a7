"""Formatting shared by the fpctl commands: sizes, times, tables, JSON."""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from datetime import datetime
from typing import Any

# Exit statuses. Corruption found by `verify` is 1; anything that stops a
# command from doing its job (no such checkpoint, bad arguments) is 2.
EXIT_OK = 0
EXIT_CORRUPT = 1
EXIT_ERROR = 2

_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")


def human_size(n: int | None) -> str:
    if n is None:
        return "-"
    size = float(n)
    for unit in _UNITS:
        if size < 1024 or unit == _UNITS[-1]:
            return f"{n} B" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


def local_time(unix: float | None) -> str:
    if unix is None:
        return "-"
    return datetime.fromtimestamp(unix).astimezone().isoformat(timespec="seconds")


def print_table(header: Sequence[str], rows: Sequence[Sequence[str]],
                right: Sequence[bool] = ()) -> None:
    """Columns padded to their widest cell; `right[i]` right-aligns column i."""
    widths = [max([len(h)] + [len(r[i]) for r in rows]) for i, h in enumerate(header)]
    align = list(right) + [False] * (len(header) - len(right))
    for row in [list(header), *rows]:
        cells = [c.rjust(w) if a else c.ljust(w)
                 for c, w, a in zip(row, widths, align, strict=True)]
        print("  ".join(cells).rstrip())


def print_json(obj: Any) -> None:
    json.dump(obj, sys.stdout, indent=2)
    sys.stdout.write("\n")


def warn(message: str) -> None:
    print(f"fpctl: {message}", file=sys.stderr)
