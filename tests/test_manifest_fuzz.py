"""Mutated manifests load as exactly what they describe, or are refused.

Hypothesis takes valid checkpoints (a single-process one with every kind of
value, a schema-2 one made of chunks, and that one in schema 3 with its
chunks implied by the records' names), mutates their manifests (keys and
list items dropped, duplicated, reordered and swapped; values replaced by 0,
-1, off-by-one, huge numbers, other types, other names from the manifest;
nesting bombs) and loads them. fastpersist.load must either raise a
CheckpointError subclass or return the object the mutated manifest describes,
bit for bit: that is the original object unless the mutation made another
valid manifest (a swapped dict value, a tree pointing at another tensor). What
a manifest describes comes from tests/manifest_reference.py, an independent
loader that trusts nothing: it serves only records identical to ones that were
written (taking their bytes straight from the data files), places chunks with
a coverage count, and refuses anything else. A manifest it refuses must be
refused by load; one it accepts may still be refused by load's stricter checks.
read_manifest, `fpctl inspect`'s describe and verify get the same inputs.

HYPOTHESIS_PROFILE=thorough runs 2,000 examples.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import tempfile
from pathlib import Path
from typing import Any

import pytest
from hostile_support import MANIFEST, aliasing, distributed_state, edit, same, single_state
from hypothesis import event, given, note
from hypothesis import strategies as st
from manifest_reference import Base, Invalid, TooBig, base_of, reference

import fastpersist
from fastpersist import CheckpointError
from fastpersist.cli.inspecting import describe
from fastpersist.engine import get_engine
from fastpersist.tensors import checkpoint, verifying

BOMB = "__nesting_bomb__"


@pytest.fixture(scope="module")
def bases(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Base]:
    root = tmp_path_factory.mktemp("fuzz-bases")
    single = root / "single"
    fastpersist.save(single_state(), single)
    implied = root / "implied"
    implied_state = distributed_state(implied)
    edit(implied, _imply)
    return {"single": base_of(single, single_state()),
            "distributed": base_of(root / "dist", distributed_state(root / "dist")),
            "implied": base_of(implied, implied_state)}


def _imply(doc: dict[str, Any]) -> None:
    """Schema 3, every global's chunks implied by its records' names."""
    doc["schema_version"] = 3
    for g in doc["globals"]:
        del g["chunks"]


# --- mutations -----------------------------------------------------------------------------


def _slots(doc: Any, region: str) -> list[tuple[Any, Any]]:
    """(container, key) of every value in `doc` (in the region)."""
    roots = {"all": [doc], "records": [doc.get(k) for k in ("files", "tensors", "globals")],
             "tree": [doc.get("tree")]}[region]
    out, stack = [], [r for r in roots if isinstance(r, dict | list)]
    while stack:
        c = stack.pop()
        for k, v in (c.items() if isinstance(c, dict) else enumerate(c)):
            out.append((c, k))
            if isinstance(v, dict | list):
                stack.append(v)
    return out


def _values(doc: Any) -> list[Any]:
    return [c[k] for c, k in _slots(doc, "all")]


def _replacements(v: Any, doc: Any) -> st.SearchStrategy[Any]:
    nearby: list[Any] = [None, True, False, 0, -1, 1, 2**31, 2**63, 2**64, 10**30, 0.5,
                         float("nan"), float("inf"), "", "x", [], {}, BOMB,
                         [0, 2**62, 2**62], {"t": "list", "v": []}]
    if isinstance(v, int) and not isinstance(v, bool):
        nearby += [v + 1, v - 1, v * 2, -v, v + 4096]
    if isinstance(v, str):
        nearby += [v + "x", v.upper(), "cuda:0", "meta", "bogus"]
    if isinstance(v, list):
        nearby += [v[::-1], v + v, v[1:], [v], [*v, 1], [*v, 0]]
    if isinstance(v, dict):
        nearby += [{"t": "list", "v": [v]}, {k: x for k, x in v.items() if k != "t"}]
    nested: Any = 0
    for _ in range(150):
        nested = {"t": "list", "v": [nested]}
    nearby.append(nested)
    return st.sampled_from(nearby) | st.sampled_from(_values(doc)).map(copy.deepcopy)


@st.composite
def mutated(draw: st.DrawFn, doc: dict[str, Any]) -> dict[str, Any]:
    doc = copy.deepcopy(doc)
    # Rearranging only (no new values) more often makes another valid manifest,
    # which exercises the comparison with the reference rather than a refusal.
    ops = ["drop", "duplicate", "swap", "reorder", "swap-same-key"]
    if not draw(st.booleans(), label="rearrange only"):
        ops += ["replace"] * 5
    for _ in range(draw(st.integers(1, 3))):
        slots = _slots(doc, draw(st.sampled_from(["all", "records", "tree"])))
        if not slots:
            continue
        c, k = draw(st.sampled_from(slots))
        op = draw(st.sampled_from(ops))
        keys = list(c) if isinstance(c, dict) else list(range(len(c)))
        others = [j for j in keys if j != k]
        note(f"{op} at {k!r} of {json.dumps(c, default=str)[:200]}")
        if op == "drop":
            del c[k]
        elif op == "duplicate" and isinstance(c, list):
            c.insert(k, copy.deepcopy(c[k]))
        elif op == "duplicate" and others:  # a dict: one field's value in another
            c[draw(st.sampled_from(others))] = copy.deepcopy(c[k])
        elif op == "swap" and others:
            other = draw(st.sampled_from(others))
            c[k], c[other] = c[other], c[k]
        elif op == "reorder" and isinstance(c[k], list):
            c[k].reverse()
        elif op == "swap-same-key" and isinstance(c, dict):
            # Names, offsets, shapes... of two records exchanged.
            peers = [(c2, k2) for c2, k2 in _slots(doc, "all") if k2 == k and c2 is not c]
            if peers:
                c2, k2 = draw(st.sampled_from(peers))
                c[k], c2[k2] = c2[k2], c[k]
        else:
            c[k] = draw(_replacements(c[k], doc))
    return doc


def _write(path: Path, base: Base, doc: Any) -> None:
    path.mkdir()
    for f in base.path.iterdir():
        if f.name != MANIFEST:
            os.link(f, path / f.name)  # the data files are never written to
    text = json.dumps(doc)
    text = text.replace(json.dumps(BOMB), "[" * 100_000 + "]" * 100_000)
    (path / MANIFEST).write_text(text)


@given(data=st.data())
def test_mutated_manifests_load_as_described_or_are_refused(bases: dict[str, Base],
                                                            data: st.DataObject) -> None:
    base = bases[data.draw(st.sampled_from(sorted(bases)), label="base")]
    doc = data.draw(mutated(base.doc), label="manifest")
    verify = data.draw(st.booleans(), label="verify")
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = Path(tmp) / "ckpt"
        _write(ckpt, base, doc)
        try:
            expected: Any = reference(doc, base, verify)
        except Invalid:
            expected = Invalid
        except TooBig:
            expected = TooBig
        try:
            loaded = fastpersist.load(ckpt, verify=verify)
        except CheckpointError as exc:
            event(f"refused: {type(exc).__name__}")
            note(f"load refused: {exc}")
            loaded = exc
        _other_readers(ckpt)
    if isinstance(loaded, CheckpointError):
        return
    event("loaded the original" if doc == base.doc or same(loaded, base.original)
          else "loaded what another valid manifest describes")
    assert expected is not Invalid, "load returned what the reference refuses"
    if expected is TooBig:
        return
    assert same(loaded, expected), "load returned something other than the manifest says"
    assert [a for a, _ in aliasing(loaded)] == [a for a, _ in aliasing(expected)]
    if doc == base.doc:
        assert same(loaded, base.original)


def _other_readers(ckpt: Path) -> None:
    """fpctl's readers: a CheckpointError or an answer, nothing else."""
    try:
        manifest = checkpoint.read_manifest(ckpt)
    except CheckpointError:
        return
    describe(ckpt, manifest)
    with contextlib.suppress(CheckpointError):
        verifying.verify(ckpt, get_engine())


def test_unmutated_bases_load(bases: dict[str, Base]) -> None:
    for base in bases.values():
        assert same(fastpersist.load(base.path), base.original)
        assert same(reference(base.doc, base, True), base.original)
