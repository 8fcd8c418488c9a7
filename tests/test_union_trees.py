"""Joining the ranks' trees into the job's with union=True (distributed/trees.py),
on trees the real encoder makes."""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import pytest
import torch

from fastpersist.distributed.trees import TreeConflict, joined, renumbered
from fastpersist.tensors import state


def tree_of(obj: Any) -> tuple[Any, list[str]]:
    """A rank's tree and its entries' keys, as the coordinator has them."""
    tree, leaves = state.encode(obj, sharded=True)
    keys = []
    for n, leaf in enumerate(leaves):
        leaf.node["e"] = n
        keys.append(leaf.path)
    return tree, keys


def job_tree(*states: Any) -> Any:
    parts = [tree_of(s) for s in states]
    order: dict[str, int] = {}
    for _, keys in parts:
        for k in keys:
            order.setdefault(k, len(order))
    return joined([(rank, renumbered(tree, keys, order))
                   for rank, (tree, keys) in enumerate(parts)]), list(order)


def test_stages_join_into_one_state_that_decodes_to_the_union() -> None:
    a = {"model": OrderedDict([("layers.0.w", torch.ones(2)), ("tied", torch.zeros(3))]),
         "step": 7, "sched": {"stage0": {"lr": 0.1}}}
    b = {"model": OrderedDict([("tied", torch.zeros(3)), ("layers.1.w", torch.full((2,), 2.0))]),
         "step": 7, "sched": {"stage1": {"lr": 0.2}}}
    tree, keys = job_tree(a, b)
    assert keys == ["model.layers.0.w", "model.tied", "model.layers.1.w"]
    tensors = {"model.layers.0.w": a["model"]["layers.0.w"], "model.tied": a["model"]["tied"],
               "model.layers.1.w": b["model"]["layers.1.w"]}
    out = state.decode(tree, lambda node: tensors[keys[node["e"]]])
    assert list(out["model"]) == ["layers.0.w", "tied", "layers.1.w"]
    assert type(out["model"]) is OrderedDict
    assert out["step"] == 7 and out["sched"] == {"stage0": {"lr": 0.1}, "stage1": {"lr": 0.2}}
    assert torch.equal(out["model"]["layers.1.w"], torch.full((2,), 2.0))


def test_module_metadata_of_each_stage_is_kept() -> None:
    a = torch.nn.Sequential(torch.nn.Linear(2, 2)).state_dict()
    b = torch.nn.Sequential(torch.nn.Identity(), torch.nn.Linear(2, 2)).state_dict()
    tree, _ = job_tree({"m": a}, {"m": b})
    meta = state.decode(tree, lambda node: torch.zeros(2))["m"]._metadata
    assert set(meta) >= {"", "0", "1"}


def test_a_value_two_stages_hold_differently_is_refused_by_path() -> None:
    a = {"optim": {"param_groups": [{"lr": 0.1, "params": ["layers.0.w"]}]}}
    b = {"optim": {"param_groups": [{"lr": 0.1, "params": ["layers.1.w"]}]}}
    with pytest.raises(TreeConflict, match=r'^optim.param_groups.0.params is \["layers.0.w"\] '
                       r'on rank 0 but \["layers.1.w"\] on rank 1: .*flatten_optimizer'):
        job_tree(a, b)


def test_a_tensor_where_another_rank_has_a_value_is_refused() -> None:
    with pytest.raises(TreeConflict, match=r"^x is a tensor on rank 0 but 3 on rank 1"):
        job_tree({"x": torch.ones(1)}, {"x": 3})


def test_an_index_keyed_optimizer_on_two_stages_is_refused() -> None:
    # torch.optim's state_dict(): the same indices name other parameters on each stage.
    def optim_state(width: int) -> Any:
        p = torch.nn.Parameter(torch.ones(width))
        opt = torch.optim.Adam([p])
        p.grad = torch.ones(width)
        opt.step()
        return {"optim": opt.state_dict()}

    with pytest.raises(TreeConflict, match=r"optim is an optimizer state_dict keyed by "
                       r"parameter index on rank 0 and rank 1.*flatten_optimizer_state_dict"):
        job_tree(optim_state(4), optim_state(4))
    # Nested under a key per stage, the same optimizers join.
    _, keys = job_tree({"stage0": optim_state(4)}, {"stage1": optim_state(4)})
    assert "stage1.optim.state.0.exp_avg" in keys


def test_renumbering_follows_aliases() -> None:
    w = torch.ones(2)
    tree, leaves = state.encode({"embed": w, "head": w, "other": torch.zeros(1)}, sharded=True)
    # As coordinator.unaliased numbers them: head is stored once, under embed.
    for leaf, e in zip(leaves, [0, 0, 1], strict=True):
        leaf.node["e"] = e
    out = renumbered(tree, ["embed", "other"], {"x": 0, "other": 1, "embed": 2})
    assert [node["e"] for node in out["v"]] == [2, 2, 1]
    assert [node["e"] for node in tree["v"]] == [0, 0, 1]  # the rank's own tree is unchanged
