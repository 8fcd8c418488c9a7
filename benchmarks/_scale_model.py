"""Simulated metadata for scale_sim.py: a Llama-style transformer's state (params
in bf16, Adam's exp_avg and exp_avg_sq in fp32, a step per parameter) sharded
TP x PP x FSDP with data-parallel replicas (HSDP), as each rank would describe
it (fastpersist.distributed.planner.Item), without a tensor byte.

Ranks are laid out rank = ((dp * PP + pp) * FSDP + fsdp) * TP + tp, 8 ranks per
node (TP within a node, as is usual). Column-parallel weights (wq, wk, wv, w1,
w3, the embedding and the output) are cut along dim 0 by TP, row-parallel ones
(wo, w2) along dim 1; FSDP then cuts the TP shard along dim 0 (FSDP2's
Shard(0)), with torch.chunk's sizes (the last shards may be short or empty).
Norms are replicated over TP and cut by FSDP. Layers go to PP stages as evenly
as they divide; stage 0 also holds the embedding, the last the norm and output.

PP is 1 in MODELS: the planner (make_plan's _check_keys) requires every rank of
one job to hold the same keys, so a pipeline-parallel job cannot be one
fastpersist job today (each stage would save as its own process group); the
models here are TP x FSDP x DP, with the whole model's keys on every rank.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from fastpersist.distributed.planner import Item

RANKS_PER_NODE = 8


@dataclass(frozen=True)
class Model:
    name: str
    hidden: int
    layers: int
    ffn: int
    heads: int
    kv_heads: int
    vocab: int
    tp: int
    pp: int
    fsdp_max: int  # FSDP shards within this many ranks; the rest are DP replicas

    def mesh(self, world: int) -> tuple[int, int, int, int]:
        """(TP, PP, FSDP, DP) for `world` ranks."""
        rest = world // (self.tp * self.pp)
        if rest * self.tp * self.pp != world or rest < 1:
            raise ValueError(f"{world} ranks do not divide into TP {self.tp} x PP {self.pp}")
        fsdp = min(rest, self.fsdp_max)
        return self.tp, self.pp, fsdp, rest // fsdp


MODELS = {
    "llama-70b": Model("llama-70b", 8192, 80, 28672, 64, 8, 128256, tp=8, pp=1, fsdp_max=16),
    "llama-405b": Model("llama-405b", 16384, 126, 53248, 128, 8, 128256, tp=8, pp=1,
                        fsdp_max=64),
}


def _params(m: Model, stage: int) -> list[tuple[str, tuple[int, ...], int | None]]:
    """(name, global shape, TP dim) of the parameters of PP stage `stage`."""
    per, extra = divmod(m.layers, m.pp)
    first = stage * per + min(stage, extra)
    count = per + (stage < extra)
    h, kv = m.hidden, m.kv_heads * (m.hidden // m.heads)
    out: list[tuple[str, tuple[int, ...], int | None]] = []
    if stage == 0:
        out.append(("tok_embeddings.weight", (m.vocab, h), 0))
    for i in range(first, first + count):
        p = f"layers.{i}."
        out += [(p + "attention.wq.weight", (h, h), 0), (p + "attention.wk.weight", (kv, h), 0),
                (p + "attention.wv.weight", (kv, h), 0), (p + "attention.wo.weight", (h, h), 1),
                (p + "feed_forward.w1.weight", (m.ffn, h), 0),
                (p + "feed_forward.w2.weight", (h, m.ffn), 1),
                (p + "feed_forward.w3.weight", (m.ffn, h), 0),
                (p + "attention_norm.weight", (h,), None), (p + "ffn_norm.weight", (h,), None)]
    if stage == m.pp - 1:
        out += [("norm.weight", (h,), None), ("output.weight", (m.vocab, h), 0)]
    return out


def _chunk(n: int, parts: int, i: int) -> tuple[int, int]:
    """torch.chunk's part i of n: (start, length)."""
    size = math.ceil(n / parts)
    start = min(i * size, n)
    return start, max(0, min(n, start + size) - start)


def _box(shape: tuple[int, ...], tp_dim: int | None, tp: int, t: int, fsdp: int, f: int
         ) -> tuple[tuple[int, ...], tuple[int, ...]]:
    offsets, sizes = [0] * len(shape), list(shape)
    if tp_dim is not None:
        offsets[tp_dim], sizes[tp_dim] = _chunk(shape[tp_dim], tp, t)
    start, length = _chunk(sizes[0], fsdp, f)
    offsets[0] += start
    sizes[0] = length
    return tuple(offsets), tuple(sizes)


def items_of(m: Model, world: int, pp: int, fsdp: int, tp: int) -> tuple[Item, ...]:
    """What the ranks at mesh coordinate (pp, fsdp, tp) hold (every DP replica alike)."""
    tps, _, fsdps, _ = m.mesh(world)
    out = []
    for name, shape, tp_dim in _params(m, pp):
        offsets, sizes = _box(shape, tp_dim, tps, tp, fsdps, fsdp)
        out.append(Item(f"model.{name}", "BF16", shape, offsets, sizes))
        for state in ("exp_avg", "exp_avg_sq"):
            out.append(Item(f"optim.state.{name}.{state}", "F32", shape, offsets, sizes))
        out.append(Item.whole(f"optim.state.{name}.step", "F32", ()))
    return tuple(out)


def coordinates(m: Model, world: int) -> list[tuple[int, int, int]]:
    """Each rank's (pp, fsdp, tp), by rank."""
    tp, pp, fsdp, dp = m.mesh(world)
    return [(p, f, t) for _ in range(dp) for p in range(pp) for f in range(fsdp)
            for t in range(tp)]


def node_of(rank: int) -> str:
    return f"node{rank // RANKS_PER_NODE:05d}"
