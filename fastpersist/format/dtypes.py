"""The dtypes a checkpoint can hold: safetensors names, sizes, and torch dtypes.

The names and sizes need no torch, so the format can be read and validated
without it (fastpersistd and fpctl's listing do); the torch dtypes are looked
up on first use.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

# Exactly the dtypes safetensors.torch can load back, so every data file we
# write stays readable by safetensors: name -> (bytes per element, torch name).
_DTYPES: dict[str, tuple[int, str]] = {
    "BOOL": (1, "bool"),
    "U8": (1, "uint8"),
    "I8": (1, "int8"),
    "I16": (2, "int16"),
    "I32": (4, "int32"),
    "I64": (8, "int64"),
    "F16": (2, "float16"),
    "BF16": (2, "bfloat16"),
    "F32": (4, "float32"),
    "F64": (8, "float64"),
    "C64": (8, "complex64"),
    "U16": (2, "uint16"),
    "U32": (4, "uint32"),
    "U64": (8, "uint64"),
    "F8_E4M3": (1, "float8_e4m3fn"),
    "F8_E5M2": (1, "float8_e5m2"),
    "F8_E4M3FNUZ": (1, "float8_e4m3fnuz"),
    "F8_E5M2FNUZ": (1, "float8_e5m2fnuz"),
}

SUPPORTED_NAMES = frozenset(_DTYPES)
ITEMSIZES: dict[str, int] = {name: size for name, (size, _) in _DTYPES.items()}


def itemsize(name: str) -> int:
    return _DTYPES[name][0]


def torch_name(name: str) -> str:
    """The torch (and numpy) name of a safetensors name: "F32" -> "float32"."""
    return _DTYPES[name][1]


@functools.cache
def _torch_tables() -> tuple[dict[str, torch.dtype], dict[torch.dtype, str]]:
    import torch

    by_name = {
        name: getattr(torch, attr) for name, (_, attr) in _DTYPES.items() if hasattr(torch, attr)
    }
    return by_name, {v: k for k, v in by_name.items()}


def names_by_dtype() -> dict[torch.dtype, str]:
    """torch dtype -> safetensors name, for every storable dtype (to_name's table)."""
    return _torch_tables()[1]


def to_name(dtype: torch.dtype) -> str | None:
    """The safetensors name of a torch dtype, or None if it cannot be stored."""
    return _torch_tables()[1].get(dtype)


def from_name(name: str) -> torch.dtype:
    """The torch dtype of a safetensors name; KeyError if unknown (or missing
    from this torch)."""
    return _torch_tables()[0][name]
