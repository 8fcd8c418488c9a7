"""Nested checkpoint state <-> a JSON tree plus a flat list of tensors.

`encode` walks what people pass to torch.save for checkpoints (dicts,
OrderedDicts, lists, tuples, tensors, numbers, strings, None, torch dtypes,
devices and sizes) and returns a JSON-able tree in which every tensor is a
node for the planner to fill in. `decode` rebuilds the object. Anything else
needs pickle, and pickle is used only when the caller opts in: a checkpoint
that unpickles on load can run arbitrary code.

Tree nodes: JSON null, booleans, integers and strings stand for themselves;
everything else is an object tagged by "t":
    {"t": "float", "v": "nan" | "inf" | "-inf"}   (finite floats are JSON numbers)
    {"t": "dict" | "odict", "k": [key nodes], "v": [value nodes], "meta": node?}
    {"t": "list" | "tuple", "v": [nodes]}
    {"t": "bytes", "v": base64}          {"t": "dtype", "v": "float32"}
    {"t": "device", "v": "cuda:0"}       {"t": "size", "v": [2, 3]}
    {"t": "tensor", "e": entry, "view": {...}?, "device": str?, "param": bool?,
     "grad": bool?}
    {"t": "tensor", "e": entry, "view": {...}?, "np": "array" | "scalar",
     "np_dtype": "complex128"?}
                                         a numpy array or scalar, stored as a tensor
                                         of its dtype (complex128, which safetensors
                                         lacks, as float64 pairs: "np_dtype"); loads
                                         as numpy, on the CPU, C-contiguous
    {"t": "pickle", "v": base64}         only with allow_pickle=True

Integers are JSON integers of at most MAX_INT_BITS bits (Python's JSON parser
refuses longer ones). numpy is imported only when a numpy value is met.
"""

from __future__ import annotations

import base64
import math
import pickle
import sys
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import ManifestError, PickleNotAllowedError, UnsupportedValueError
from ..format import dtypes
from ..format.bounds import MAX_DIMS, MAX_TREE_DEPTH
from ..format.tree import key_text
from . import numpy_values
from .numpy_values import is_numpy

Node = Any  # a JSON value
_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)  # exact types; subclasses need pickle

# Python's JSON parser refuses integers of more than 4300 digits (int_max_str_digits);
# 2**14000 has 4215.
MAX_INT_BITS = 14_000

@dataclass(slots=True)  # one per tensor: no __dict__ each
class TensorLeaf:
    """One tensor found in the state, and the tree node the planner completes."""

    path: str
    tensor: torch.Tensor
    node: dict[str, Any]


def _path(parent: str, key: object) -> str:
    return f"{parent}.{key}" if parent else str(key)


