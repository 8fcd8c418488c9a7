"""Names of the files inside a checkpoint directory that more than one module makes.

Torch-free: the daemon writes distributed checkpoints' parts under these names.
"""

from __future__ import annotations

import re


def data_file_name(index: int, *, packed: bool = False) -> str:
    """A single-process checkpoint's data file: a safetensors file, or a packed
    one (compressed tensors, packed_file.py) that safetensors tools must not open."""
    return f"data-{index:05d}.{'fpz' if packed else 'safetensors'}"


def part_file_name(rank: int, index: int, *, packed: bool = False) -> str:
    """A distributed checkpoint's data file: the index-th that `rank` wrote
    (packed: compressed, as data_file_name's)."""
    return f"data-r{rank:05d}-{index:03d}.{'fpz' if packed else 'safetensors'}"


_PART_FILE = re.compile(r"^data-r(\d{5,})-\d{3,}\.(?:safetensors|fpz)$")


def rank_of_part_file(name: str) -> int | None:
    """The rank that wrote a distributed checkpoint's data file (None: not one)."""
    m = _PART_FILE.match(name)
    return int(m[1]) if m else None
