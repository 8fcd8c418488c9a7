"""The saved object's tree in a manifest, checked before anything decodes it.

See fastpersist.tensors.state for the node types. The walk is iterative and stops at
MAX_TREE_DEPTH levels, so a hostile tree cannot exhaust the stack here or in
the recursive decoder that runs after it. Every node is checked: its tag and
fields, a tensor node's entry (an index into the stored tensors, or the
globals of a distributed checkpoint), device and view (inside its entry's
bytes), numpy marks, dict keys (no duplicates, no tensors). Errors name the key path.
Torch-free: whether torch knows a device type is for the decoder to ask.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from . import dtypes
from .bounds import (
    MAX_ELEMENTS,
    MAX_FILE_BYTES,
    MAX_TREE_DEPTH,
    is_int,
    malformed,
    shape_problem,
    short,
)

# torch.device syntax: a type, optionally ":index". Which types exist is torch's
# (and a renamed privateuse1 backend's) to say, at load.
DEVICE = re.compile(r"^[a-z][a-z0-9_]{0,31}(:[0-9]{1,5})?$")
_FLOAT_WORDS = frozenset({"nan", "inf", "-inf"})
_NUMPY_KINDS = ("array", "scalar")
_STRING_TAGS = frozenset({"bytes", "dtype", "pickle"})
_SCALARS = (str, int, float, bool, type(None))
_INT64 = 1 << 63

# (parent path, key, index): linked as the walk goes and made text only for an
# error, so a wide tree costs no string per node. The key is a dict key or list
# index, _KEY for the i-th key node of a dict, or a label when the index is -1.
Path = tuple[Any, Any, int] | None
_KEY = object()


def path_text(path: Path) -> str:
    parts: list[str] = []
    while path is not None:
        path, key, i = path
        parts.append(f"<key {i}>" if key is _KEY else key if i < 0 else key_text(key, i))
    return ".".join(reversed(parts)) or "<root>"


def key_text(key: Any, i: int) -> str:
    """How a dict key shows in a key path (the state's own paths use str(key))."""
    return short(key) if isinstance(key, str) and len(key) > 60 else (
        str(key) if isinstance(key, _SCALARS) else f"<key {i}>")


def check_tree(tree: Any, entry_bytes: Sequence[int], where: str) -> None:
    """Raise ManifestError, naming the key path, for the first node that is
    malformed. entry_bytes[e] is the size of the tensor a node's "e" names."""
    stack: list[tuple[Any, Path, int]] = [(tree, None, 1)]
    entries = len(entry_bytes)
    while stack:
        node, path, depth = stack.pop()
        if depth > MAX_TREE_DEPTH:
            raise _bad(where, path, f"nested deeper than {MAX_TREE_DEPTH} levels")
        if isinstance(node, _SCALARS):
            continue  # NaN and infinities never get here: the JSON parser refuses them
        if not isinstance(node, dict) or not isinstance(node.get("t"), str):
            raise _bad(where, path, f"unexpected node {short(node)}")
        tag, value = node["t"], node.get("v")
        if tag == "tensor" and len(node) == 2 and type(node.get("e")) is int and (
                0 <= node["e"] < entries):
            continue  # the common tensor node, {"t", "e"}: nothing more to check
        if tag in ("dict", "odict"):
            stack += _mapping(node, path, depth, entries, where)
        elif tag in ("list", "tuple"):
            if not isinstance(value, list):
                raise _bad(where, path, f"{tag} node without a list of items")
            stack += [(v, (path, i, i), depth + 1) for i, v in enumerate(value)]
        elif tag == "tensor":
            _tensor(node, path, entry_bytes, where)
        elif tag == "float":
            if not isinstance(value, str) or value not in _FLOAT_WORDS:
                raise _bad(where, path, f"bad float {short(value)}")
        elif tag in _STRING_TAGS:
            if not isinstance(value, str):
                raise _bad(where, path, f"{tag} node without a string")
        elif tag == "device":
            if not isinstance(value, str) or not DEVICE.match(value):
                raise _bad(where, path, f"bad device {short(value)}")
        elif tag == "size":
            if not isinstance(value, list) or not all(is_int(d, -_INT64, _INT64 - 1)
                                                      for d in value):
                raise _bad(where, path, f"bad torch.Size {short(value)}")
        else:
            raise _bad(where, path, f"unknown node type {short(tag)}")


def _bad(where: str, path: Path, msg: str) -> Exception:
    return malformed(where, f"tree at {path_text(path)}: {msg}")


def _mapping(node: dict[str, Any], path: Path, depth: int, entries: int, where: str
             ) -> list[tuple[Any, Path, int]]:
    keys, values = node.get("k"), node.get("v")
    if not isinstance(keys, list) or not isinstance(values, list) or len(keys) != len(values):
        raise _bad(where, path, "dict keys and values must be lists of one length")
    seen: set[Any] = set()
    out: list[tuple[Any, Path, int]] = []
    # Nodes that need no more checks are not pushed: scalar keys, and values that
    # are plain tensor nodes ({"t": "tensor", "e": e}), unless too deep.
    leaves_ok = depth < MAX_TREE_DEPTH
    for i, (k, v) in enumerate(zip(keys, values, strict=True)):
        if isinstance(k, _SCALARS):
            # Keys equal in Python (1, 1.0 and true) would merge into one entry.
            if k in seen:
                raise _bad(where, path, f"duplicate key {short(k)}")
            seen.add(k)
            if not leaves_ok:
                out.append((k, (path, _KEY, i), depth + 1))
        else:
            if isinstance(k, dict) and k.get("t") == "tensor":
                raise _bad(where, path, "a tensor as a dict key")
            out.append((k, (path, _KEY, i), depth + 1))
        if not (leaves_ok and type(v) is dict and len(v) == 2 and v.get("t") == "tensor"
                and type(e := v.get("e")) is int and 0 <= e < entries):
            out.append((v, (path, k, i), depth + 1))
    if "meta" in node:
        if node["t"] != "odict":  # only an OrderedDict can carry nn.Module's _metadata
            raise _bad(where, path, "a plain dict with _metadata")
        out.append((node["meta"], (path, "_metadata", -1), depth + 1))
    return out


def _tensor(node: dict[str, Any], path: Path, entry_bytes: Sequence[int], where: str) -> None:
    e = node.get("e")
    if not is_int(e, 0, len(entry_bytes) - 1):
        raise _bad(where, path, f"tensor entry {short(e)} is not one of the "
                   f"{len(entry_bytes)} stored tensors")
    device = node.get("device", "cpu")
    # A tensor saved from the meta device has no bytes: "meta" here is a lie.
    if not isinstance(device, str) or not DEVICE.match(device) or device.split(":")[0] == "meta":
        raise _bad(where, path, f"bad device {short(device)} for a tensor")
    for flag in ("param", "grad", "sharded"):
        if not isinstance(node.get(flag, False), bool):
            raise _bad(where, path, f"{flag!r} must be true or false")
    if "np" in node or "np_dtype" in node:
        _numpy(node, path, where)
    if "view" in node:
        _view(node["view"], entry_bytes[e], path, where)


def _numpy(node: dict[str, Any], path: Path, where: str) -> None:
    """A numpy value: an array or a scalar, of the stored tensor's dtype or
    complex128 (float64 pairs); always loaded on the CPU, never a Parameter.
    That its stored tensor fits (numpy knows its dtype, a scalar is 0-d) the
    decoder checks, against the tensor."""
    kind = node.get("np")
    if not isinstance(kind, str) or kind not in _NUMPY_KINDS:
        raise _bad(where, path, f"numpy kind {short(kind)} is not 'array' or 'scalar'")
    np_dtype = node.get("np_dtype", "complex128")
    if not isinstance(np_dtype, str) or np_dtype != "complex128":
        raise _bad(where, path, f"numpy dtype {short(np_dtype)} is not 'complex128'")
    for key in ("device", "param", "grad", "sharded"):
        if key in node:
            raise _bad(where, path, f"a numpy value with {key!r}")


def _view(view: Any, nbytes: int, path: Path, where: str) -> None:
    """A view must lie inside the bytes of the stored tensor it is a view of."""
    if not isinstance(view, dict):
        raise _bad(where, path, f"view {short(view)} is not an object")
    dtype: Any = view.get("dtype")
    shape: Any = view.get("shape")
    stride: Any = view.get("stride")
    offset: Any = view.get("offset")
    if not isinstance(dtype, str) or dtype not in dtypes.SUPPORTED_NAMES:
        raise _bad(where, path, f"view dtype {short(dtype)} is not one this version knows")
    problem = shape_problem(shape)
    if problem is not None:
        raise _bad(where, path, f"view shape {short(shape)} {problem}")
    if not isinstance(stride, list) or len(stride) != len(shape):
        raise _bad(where, path, f"view shape {short(shape)} and stride {short(stride)} "
                   "differ in length")
    if not all(is_int(s, 0, MAX_ELEMENTS) for s in stride):
        raise _bad(where, path, f"view stride {short(stride)} must be integers >= 0")
    size = dtypes.itemsize(dtype)
    if not is_int(offset, 0, MAX_FILE_BYTES) or offset % size:
        raise _bad(where, path, f"view offset {short(offset)} is not a multiple of the "
                   f"element size {size}")
    extent = 0 if 0 in shape else (sum((n - 1) * s for n, s in zip(shape, stride, strict=True))
                                   + 1) * size
    if offset + extent > nbytes:
        raise _bad(where, path, f"view of {extent} bytes at offset {offset} lies outside its "
                   f"stored tensor of {nbytes} bytes")
