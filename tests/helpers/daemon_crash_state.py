"""The deterministic states of tests/test_daemon_crash.py, shared by the test and
its client processes (tests/helpers/daemon_crash_client.py), so that the test can
recompute exactly what a killed client saved.

State of `step` with `tensors` int32 tensors of `numel` elements each:
    {"step": step, "meta": {"name": "stepSTEP"},
     "weights": {"wI": 3 * arange(numel) + 7 * step + I + 1},
     "bias": float32 randn(4096) from a generator seeded with step}
Every element of every weight is nonzero, so a data section that was only
partly written ends in zero pages (the daemon preallocates its files).
"""

from __future__ import annotations

from typing import Any

import torch


def make_state(step: int, tensors: int, numel: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(10_000 + step)
    weights = {}
    for i in range(tensors):
        w = torch.arange(numel, dtype=torch.int32)
        w.mul_(3).add_(7 * step + i + 1)
        weights[f"w{i}"] = w
    return {
        "step": step,
        "meta": {"name": f"step{step}"},
        "weights": weights,
        "bias": torch.randn(4096, generator=g, dtype=torch.float32),
    }


def state_nbytes(tensors: int, numel: int) -> int:
    return tensors * numel * 4 + 4096 * 4


def mismatch(loaded: Any, step: int, tensors: int, numel: int) -> str | None:
    """Why `loaded` is not exactly make_state(step, ...); None if it is."""
    want = make_state(step, tensors, numel)
    if not isinstance(loaded, dict) or sorted(loaded) != sorted(want):
        return f"keys {sorted(loaded) if isinstance(loaded, dict) else type(loaded)}"
    if loaded["step"] != step or loaded["meta"] != want["meta"]:
        return f"step/meta {loaded['step']!r} {loaded['meta']!r}, want step {step}"
    if sorted(loaded["weights"]) != sorted(want["weights"]):
        return f"weights {sorted(loaded['weights'])}"
    for name, w in want["weights"].items():
        got = loaded["weights"][name]
        if got.dtype != w.dtype or got.shape != w.shape or not torch.equal(got, w):
            return f"weights[{name!r}] differs from step {step}'s"
    b = loaded["bias"]
    if b.dtype != torch.float32 or not torch.equal(b, want["bias"]):
        return "bias differs"
    return None
