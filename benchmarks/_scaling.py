"""`save_load.py --sizes`: the same measurements at several state sizes, as time vs bytes."""

from __future__ import annotations

import re
import statistics

from _report import Record

_UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def parse_size(text: str) -> int:
    """'64M' -> 64 MiB, '1.5G' -> 1.5 GiB, '4096' -> 4096 bytes (binary units)."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([KMGT]?)(i?B)?\s*", text, re.IGNORECASE)
    if not match:
        raise ValueError(f"cannot read the size {text!r} (examples: 64M, 1G, 1.5G)")
    size = int(float(match.group(1)) * _UNITS[match.group(2).upper()])
    if size < 1:
        raise ValueError(f"the size {text!r} is not positive")
    return size


def _label(nbytes: int) -> str:
    for unit in ("T", "G", "M", "K"):
        if nbytes >= _UNITS[unit]:
            return f"{nbytes / _UNITS[unit]:.3g} {unit}iB"
    return f"{nbytes} B"


def scaling_table(per_state: list[tuple[int, list[Record]]], methods: list[str]) -> list[str]:
    """A row per phase and method, a column per size: median seconds [min-max] and
    "x lin", the seconds per byte relative to the largest size's (1.00 = linear; above 1,
    a fixed cost that the smaller sizes do not amortise)."""
    sizes = [nbytes for nbytes, _ in per_state]
    width = 26
    lines = [
        "\n== TIME VS BYTES (median seconds over the repeats [min-max]; x lin: seconds per byte"
        " / the largest size's)",
        f"  {'phase':<5} {'method':<12}" + "".join(f" {_label(n):>{width}}" for n in sizes),
    ]
    for phase in ("save", "load"):
        for method in (m for m in methods if m != "fio"):
            cells: list[tuple[float, float, float] | None] = []
            for _, records in per_state:
                secs = [r.seconds for r in records
                        if r.phase == phase and r.method == method and r.error is None
                        and r.seconds is not None]
                cells.append((statistics.median(secs), min(secs), max(secs)) if secs else None)
            if not any(cells):
                continue
            last = next(((n, c) for n, c in zip(reversed(sizes), reversed(cells), strict=True)
                         if c), None)
            row = f"  {phase:<5} {method:<12}"
            for nbytes, cell in zip(sizes, cells, strict=True):
                if cell is None or last is None:
                    row += f" {'-':>{width}}"
                    continue
                lin = (cell[0] / nbytes) / (last[1][0] / last[0])
                text = f"{cell[0]:.3f} [{cell[1]:.3f}-{cell[2]:.3f}] {lin:.2f}x"
                row += f" {text:>{width}}"
            lines.append(row)
    return lines
