"""The job's tree when ranks hold different parts of the state (union=True).

A checkpoint has one tree (tensors/state.py): the state's structure and its
non-tensor values, each tensor a node naming its entry. With union=True the
ranks' trees differ (each pipeline stage has its layers, its optimizer
states, its param_groups), and rank 0 joins one tree from each set of ranks
that hold the same keys:

- dicts are joined key by key, in the order the ranks (lowest first) list them;
- a tensor node names the same tensor wherever it appears (its key), and
  the lowest rank's node is kept (its device);
- any other value that several of them hold must be the same in each.
  Nothing is kept over another: two stages' values for one name (their
  param_groups under one key) are refused by name, as a checkpoint holding
  one of them would lose the other (get_optimizer_state_dict's
  flatten_optimizer_state_dict=True keys param_groups by parameter name);
- an optimizer's state_dict keyed by parameter index (torch.optim's
  state_dict()) held at one place by several of them is refused: its
  indices name different parameters on each stage, so its tensors would
  be taken for replicas of one another.

Pure functions of their inputs.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from ..errors import CheckpointError
from ..format.tree import key_text

Node = Any  # a JSON value (tensors/state.py)
_DICTS = ("dict", "odict")


class TreeConflict(CheckpointError):
    """Ranks hold different values, or different kinds of node, at one place."""


def renumbered(tree: Node, entry_keys: Sequence[str], keys: dict[str, int]) -> Node:
    """A copy of a rank's tree whose tensor nodes name the job's tensors
    (index in `keys`) instead of the rank's own (index in entry_keys)."""
    if isinstance(tree, list):
        return [renumbered(v, entry_keys, keys) for v in tree]
    if not isinstance(tree, dict):
        return tree
    if tree.get("t") == "tensor":
        return {**tree, "e": keys[entry_keys[tree["e"]]]}
    return {k: renumbered(v, entry_keys, keys) for k, v in tree.items()}


def joined(parts: Sequence[tuple[int, Node]]) -> Node:
    """One tree from the renumbered trees of (rank, tree), lowest rank first;
    raises TreeConflict where they cannot be joined (module docstring)."""
    out, held_by = parts[0][1], parts[0][0]
    for rank, tree in parts[1:]:
        out = _join(out, tree, "", held_by, rank)
    return out


def _join(a: Node, b: Node, path: str, rank_a: int, rank_b: int) -> Node:
    if _is_dict(a) and _is_dict(b) and a["t"] == b["t"]:
        _refuse_indexed_optimizer(a, b, path, rank_a, rank_b)
        return _join_dicts(a, b, path, rank_a, rank_b)
    if (_is_sequence(a) and _is_sequence(b) and a["t"] == b["t"]
            and len(a["v"]) == len(b["v"]) and a != b
            and any(_is_dict(v) or _is_sequence(v) for v in a["v"])):
        # Down to the container that differs, so that the error names it.
        return {**a, "v": [_join(x, y, f"{path}.{n}" if path else str(n), rank_a, rank_b)
                           for n, (x, y) in enumerate(zip(a["v"], b["v"], strict=True))]}
    if _is_tensor(a) and _is_tensor(b):
        if a.get("e") != b.get("e"):
            raise TreeConflict(f"{path or '<root>'} names another tensor on rank {rank_b} "
                               f"than on rank {rank_a} (tied to another key on one of them)")
        return a
    if a == b:
        return a
    raise TreeConflict(
        f"{path or '<root>'} is {_show(a)} on rank {rank_a} but {_show(b)} on rank {rank_b}: "
        "with union=True a value that ranks of different stages hold must be the same on "
        "each (a checkpoint keeping one would lose the other); keep each stage's values "
        "under a key of its own (an optimizer's param_groups: get_optimizer_state_dict with "
        "StateDictOptions(flatten_optimizer_state_dict=True) keys them by parameter name)")


def _join_dicts(a: dict[str, Any], b: dict[str, Any], path: str, rank_a: int,
                rank_b: int) -> dict[str, Any]:
    index = {_ident(k): n for n, k in enumerate(a["k"])}
    keys, values = list(a["k"]), list(a["v"])
    for n, (k, v) in enumerate(zip(b["k"], b["v"], strict=True)):
        at = index.get(_ident(k))
        child = f"{path}.{key_text(k, n)}" if path else key_text(k, n)
        if at is None:
            index[_ident(k)] = len(keys)
            keys.append(k)
            values.append(v)
        else:
            values[at] = _join(values[at], v, child, rank_a, rank_b)
    out = {**a, "k": keys, "v": values}
    if "meta" in b:  # a module's state_dict metadata: each stage's modules' versions
        out["meta"] = (_join(a["meta"], b["meta"], f"{path}<meta>", rank_a, rank_b)
                       if "meta" in a else b["meta"])
    return out


def _refuse_indexed_optimizer(a: dict[str, Any], b: dict[str, Any], path: str, rank_a: int,
                              rank_b: int) -> None:
    if _indexed_optimizer(a) and _indexed_optimizer(b):
        raise TreeConflict(
            f"{path or '<root>'} is an optimizer state_dict keyed by parameter index on rank "
            f"{rank_a} and rank {rank_b}, which hold different parameters: its indices name "
            "other parameters on each, and their states would be taken for one another's "
            "replicas. Key it by parameter name (torch.distributed.checkpoint.state_dict's "
            "get_optimizer_state_dict with StateDictOptions(flatten_optimizer_state_dict="
            "True)) or nest each stage's optimizer under a key of its own")


def _indexed_optimizer(node: dict[str, Any]) -> bool:
    """torch.optim's state_dict(): {"state": {int: ...}, "param_groups": [...]}."""
    named = {k: v for k, v in zip(node["k"], node["v"], strict=True) if isinstance(k, str)}
    state, groups = named.get("state"), named.get("param_groups")
    return (isinstance(state, dict) and _is_dict(state) and isinstance(groups, dict)
            and groups.get("t") == "list" and any(type(k) is int for k in state["k"]))


def _is_dict(node: Node) -> bool:
    return isinstance(node, dict) and node.get("t") in _DICTS


def _is_sequence(node: Node) -> bool:
    return (isinstance(node, dict) and node.get("t") in ("list", "tuple")
            and isinstance(node.get("v"), list))


def _is_tensor(node: Node) -> bool:
    return isinstance(node, dict) and node.get("t") == "tensor"


def _ident(key: Node) -> str:
    return json.dumps(key, sort_keys=True)


def _show(node: Node) -> str:
    if _is_tensor(node):
        return "a tensor"
    if _is_sequence(node) and not any(isinstance(v, dict | list) for v in node["v"]):
        text = json.dumps(node["v"])  # a list of plain values: show them
    elif isinstance(node, dict) and node.get("t") in ("list", "tuple", *_DICTS):
        return f"a {node['t']}"
    else:
        text = json.dumps(node, sort_keys=True)
    return text if len(text) <= 60 else text[:57] + "..."


__all__ = ["TreeConflict", "joined", "renumbered"]
