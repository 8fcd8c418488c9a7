"""A deterministic, realistic training state: GPT-style bf16 weights plus fp32 AdamW state.

The layout is what `{"model": model.state_dict(), "optimizer": opt.state_dict(), "step": n}`
gives for a nanoGPT-shaped model trained with AdamW in bf16: per parameter 2 bytes of
weight and 8 bytes of optimizer moments, tensors from a few hundred bytes (biases,
layernorms, 0-d `step`) to hundreds of MB (embedding moments at 4 GiB). Tensors are
built directly, never through nn.Module, so a 4 GiB state costs only its own memory.

Every tensor has its own seed, so any single tensor can be regenerated to check a load
without holding a second copy of the whole state.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

VOCAB = 50304  # GPT-2 vocabulary padded to a multiple of 64, as nanoGPT does
CONTEXT = 2048
BYTES_PER_PARAM = 2 + 4 + 4  # bf16 weight, fp32 exp_avg, fp32 exp_avg_sq
TRAIN_STEP = 123
SMALL_TENSOR_BYTES = 4644  # 100,000 of them are the 443 MiB state of issue 14 (many_spec)

PathKey = tuple[str | int, ...]


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of the state: where it lives, its shape and dtype, how its values look."""

    path: PathKey
    shape: tuple[int, ...]
    dtype: torch.dtype
    kind: str  # weight | bias | ln_weight | ln_bias | exp_avg | exp_avg_sq | step
    seed: int

    @property
    def nbytes(self) -> int:
        numel = 1
        for dim in self.shape:
            numel *= dim
        return numel * torch.empty((), dtype=self.dtype).element_size()

    @property
    def flat_key(self) -> str:
        return ".".join(str(part) for part in self.path)


@dataclass(frozen=True)
class StateSpec:
    """Everything needed to rebuild, allocate or verify the state without materialising it."""

    d_model: int
    n_layer: int
    tensors: tuple[TensorSpec, ...]
    param_groups: tuple[dict[str, Any], ...]
    title: str = ""  # set for a state that is not GPT-shaped (many_spec)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    def describe(self) -> str:
        largest = max(self.tensors, key=lambda t: t.nbytes)
        smallest = min(self.tensors, key=lambda t: t.nbytes)
        if self.title:
            return (f"{self.title}: {len(self.tensors)} tensors, {self.nbytes / 2**20:.0f} MiB; "
                    f"largest {largest.nbytes} B, smallest {smallest.nbytes} B")
        return (
            f"GPT d_model={self.d_model} n_layer={self.n_layer} vocab={VOCAB}: "
            f"{len(self.tensors)} tensors, {self.nbytes / 2**30:.2f} GiB "
            f"(bf16 weights, fp32 AdamW exp_avg/exp_avg_sq, 0-d fp32 step); "
            f"largest {largest.flat_key} {largest.nbytes / 2**20:.0f} MiB, "
            f"smallest {smallest.nbytes} B"
        )


def _layer_params(d: int, layer: int) -> list[tuple[str, tuple[int, ...], str]]:
    prefix = f"transformer.h.{layer}."
    return [
        (prefix + "ln_1.weight", (d,), "ln_weight"),
        (prefix + "ln_1.bias", (d,), "ln_bias"),
        (prefix + "attn.c_attn.weight", (3 * d, d), "weight"),
        (prefix + "attn.c_attn.bias", (3 * d,), "bias"),
        (prefix + "attn.c_proj.weight", (d, d), "weight"),
        (prefix + "attn.c_proj.bias", (d,), "bias"),
        (prefix + "ln_2.weight", (d,), "ln_weight"),
        (prefix + "ln_2.bias", (d,), "ln_bias"),
        (prefix + "mlp.c_fc.weight", (4 * d, d), "weight"),
        (prefix + "mlp.c_fc.bias", (4 * d,), "bias"),
        (prefix + "mlp.c_proj.weight", (d, 4 * d), "weight"),
        (prefix + "mlp.c_proj.bias", (d,), "bias"),
    ]