class _Encoder:
    def __init__(self, allow_pickle: bool, sharded: bool = False) -> None:
        self.allow_pickle = allow_pickle
        self.sharded = sharded
        self.leaves: list[TensorLeaf] = []
        self._active: set[int] = set()  # containers on the current path: cycles
        self._depth = 0  # levels of the node being encoded (the root is 1)
        # id(numpy value) -> (the value, its tensor): one tensor per array object
        self._numpy_tensors: dict[int, tuple[Any, torch.Tensor]] = {}
        self._storable = dtypes.names_by_dtype()  # the dtypes a data file can hold

    def encode(self, obj: Any, path: str) -> Node:
        if type(obj) in _PLAIN_TENSORS and self._depth < MAX_TREE_DEPTH:
            return self._tensor(obj, path)  # the common leaf, without the try below
        self._depth += 1
        try:
            if self._depth > MAX_TREE_DEPTH:
                # Loading refuses deeper trees (format/bounds.py): never write one.
                raise UnsupportedValueError(
                    f"{path or '<root>'}: the state is nested deeper than {MAX_TREE_DEPTH} "
                    "levels")
            return self._encode(obj, path)
        finally:
            self._depth -= 1

    def _encode(self, obj: Any, path: str) -> Node:
        if obj is None or isinstance(obj, (bool, str)):
            return obj
        if type(obj) is int:
            if obj.bit_length() > MAX_INT_BITS:
                return self._pickled(obj, path, f"an integer of {obj.bit_length()} bits (over "
                                     f"{MAX_INT_BITS})")
            return obj
        if type(obj) is float:
            return obj if math.isfinite(obj) else {"t": "float", "v": repr(obj)}
        if isinstance(obj, torch.Tensor):
            return self._tensor(obj, path)
        if type(obj) in (dict, OrderedDict):
            return self._container(obj, path, self._mapping)
        if type(obj) in (list, tuple):
            return self._container(obj, path, self._sequence)
        if type(obj) is bytes:
            return {"t": "bytes", "v": base64.b64encode(obj).decode()}
        if isinstance(obj, torch.dtype):
            return {"t": "dtype", "v": str(obj).removeprefix("torch.")}
        if isinstance(obj, torch.device):
            return {"t": "device", "v": str(obj)}
        if type(obj) is torch.Size:
            return {"t": "size", "v": list(obj)}
        if is_numpy(obj):
            return self._numpy(obj, path)
        return self._pickled(obj, path, f"a value of type {type(obj).__qualname__}")

    def _pickled(self, obj: Any, path: str, what: str) -> Node:
        if not self.allow_pickle:
            raise UnsupportedValueError(
                f"{path or '<root>'}: {what} cannot be stored without pickle; convert it to "
                "tensors, numbers, strings, lists or dicts, or pass allow_pickle=True (the "
                "checkpoint can then only be loaded with allow_pickle=True)"
            )
        return {"t": "pickle", "v": base64.b64encode(pickle.dumps(obj)).decode()}

    def _container(self, obj: Any, path: str, fn: Callable[[Any, str], Node]) -> Node:
        if id(obj) in self._active:
            raise UnsupportedValueError(f"{path or '<root>'}: the state contains a cycle")
        self._active.add(id(obj))
        try:
            return fn(obj, path)
        finally:
            self._active.discard(id(obj))

    def _mapping(self, obj: dict[Any, Any], path: str) -> Node:
        keys, values = [], []
        shallow = self._depth < MAX_TREE_DEPTH  # room for the keys' level
        for k, v in obj.items():
            if type(k) is str and shallow:  # the common key, as encode(k) would give it
                keys.append(k)
                values.append(self.encode(v, f"{path}.{k}" if path else k))
                continue
            if isinstance(k, torch.Tensor):
                raise UnsupportedValueError(f"{path or '<root>'}: tensors cannot be dict keys")
            if is_numpy(k) and not isinstance(k, str):
                # A numpy key would be a tensor node, which no dict key may be.
                keys.append(self._pickled(k, path, f"a numpy dict key ({type(k).__qualname__})"))
                values.append(self.encode(v, _path(path, k)))
                continue
            keys.append(self.encode(k, path))
            values.append(self.encode(v, _path(path, k)))
        node = {"t": "odict" if type(obj) is OrderedDict else "dict", "k": keys, "v": values}
        # nn.Module.state_dict() keeps per-module versions here; load_state_dict reads them.
        meta = getattr(obj, "_metadata", None)
        if meta is not None:
            node["meta"] = self.encode(meta, _path(path, "_metadata"))
        return node

    def _sequence(self, obj: list[Any] | tuple[Any, ...], path: str) -> Node:
        return {
            "t": "tuple" if type(obj) is tuple else "list",
            "v": [self.encode(v, _path(path, i)) for i, v in enumerate(obj)],
        }

    def _tensor(self, t: torch.Tensor, path: str) -> Node:
        if self.sharded and is_dtensor(t):
            # A shard of a global tensor: the distributed save stores its box.
            shard: dict[str, Any] = {"t": "tensor", "sharded": True}
            if t.device.type != "cpu":
                shard["device"] = str(t.device)
            self.leaves.append(TensorLeaf(path or "<root>", t.detach(), shard))
            return shard
        # (Each check reads as few tensor attributes as it can: a state may
        # hold 100,000 tensors, and each read is ~50 ns.)
        kind = type(t)
        if kind not in _PLAIN_TENSORS:
            return self._pickled(t, path, f"a tensor subclass ({kind.__qualname__})")
        if t.layout != torch.strided or t.is_quantized:
            return self._pickled(t, path, f"a {t.layout} tensor")
        if t.dtype not in self._storable:
            return self._pickled(t, path, f"a tensor of dtype {t.dtype}")
        if t.dim() > MAX_DIMS:
            return self._pickled(t, path, f"a tensor of {t.dim()} dimensions (over {MAX_DIMS})")
        node: dict[str, Any] = {"t": "tensor"}
        if not t.is_cpu:
            if t.is_meta:  # (torch.save pickles it; a copy of it would fail in torch)
                return self._pickled(t, path, "a tensor on the meta device (it has no data)")
            node["device"] = str(t.device)
        grad = t.requires_grad
        if kind is torch.nn.Parameter:  # (isinstance asks Parameter's metaclass: slow)
            node["param"] = True
            node["grad"] = grad
        elif grad:
            node["grad"] = True
        # A tensor outside autograd is its own leaf: no detached alias (a new
        # Python object per tensor) is needed for it.
        leaf = t if kind is torch.Tensor and not grad else t.detach()
        self.leaves.append(TensorLeaf(path or "<root>", leaf, node))
        return node

    def _numpy(self, obj: Any, path: str) -> Node:
        stored = numpy_values.as_tensor(obj, self._numpy_tensors)
        if isinstance(stored, str):
            return self._pickled(obj, path, stored)
        node, t = stored
        self.leaves.append(TensorLeaf(path or "<root>", t, node))
        return node


