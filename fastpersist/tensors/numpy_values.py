"""numpy arrays and scalars in a state: stored as tensors, loaded as numpy.

A numpy value is a tensor leaf of the tree marked "np" ("array" or "scalar";
state.py lists the node's fields), so that an RNG state from
np.random.get_state() needs no pickle. numpy is imported only when a numpy
value is met: checking a type asks its module's name (is_numpy).

Torch and numpy meet here only; state.py calls as_tensor when it encodes and
from_tensor when it decodes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..errors import CheckpointError, ManifestError
from ..format import dtypes
from ..format.bounds import MAX_DIMS

# numpy dtypes stored as tensors: each has a torch dtype of the same name that a
# data file holds, except complex128 (float64 pairs). Byte order is not kept:
# a big-endian array is stored, and loads, in native order.
NUMPY_DTYPES = frozenset({
    "bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
    "float16", "float32", "float64", "complex64", "complex128",
})


def is_numpy(obj: object) -> bool:
    """Whether obj's type is numpy's, asked without importing numpy."""
    module = type(obj).__module__
    return module == "numpy" or module.startswith("numpy.")


def as_tensor(obj: Any, cache: dict[int, tuple[Any, torch.Tensor]]
              ) -> tuple[dict[str, Any], torch.Tensor] | str:
    """The tree node and tensor that store the numpy value `obj`, or why it
    needs pickle. `cache` (id -> (value, tensor)) makes one array under two
    keys one tensor, stored once."""
    import numpy as np  # imported already: obj is numpy's

    if type(obj) is np.ndarray:
        kind = "array"
    elif isinstance(obj, np.generic):
        kind = "scalar"
    else:  # an ndarray subclass (np.matrix, np.memmap, masked arrays), a dtype, ...
        return f"a value of type {type(obj).__qualname__}"
    dtype = obj.dtype
    if dtype.name not in NUMPY_DTYPES or dtype.fields is not None:
        return f"a numpy {kind} of dtype {dtype}"
    if id(obj) in cache:
        t = cache[id(obj)][1]
    else:
        arr = np.asarray(obj)  # a 0-d array for a scalar
        if not dtype.isnative:
            arr = arr.astype(dtype.newbyteorder("="))
        if not (arr.flags.c_contiguous and arr.flags.aligned and arr.flags.writeable
                and arr.flags.owndata):
            # Negative strides, Fortran order, read-only or unaligned memory: a
            # copy. Views too: a view and its base as tensors would be two
            # storages at one address, which the planner takes for one.
            arr = np.array(arr, order="C", copy=True)
        try:
            t = torch.from_numpy(arr)
        except TypeError:  # uint16-64 in a torch older than 2.3
            return f"a numpy {kind} of dtype {dtype} (this torch has no such tensors)"
        if dtype.name == "complex128":
            t = torch.view_as_real(t)
        if dtypes.to_name(t.dtype) is None:
            return f"a numpy {kind} of dtype {dtype} (this torch has no such tensors)"
        cache[id(obj)] = (obj, t)  # obj kept: its id stays its own
    node: dict[str, Any] = {"t": "tensor", "np": kind}
    if dtype.name == "complex128":
        node["np_dtype"] = "complex128"
    if t.dim() > MAX_DIMS:
        return f"a numpy {kind} of {t.dim()} dimensions as stored (over {MAX_DIMS})"
    return node, t


def from_tensor(node: dict[str, Any], t: torch.Tensor,
                cache: dict[int, tuple[torch.Tensor, Any]],
                bad: Callable[[str], ManifestError], where: str) -> Any:
    """The numpy array or scalar that the tensor node `node` (marked "np")
    stands for. `cache` (id(tensor) -> (tensor, array)) makes one tensor under
    two keys one array; bad(message) is the ManifestError to raise; `where`
    names the value for the error when numpy is missing."""
    try:
        import numpy as np
    except ImportError:
        raise CheckpointError(f"{where} is a numpy value; install numpy to load this "
                              "checkpoint") from None
    kind = node["np"]  # "array" or "scalar": format/tree.py checked it
    if type(t) is not torch.Tensor:
        raise bad(f"a numpy {kind} cannot be a {type(t).__qualname__}")
    if id(t) in cache:
        arr = cache[id(t)][1]
    else:
        arr = _array(np, node, t, bad)
        cache[id(t)] = (t, arr)
    if kind == "array":
        return arr
    if arr.ndim != 0:
        raise bad(f"a numpy scalar stored with shape {list(arr.shape)}")
    return arr[()]


def _array(np: Any, node: dict[str, Any], t: torch.Tensor,
           bad: Callable[[str], ManifestError]) -> Any:
    t = t.detach().cpu()  # a numpy node is always loaded on the CPU (tensors/factory.py)
    complex128 = node.get("np_dtype") == "complex128"
    if complex128 and (t.dtype != torch.float64 or t.dim() == 0 or t.shape[-1] != 2):
        raise bad(f"a complex128 numpy value stored as {t.dtype} {list(t.shape)}, not "
                  "float64 pairs")
    try:
        arr = t.numpy()
        if not arr.flags.c_contiguous:  # a view with other strides, in a hostile manifest
            arr = arr.copy(order="C")
        return arr.view(np.complex128)[..., 0] if complex128 else arr
    except (TypeError, ValueError, RuntimeError) as exc:  # bfloat16, float8: no numpy dtype
        raise bad(f"a numpy value cannot be stored as {t.dtype} ({exc})") from None