def _model_shape(target_bytes: int) -> tuple[int, int]:
    """Pick (d_model, n_layer): GPT proportions (n_layer ~ d_model / 32), filling the target."""
    params = target_bytes // BYTES_PER_PARAM
    d_model = 128
    # Widest model whose embedding plus d/32 layers still fits: keeps the embedding a
    # realistic 10-35% of the parameters at any size instead of all of a small state.
    while True:
        wider = d_model + 128
        if VOCAB * wider + 12 * wider * wider * (wider // 32) > params:
            break
        d_model = wider
    per_layer = 12 * d_model * d_model + 13 * d_model
    fixed = (VOCAB + CONTEXT + 2) * d_model
    n_layer = max(1, round((params - fixed) / per_layer))
    return d_model, n_layer


def _param_groups(decay: list[int], no_decay: list[int]) -> tuple[dict[str, Any], ...]:
    common: dict[str, Any] = {
        "lr": 6e-4,
        "betas": (0.9, 0.95),
        "eps": 1e-8,
        "amsgrad": False,
        "foreach": None,
        "maximize": False,
        "capturable": False,
        "differentiable": False,
        "fused": None,
        "decoupled_weight_decay": True,
    }
    return (
        {**common, "weight_decay": 0.1, "params": decay},
        {**common, "weight_decay": 0.0, "params": no_decay},
    )


def make_spec(target_bytes: int, seed: int = 0) -> StateSpec:
    d, n_layer = _model_shape(target_bytes)
    params: list[tuple[str, tuple[int, ...], str]] = [
        ("transformer.wte.weight", (VOCAB, d), "weight"),
        ("transformer.wpe.weight", (CONTEXT, d), "weight"),
    ]
    for layer in range(n_layer):
        params.extend(_layer_params(d, layer))
    params.extend(
        [("transformer.ln_f.weight", (d,), "ln_weight"), ("transformer.ln_f.bias", (d,), "ln_bias")]
    )

    # torch numbers optimizer state by position in param_groups: the decayed matrices
    # form group 0, biases and layernorms group 1.
    decay_names = [name for name, shape, _ in params if len(shape) == 2]
    no_decay_names = [name for name, shape, _ in params if len(shape) != 2]
    index = {name: i for i, name in enumerate(decay_names + no_decay_names)}

    tensors: list[TensorSpec] = []

    def add(path: PathKey, shape: tuple[int, ...], dtype: torch.dtype, kind: str) -> None:
        tensors.append(TensorSpec(path, shape, dtype, kind, seed * 1_000_003 + len(tensors)))

    for name, shape, kind in params:
        add(("model", name), shape, torch.bfloat16, kind)
    for name, shape, _kind in sorted(params, key=lambda p: index[p[0]]):
        i = index[name]
        add(("optimizer", "state", i, "step"), (), torch.float32, "step")
        add(("optimizer", "state", i, "exp_avg"), shape, torch.float32, "exp_avg")
        add(("optimizer", "state", i, "exp_avg_sq"), shape, torch.float32, "exp_avg_sq")
    groups = _param_groups(
        list(range(len(decay_names))), list(range(len(decay_names), len(params)))
    )
    return StateSpec(d, n_layer, tuple(tensors), groups)


MANY_KINDS = (("weight", torch.bfloat16), ("bias", torch.float32), ("exp_avg", torch.float32),
              ("exp_avg_sq", torch.float32))


def many_spec(count: int, tensor_bytes: int, seed: int = 0) -> StateSpec:
    """`count` small tensors of about `tensor_bytes` each (from half to one and a half
    times it, deterministically): bf16 2-D weights and fp32 biases and AdamW moments,
    under "model", in the same {"model", "optimizer", "step"} frame as the GPT state."""
    tensors = []
    for i in range(count):
        kind, dtype = MANY_KINDS[i % len(MANY_KINDS)]
        nbytes = tensor_bytes // 2 + (i * 7919) % max(tensor_bytes, 1)
        itemsize = torch.empty((), dtype=dtype).element_size()
        numel = max(1, nbytes // itemsize)
        shape: tuple[int, ...] = (numel,)
        if kind == "weight":
            cols = 16
            shape = (max(1, numel // cols), cols)
        tensors.append(TensorSpec(("model", f"layers.{i // 4}.{kind}"), shape, dtype, kind,
                                  seed * 1_000_003 + i))
    title = f"{count} small tensors (~{tensor_bytes} B each: bf16 weights, fp32 biases and moments)"
    return StateSpec(0, 0, tuple(tensors), (), title)


def spec_from(state: dict[str, Any], seed: int) -> StateSpec:
    """The state a job describes: {"kind": "gpt", "bytes": n} or
    {"kind": "many", "tensors": n, "tensor_bytes": b}."""
    if state["kind"] == "many":
        return many_spec(state["tensors"], state["tensor_bytes"], seed)
    return make_spec(state["bytes"], seed)


def make_tensor(spec: TensorSpec) -> torch.Tensor:
    """The values of one tensor; same spec, same bytes, in every process."""
    if spec.kind == "step":
        return torch.tensor(float(TRAIN_STEP), dtype=spec.dtype)
    gen = torch.Generator().manual_seed(spec.seed)
    values = torch.randn(spec.shape, generator=gen, dtype=spec.dtype)
    # In-place scaling: no temporary the size of the tensor.
    if spec.kind == "weight":
        values.mul_(0.02)
    elif spec.kind == "bias" or spec.kind == "ln_bias":
        values.mul_(0.01)
    elif spec.kind == "ln_weight":
        values.mul_(0.05).add_(1.0)
    elif spec.kind == "exp_avg":
        values.mul_(1e-3)
    elif spec.kind == "exp_avg_sq":
        values.square_().mul_(1e-6)
    return values


def _insert(root: dict[Any, Any], path: PathKey, value: object) -> None:
    node = root
    for part in path[:-1]:
        node = node.setdefault(part, {})
    node[path[-1]] = value


def _plain_values(spec: StateSpec) -> dict[str, Any]:
    return {
        "optimizer": {
            "param_groups": [dict(g, params=list(g["params"])) for g in spec.param_groups]
        },
        "step": TRAIN_STEP,
    }


# The top-level keys of every state (_assemble), for loaders that must name what to read.
STATE_KEYS = ("model", "optimizer", "step")


def _assemble(spec: StateSpec, tensors: list[torch.Tensor]) -> dict[str, Any]:
    state: dict[str, Any] = {"model": {}, "optimizer": {"state": {}}}
    for tspec, tensor in zip(spec.tensors, tensors, strict=True):
        _insert(state, tspec.path, tensor)
    plain = _plain_values(spec)
    state["optimizer"]["param_groups"] = plain["optimizer"]["param_groups"]
    state["step"] = plain["step"]
    return state


def build_state(spec: StateSpec) -> dict[str, Any]:
    """The full state with values, as a trainer would hand it to a checkpoint call."""
    return _assemble(spec, [make_tensor(t) for t in spec.tensors])


def build_skeleton(spec: StateSpec) -> dict[str, Any]:
    """Same structure, uninitialised tensors, zeroed plain values: for in-place loaders (DCP).

    torch.empty of a large tensor maps fresh pages that only become resident when the loader
    writes them, so this skeleton adds almost nothing to the RSS baseline of a load.
    """
    state = _assemble(spec, [torch.empty(t.shape, dtype=t.dtype) for t in spec.tensors])
    state["step"] = 0
    for group in state["optimizer"]["param_groups"]:
        group["lr"] = 0.0
    return state


def flatten_tensors(state: dict[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """safetensors form: dotted keys to tensors, plain values as JSON strings in the metadata."""
    tensors: dict[str, torch.Tensor] = {}
    metadata: dict[str, str] = {}

    def walk(node: object, prefix: str) -> None:
        if isinstance(node, torch.Tensor):
            tensors[prefix] = node
        elif isinstance(node, dict) and not prefix.endswith("param_groups"):
            for key, value in node.items():
                walk(value, f"{prefix}.{key}" if prefix else str(key))
        else:
            metadata[prefix] = json.dumps(node)

    walk(state, "")
    return tensors, metadata


def local_tensors(node: object) -> list[torch.Tensor]:
    """Every tensor in a nested state, a DTensor as its local shard (what a
    snapshot of this process copies)."""
    from torch.distributed.tensor import DTensor

    return [t.to_local() if isinstance(t, DTensor) else t for t in iter_tensors(node)]


def copy_floor(tensors: list[torch.Tensor], buffer: torch.Tensor) -> float:
    """Seconds to copy `tensors` into one touched buffer (at least their bytes):
    the least a snapshot costs."""
    start = time.perf_counter()
    offset = 0
    for t in tensors:
        n = t.numel() * t.element_size()
        buffer[offset:offset + n].view(t.dtype).view(t.shape).copy_(t)
        offset += n
    return time.perf_counter() - start


def iter_tensors(node: object) -> Iterator[torch.Tensor]:
    """Every tensor in a nested dict/list state, in no particular order."""
    if isinstance(node, torch.Tensor):
        yield node
    elif isinstance(node, dict):
        for value in node.values():
            yield from iter_tensors(value)
    elif isinstance(node, (list, tuple)):
        for value in node:
            yield from iter_tensors(value)


def sample_for_verify(spec: StateSpec) -> list[TensorSpec]:
    """Tensors whose values a load must reproduce: largest, a 0-d step, a bf16 matrix, a bias."""
    by_size = sorted(spec.tensors, key=lambda t: t.nbytes)
    picks = [by_size[-1], by_size[0]]
    picks.append(next(t for t in spec.tensors if t.dtype == torch.bfloat16 and len(t.shape) == 2))
    picks.append(next(t for t in spec.tensors if t.kind == "bias"))
    return picks


def _lookup(state: object, path: PathKey) -> object:
    node = state
    for part in path:
        if not isinstance(node, dict) or part not in node:
            raise KeyError(".".join(map(str, path)))
        node = node[part]
    return node


def _check_tensor(got: object, tspec: TensorSpec) -> None:
    if not isinstance(got, torch.Tensor):
        raise TypeError(f"{tspec.flat_key}: expected a tensor, got {type(got).__name__}")
    if tuple(got.shape) != tspec.shape or got.dtype != tspec.dtype:
        raise ValueError(
            f"{tspec.flat_key}: got {tuple(got.shape)} {got.dtype},"
            f" want {tspec.shape} {tspec.dtype}"
        )


def verify_nested(state: object, spec: StateSpec) -> None:
    """Raise if a loaded nested state differs from the saved one (structure, plain values, data)."""
    for tspec in spec.tensors:
        _check_tensor(_lookup(state, tspec.path), tspec)
    plain = _plain_values(spec)
    if _lookup(state, ("step",)) != plain["step"]:
        raise ValueError("step differs")
    if _lookup(state, ("optimizer", "param_groups")) != plain["optimizer"]["param_groups"]:
        raise ValueError("optimizer.param_groups differ")
    for tspec in sample_for_verify(spec):
        if not torch.equal(_lookup(state, tspec.path), make_tensor(tspec)):  # type: ignore[arg-type]
            raise ValueError(f"{tspec.flat_key}: values differ")


def verify_flat(tensors: dict[str, torch.Tensor], spec: StateSpec) -> None:
    """Raise if a loaded safetensors dict differs from the tensors saved."""
    if len(tensors) != len(spec.tensors):
        raise ValueError(f"{len(tensors)} tensors loaded, {len(spec.tensors)} saved")
    for tspec in spec.tensors:
        _check_tensor(tensors.get(tspec.flat_key), tspec)
    for tspec in sample_for_verify(spec):
        if not torch.equal(tensors[tspec.flat_key], make_tensor(tspec)):
            raise ValueError(f"{tspec.flat_key}: values differ")