def is_dtensor(t: torch.Tensor) -> bool:
    # A DTensor exists only once its module is imported: a job of plain tensors
    # (DDP) does not pay the import (40 MiB of RSS and its time) at its first save.
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(t, module.DTensor)


def encode(obj: Any, *, allow_pickle: bool = False, sharded: bool = False
           ) -> tuple[Node, list[TensorLeaf]]:
    """The tree for `obj` and its tensors, in the order met.

    Raises UnsupportedValueError, naming the path, for anything that would need
    pickle when allow_pickle is False. sharded=True (distributed saves) admits
    DTensors as leaves.
    """
    enc = _Encoder(allow_pickle, sharded)
    return enc.encode(obj, ""), enc.leaves


def tree_nodes(node: Node) -> Iterator[dict[str, Any]]:
    """Every dict node of a tree. Iterative: a tree read from disk must not be
    able to exhaust the stack, whoever calls this and whether or not the tree
    was validated first. Tensor nodes are yielded, not searched: nothing in
    them is decoded as a node."""
    stack = [node]
    while stack:
        n = stack.pop()
        if isinstance(n, dict):
            yield n
            if n.get("t") != "tensor":
                stack += [v for v in n.values() if isinstance(v, (dict, list))]
        elif isinstance(n, list):
            stack += [v for v in n if isinstance(v, (dict, list))]


def contains_pickle(node: Node) -> bool:
    return any(n.get("t") == "pickle" for n in tree_nodes(node))


