"""A small GPT-2-style transformer in plain torch.nn, for the demo and benchmarks."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn


@dataclass(frozen=True)
class GPTConfig:
    vocab: int = 16384
    ctx: int = 64
    dim: int = 384
    layers: int = 4
    heads: int = 6


class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab, cfg.dim)
        self.pos = nn.Embedding(cfg.ctx, cfg.dim)
        self.blocks = nn.ModuleList(Block(cfg.dim, cfg.heads) for _ in range(cfg.layers))
        self.ln = nn.LayerNorm(cfg.dim)
        self.head = nn.Linear(cfg.dim, cfg.vocab, bias=False)
        self.head.weight = self.tok.weight  # tied, as in GPT-2
        mask = torch.triu(torch.full((cfg.ctx, cfg.ctx), -math.inf), 1)
        self.register_buffer("mask", mask)
        for name, w in self.named_parameters():
            if w.dim() == 2 and "attn" not in name:
                nn.init.normal_(w, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        x = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))
        for block in self.blocks:
            x = block(x, self.mask[:t, :t])
        return self.head(self.ln(x))


def synthetic_batch(step: int, cfg: GPTConfig, batch: int) -> torch.Tensor:
    """A learnable token stream: noisy arithmetic sequences, the same for a given step."""
    g = torch.Generator().manual_seed(step)
    start = torch.randint(0, cfg.vocab, (batch, 1), generator=g)
    stride = torch.randint(1, 7, (batch, 1), generator=g)
    seq = (start + stride * torch.arange(cfg.ctx + 1)) % cfg.vocab
    noise = torch.rand(seq.shape, generator=g) < 0.05
    return torch.where(noise, torch.randint(0, cfg.vocab, seq.shape, generator=g), seq)


def train_step(model: GPT, opt: torch.optim.Optimizer, step: int, batch: int) -> float:
    cfg = model.cfg
    data = synthetic_batch(step, cfg, batch)
    logits = model(data[:, :-1])
    loss = nn.functional.cross_entropy(logits.reshape(-1, cfg.vocab), data[:, 1:].reshape(-1))
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    return loss.item()


def tensors_of(obj: Any) -> list[torch.Tensor]:
    """Every tensor in a nested state, in order (aliases repeated)."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in tensors_of(v)]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in tensors_of(v)]
    return []


def unique_bytes(obj: Any) -> int:
    """Bytes of the distinct tensors in a state (a tied weight counts once)."""
    seen = {t.data_ptr(): t.numel() * t.element_size() for t in tensors_of(obj)}
    return sum(seen.values())
