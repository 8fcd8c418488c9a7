"""The on-disk format does not drift: a save of a fixed state gives the bytes
committed in tests/fixtures/layout-v1 (written by the code before the package
was reorganised), and that checkpoint still loads.

    python tests/test_layout_fixture.py     rewrites the fixture (only on purpose:
                                            a format change, with a new schema version)
"""

from __future__ import annotations

import json
import shutil
import sys
from collections import OrderedDict
from pathlib import Path
from typing import Any

import torch

import fastpersist

FIXTURE = Path(__file__).parent / "fixtures" / "layout-v1"
# What a save writes differently each time: when, and by which version.
VOLATILE = ("created_unix", "fastpersist_version")


def fixed_state() -> dict[str, Any]:
    """A small state that touches every part of the format: dtypes, a 0-d and an
    empty tensor, a view and a non-contiguous tensor of one storage, tied
    weights, a Parameter, nested containers and plain values."""
    g = torch.Generator().manual_seed(20261130)
    base = torch.randn(4, 6, generator=g)
    tied = torch.arange(12, dtype=torch.float32)
    return {
        "model": OrderedDict(
            w=base,
            w_t=base.t(),  # non-contiguous view of base
            row=base[1],  # a view into base
            emb=tied,
            head=tied,  # tied weights: stored once
            bias=torch.nn.Parameter(torch.ones(3, dtype=torch.bfloat16)),
        ),
        "optim": {
            "state": {0: {"step": torch.tensor(7.0),
                          "exp_avg": torch.zeros(2, 2, dtype=torch.float16)}},
            "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.999), "params": [0, 1],
                              "nan": float("nan")}],
        },
        "ints": torch.arange(-3, 3, dtype=torch.int64),
        "mask": torch.tensor([True, False, True]),
        "bytes": torch.arange(5, dtype=torch.uint8),
        "empty": torch.empty(0, 4),
        "meta": {"name": "fixture", "step": 100, "none": None, "blob": b"\x00\x01",
                 "dtype": torch.bfloat16, "size": torch.Size([2, 3])},
    }


def _manifest(path: Path) -> dict[str, Any]:
    doc = json.loads((path / "manifest.json").read_bytes())
    return {k: v for k, v in doc.items() if k not in VOLATILE}


def test_a_save_writes_the_committed_bytes(tmp_path: Path) -> None:
    target = tmp_path / "ckpt"
    fastpersist.save(fixed_state(), target)
    expected = sorted(p.name for p in FIXTURE.iterdir())
    assert sorted(p.name for p in target.iterdir()) == expected
    for name in expected:
        if name == "manifest.json":
            assert _manifest(target) == _manifest(FIXTURE)
        else:
            assert (target / name).read_bytes() == (FIXTURE / name).read_bytes(), name


def test_the_manifest_has_a_line_per_record(tmp_path: Path) -> None:
    """Compact JSON (the C encoder's), one file or tensor record a line: diffs
    of two manifests show the records that changed."""
    lines = (FIXTURE / "manifest.json").read_text().splitlines()
    doc = json.loads((FIXTURE / "manifest.json").read_bytes())
    for key in ("files", "tensors"):
        start = lines.index(f' "{key}": [')
        rows = lines[start + 1 : start + 1 + len(doc[key])]
        assert [json.loads(row.rstrip(",")) for row in rows] == doc[key]


def test_an_indented_manifest_still_loads(tmp_path: Path) -> None:
    """Manifests written before the compact form (json.dumps with indent=1)."""
    old = tmp_path / "old"
    shutil.copytree(FIXTURE, old)
    doc = json.loads((old / "manifest.json").read_bytes())
    (old / "manifest.json").write_text(json.dumps(doc, indent=1) + "\n")
    _assert_same(fastpersist.load(old), fixed_state())


def test_the_committed_checkpoint_loads(tmp_path: Path) -> None:
    loaded = fastpersist.load(FIXTURE)
    want = fixed_state()
    assert loaded["model"]["head"] is loaded["model"]["emb"]  # still tied
    assert loaded["model"]["row"].untyped_storage().data_ptr() == \
        loaded["model"]["w"].untyped_storage().data_ptr()  # still a view of w
    _assert_same(loaded, want)


def _assert_same(a: Any, b: Any) -> None:
    if isinstance(b, torch.Tensor):
        assert isinstance(a, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(a, b)  # (no NaN among the fixture's tensors)
        return
    if isinstance(b, dict):
        assert type(a) is type(b) and list(a) == list(b)
        for k in b:
            _assert_same(a[k], b[k])
        return
    if isinstance(b, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            _assert_same(x, y)
        return
    if isinstance(b, float) and b != b:
        assert a != a
        return
    assert a == b and type(a) is type(b)


if __name__ == "__main__":
    shutil.rmtree(FIXTURE, ignore_errors=True)
    fastpersist.save(fixed_state(), FIXTURE)
    print(f"wrote {FIXTURE}: {sorted(p.name for p in FIXTURE.iterdir())}", file=sys.stderr)
