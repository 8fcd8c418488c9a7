"""load(path, into=state): the checkpoint's tensors put into tensors the caller
already has (a constructed model's state_dict(), an optimizer's), as
torch.distributed.checkpoint loads, instead of into new memory.

Each tensor of the checkpoint's tree is paired with the tensor at the same
place in `into` (same dict keys, same list positions). Pairs must have the same
shape (the dtype and the device may differ: the values are converted, as
Module.load_state_dict converts them), every tensor of `into` must have a
pair, and memory to load into (not on the meta device, strided); otherwise
StateMismatchError, before anything is read. Tensors of the
checkpoint's part that `into` names (below) without a pair load as usual;
plain values of `into` are ignored (the loaded object holds the checkpoint's).

The load reads and returns only the part of the checkpoint that `into` names
(restrict): in a mapping of `into` that holds tensors, the checkpoint's keys
it lacks whose values hold tensors are left out, unread (plain values, a
step or a config, cost no read and stay). A mapping of `into` without
tensors (a fresh optimizer's empty state), a list's items past `into`'s,
and plain values of `into` take the checkpoint's part whole. like=
restricts the same way.

Where a pair allows it, the checkpoint's bytes go straight into the caller's
memory: a contiguous tensor of the record's dtype, a raw record, not a view, no
other tensor sharing its bytes, on the CPU (the engine reads into it,
read_into.py) or on the device a load streams to (device_load.py copies each
chunk of the ring into it). Other pairs get the loaded tensor's values by copy_. Either way the
loaded object holds the caller's tensor object at that place.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import StateMismatchError
from ..format import dtypes
from ..format.manifest import TensorRecord
from . import state
from .factory import Factory

_ABSENT = object()
_MAX_LISTED = 5


@dataclass
class Placement:
    """The pairs of one load: tensor node (by id) -> the caller's tensor, and the
    entries read straight into the caller's memory."""

    dests: dict[int, torch.Tensor] = field(default_factory=dict)
    nodes: list[dict[str, Any]] = field(default_factory=list)  # keeps the ids valid
    direct: dict[int, torch.Tensor] = field(default_factory=dict)  # entry -> tensor

    def factory(self, make: Factory) -> Factory:
        """`make`, except that a paired node gives the caller's tensor, holding
        the node's values (already there if its entry was read into it)."""
        dests, direct = self.dests, self.direct

        def place(node: dict[str, Any]) -> torch.Tensor:
            dest = dests.get(id(node))
            if dest is None:
                return make(node)
            if direct.get(node.get("e")) is not dest:  # type: ignore[arg-type]
                value = make(node)
                with torch.no_grad():
                    dest.copy_(value)
            return dest

        return place

    def choose_direct(self, records: Sequence[TensorRecord], device: torch.device
                      ) -> dict[int, torch.Tensor]:
        """The entries (of a plain checkpoint's records) to read straight into
        their pair's memory on `device` (the CPU, or a load's ring's device);
        sets and returns self.direct."""
        by_entry: dict[int, list[dict[str, Any]]] = {}
        for node in self.nodes:
            e = node.get("e")
            if type(e) is int and 0 <= e < len(records):
                by_entry.setdefault(e, []).append(node)
        chosen: dict[int, torch.Tensor] = {}
        for e, nodes in by_entry.items():
            dest = self.dests[id(nodes[0])]
            if all(self.dests[id(n)] is dest and "view" not in n for n in nodes) and \
                    _fits_in_place(records[e], dest, device):
                chosen[e] = dest
        self.direct = _without_overlaps(chosen)
        return self.direct


def _fits_in_place(record: TensorRecord, dest: torch.Tensor, device: torch.device) -> bool:
    on_device = dest.device == device if device.type != "cpu" else dest.device.type == "cpu"
    return (record.frames is None and record.length > 0 and type(dest) in (
        torch.Tensor, torch.nn.Parameter) and on_device
        and dest.layout == torch.strided and dest.is_contiguous()
        and dest.dtype == dtypes.from_name(record.dtype) and dest.nbytes == record.length
        and tuple(dest.shape) == record.shape)


