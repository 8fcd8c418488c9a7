"""torch dtypes and their safetensors names: the dtypes a checkpoint can hold."""

from __future__ import annotations

import torch

# Exactly the dtypes safetensors.torch can load back, so every data file we
# write stays readable by safetensors.
_BY_NAME: dict[str, torch.dtype] = {
    "BOOL": torch.bool,
    "U8": torch.uint8,
    "I8": torch.int8,
    "I16": torch.int16,
    "I32": torch.int32,
    "I64": torch.int64,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F32": torch.float32,
    "F64": torch.float64,
    "C64": torch.complex64,
}
for _name, _attr in (
    ("U16", "uint16"),
    ("U32", "uint32"),
    ("U64", "uint64"),
    ("F8_E4M3", "float8_e4m3fn"),
    ("F8_E5M2", "float8_e5m2"),
    ("F8_E4M3FNUZ", "float8_e4m3fnuz"),
    ("F8_E5M2FNUZ", "float8_e5m2fnuz"),
):
    if hasattr(torch, _attr):
        _BY_NAME[_name] = getattr(torch, _attr)

_BY_DTYPE: dict[torch.dtype, str] = {v: k for k, v in _BY_NAME.items()}

SUPPORTED_NAMES = frozenset(_BY_NAME)


def to_name(dtype: torch.dtype) -> str | None:
    """The safetensors name of a torch dtype, or None if it cannot be stored."""
    return _BY_DTYPE.get(dtype)


def from_name(name: str) -> torch.dtype:
    """The torch dtype of a safetensors name; KeyError if unknown."""
    return _BY_NAME[name]


def itemsize(name: str) -> int:
    return _BY_NAME[name].itemsize