class _Decoder:
    """Rebuilds the object from a tree that format/tree.py validated (so its
    depth is bounded and its fields have the right types); what only torch can
    judge (device types, dtype names, base64, hashable keys) is checked here,
    and every failure is a ManifestError naming the key path."""

    def __init__(
        self, tensor_for: Callable[[dict[str, Any]], torch.Tensor], allow_pickle: bool,
        where: str,
    ) -> None:
        self.tensor_for = tensor_for
        self.allow_pickle = allow_pickle
        self.where = where
        # id(tensor) -> (tensor, its array): one array per tensor object, so that an
        # array saved under two keys loads as one object, as tied tensors do.
        self._arrays: dict[int, tuple[torch.Tensor, Any]] = {}

    def bad(self, path: str, msg: str) -> ManifestError:
        return ManifestError(f"{self.where}: malformed manifest: tree at {path or '<root>'}: "
                             f"{msg}")

    def decode(self, node: Node, path: str = "") -> Any:
        if node is None or isinstance(node, (bool, int, float, str)):
            return node
        if not isinstance(node, dict) or not isinstance(node.get("t"), str):
            raise self.bad(path, f"unexpected node {str(node)[:80]!r}")
        tag = node["t"]
        if tag == "tensor":
            if "device" in node:
                self._device(node["device"], path)
            t = self.tensor_for(node)  # its own errors are not the tree's
            return t if "np" not in node else self._numpy(node, t, path)
        try:
            return self._decode_tagged(tag, node, path)
        except (KeyError, TypeError, ValueError, RuntimeError, AttributeError) as exc:
            raise self.bad(path, f"bad {tag!r} node ({exc!r})") from None

    def _device(self, value: Any, path: str) -> torch.device:
        try:
            return torch.device(value)
        except (RuntimeError, TypeError, ValueError) as exc:
            raise self.bad(path, f"bad device {str(value)[:80]!r} ({exc})") from None

    def _numpy(self, node: dict[str, Any], t: torch.Tensor, path: str) -> Any:
        """The numpy array or scalar a tensor node marked "np" stands for."""
        return numpy_values.from_tensor(node, t, self._arrays,
                                        lambda msg: self.bad(path, msg),
                                        f"{self.where}: {path or '<root>'}")

    def _decode_tagged(self, tag: str, node: dict[str, Any], path: str) -> Any:
        if tag in ("dict", "odict"):
            keys, values = node["k"], node["v"]
            if not isinstance(keys, list) or not isinstance(values, list) or len(keys) != len(
                values
            ):
                raise self.bad(path, "dict keys and values differ in length")
            result: dict[Any, Any] = OrderedDict() if tag == "odict" else {}
            tensor_for = self.tensor_for
            for i, (k, v) in enumerate(zip(keys, values, strict=True)):
                key = k if type(k) is str else self.decode(k, _path(path, f"<key {i}>"))
                if key in result:
                    raise self.bad(path, f"duplicate key {str(key)[:80]!r}")
                if type(v) is dict and len(v) == 2 and v.get("t") == "tensor":
                    result[key] = tensor_for(v)  # as decode(v) would, without the path
                else:
                    result[key] = self.decode(v, _path(path, key_text(key, i)))
            if "meta" in node:
                result._metadata = self.decode(  # type: ignore[attr-defined]
                    node["meta"], _path(path, "_metadata"))
            return result
        if tag in ("list", "tuple"):
            items = [self.decode(v, _path(path, i)) for i, v in enumerate(node["v"])]
            return tuple(items) if tag == "tuple" else items
        if tag == "float":
            if node["v"] not in ("nan", "inf", "-inf"):
                raise self.bad(path, f"bad float {node['v']!r}")
            return float(node["v"])
        if tag == "bytes":
            return base64.b64decode(node["v"], validate=True)
        if tag == "dtype":
            dt = getattr(torch, node["v"], None)
            if not isinstance(dt, torch.dtype):
                raise self.bad(path, f"unknown dtype {node['v']!r}")
            return dt
        if tag == "device":
            return self._device(node["v"], path)
        if tag == "size":
            return torch.Size(int(d) for d in node["v"])
        if tag == "pickle":
            if not self.allow_pickle:
                raise PickleNotAllowedError(
                    f"{self.where}: the checkpoint holds pickled values; unpickling can run "
                    "arbitrary code, so load it with allow_pickle=True only if you trust it"
                )
            return pickle.loads(base64.b64decode(node["v"], validate=True))
        raise self.bad(path, f"unknown node type {tag!r}")


def decode(
    tree: Node,
    tensor_for: Callable[[dict[str, Any]], torch.Tensor],
    *,
    allow_pickle: bool = False,
    where: str = "checkpoint",
) -> Any:
    """Rebuild the saved object; tensor_for(node) supplies each tensor."""
    if contains_pickle(tree) and not allow_pickle:
        raise PickleNotAllowedError(
            f"{where}: the checkpoint holds pickled values; unpickling can run arbitrary code, "
            "so load it with allow_pickle=True only if you trust it"
        )
    return _Decoder(tensor_for, allow_pickle, where).decode(tree)