def _without_overlaps(chosen: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
    """`chosen` less every pair whose memory overlaps another's: those are
    copied one after the other (the last one's values win, as with copy_)
    rather than written by two readers at once."""
    spans = sorted((d.data_ptr(), d.data_ptr() + d.nbytes, e) for e, d in chosen.items())
    clash: set[int] = set()
    reach, owner = -1, -1
    for start, end, e in spans:
        if start < reach:
            clash |= {e, owner}
        if end > reach:
            reach, owner = end, e
    return {e: d for e, d in chosen.items() if e not in clash}


def match(tree: state.Node, into: Any, entry_shapes: list[tuple[int, ...]],
          where: str) -> Placement:
    """Pair the tensor nodes of `tree` with the tensors of `into`.

    entry_shapes: each entry's shape (a node with a view has the view's).
    Raises StateMismatchError naming the places that do not fit."""
    placement = Placement()
    wrong: list[str] = []
    missing: list[str] = []
    stack: list[tuple[state.Node, Any, str]] = [(tree, into, "")]
    while stack:
        node, obj, path = stack.pop()
        if isinstance(obj, torch.Tensor):
            if not _is_tensor_node(node):
                missing.append(path or "<root>")
                continue
            shape = _node_shape(node, entry_shapes)
            if obj.device.type == "meta" or obj.layout != torch.strided:
                wrong.append(f"{path or '<root>'} in `into` is a {obj.layout} tensor on "
                             f"{obj.device}, which has no memory to load into")
                continue
            if shape is not None and shape != tuple(obj.shape):
                wrong.append(f"{path or '<root>'} is {list(shape)} in the checkpoint, "
                             f"{list(obj.shape)} in `into`")
                continue
            placement.dests[id(node)] = obj
            placement.nodes.append(node)
            continue
        children = _children(node, obj, path)
        if children is None:  # no container of the kind here: `into` has more
            missing += _tensor_paths(obj, path)
            continue
        for child, value, child_path in children:
            if child is _ABSENT:
                missing += _tensor_paths(value, child_path)
            else:
                stack.append((child, value, child_path))
    if wrong or missing:
        problems = wrong + ([f"`into` has tensors the checkpoint does not: "
                             f"{', '.join(sorted(missing)[:_MAX_LISTED])}"
                             + (f" (and {len(missing) - _MAX_LISTED} more)"
                                if len(missing) > _MAX_LISTED else "")] if missing else [])
        raise StateMismatchError(
            f"{where}: the state passed as `into` does not fit the checkpoint: "
            + "; ".join(problems[:_MAX_LISTED + 1]) + "; nothing was read")
    return placement


def restrict(tree: state.Node, names: Any) -> state.Node:
    """The part of the checkpoint's `tree` that `names` (load's into= or
    like=) names; see the module's docstring."""
    if not isinstance(tree, dict):
        return tree
    tag = tree.get("t")
    if tag in ("dict", "odict") and isinstance(names, Mapping):
        cut = next(_walk_tensors(names, "", set()), None) is not None
        keys, values = [], []
        for k, v in zip(tree.get("k", []), tree.get("v", []), strict=False):
            key = _key(k)
            wanted = _lookup(names, key)
            if wanted is _ABSENT and cut and _holds_tensors(v):
                continue
            keys.append(k)
            values.append(v if wanted is _ABSENT else restrict(v, wanted))
        return {**tree, "k": keys, "v": values}
    if tag in ("list", "tuple") and isinstance(names, (list, tuple)):
        items = tree.get("v", [])
        return {**tree, "v": [restrict(v, names[i]) if i < len(names) else v
                              for i, v in enumerate(items)]}
    return tree


def _holds_tensors(node: state.Node) -> bool:
    return any(n.get("t") == "tensor" for n in state.tree_nodes(node))


def entries_in(tree: state.Node) -> list[int]:
    """The entries the tensor nodes of `tree` refer to, in order."""
    return sorted({n["e"] for n in state.tree_nodes(tree)
                   if n.get("t") == "tensor" and type(n.get("e")) is int})


def _is_tensor_node(node: state.Node) -> bool:
    return isinstance(node, dict) and node.get("t") == "tensor" and "np" not in node


def _node_shape(node: dict[str, Any], entry_shapes: list[tuple[int, ...]]
                ) -> tuple[int, ...] | None:
    view = node.get("view")
    if isinstance(view, dict) and isinstance(view.get("shape"), list):
        return tuple(view["shape"])
    e = node.get("e")
    if type(e) is int and 0 <= e < len(entry_shapes):
        return tuple(entry_shapes[e])
    return None  # a malformed node: the load itself names it


def _children(node: state.Node, obj: Any, path: str
              ) -> list[tuple[Any, Any, str]] | None:
    """(child node or _ABSENT, `into`'s value, path) for each item of `obj`,
    or None when `node` is not the same kind of container."""
    if not isinstance(node, dict):
        return None
    tag = node.get("t")
    if tag in ("dict", "odict") and isinstance(obj, Mapping):
        by_key: dict[Any, Any] = {}
        for k, v in zip(node.get("k", []), node.get("v", []), strict=False):
            key = _key(k)
            if key is not _ABSENT:
                by_key[key] = v
        return [(_lookup(by_key, key), value, _child_path(path, key))
                for key, value in obj.items()]
    if tag in ("list", "tuple") and isinstance(obj, (list, tuple)):
        items = node.get("v", [])
        return [(items[i] if i < len(items) else _ABSENT, value, _child_path(path, i))
                for i, value in enumerate(obj)]
    return None


def _key(k: Any) -> Any:
    """A dict key node as the loaded dict's key (_ABSENT: one that cannot be
    had without unpickling)."""
    if not isinstance(k, dict):
        return k
    try:
        return state.decode(k, lambda node: torch.empty(0))
    except Exception:  # a pickled key: nothing of `into` can pair under it
        return _ABSENT


def _lookup(by_key: Mapping[Any, Any], key: Any) -> Any:
    try:
        return by_key.get(key, _ABSENT)
    except TypeError:  # an unhashable key of `into`
        return _ABSENT


def _child_path(parent: str, key: object) -> str:
    return f"{parent}.{key}" if parent else str(key)


def _tensor_paths(obj: Any, path: str) -> list[str]:
    return list(_walk_tensors(obj, path, set()))


def _walk_tensors(obj: Any, path: str, seen: set[int]) -> Iterator[str]:
    if isinstance(obj, torch.Tensor):
        yield path or "<root>"
        return
    if id(obj) in seen or not isinstance(obj, (Mapping, list, tuple)):
        return
    seen.add(id(obj))
    items = obj.items() if isinstance(obj, Mapping) else enumerate(obj)
    for key, value in items:
        yield from _walk_tensors(value, _child_path(path, key), seen)
