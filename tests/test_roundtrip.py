"""save -> load round trips of every dtype and structure, on both engines."""

from __future__ import annotations

import json
import math
from collections import OrderedDict
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from safetensors import safe_open
from safetensors.torch import load_file

import fastpersist
from fastpersist import _format
from fastpersist.format import dtypes

ALL_DTYPES = sorted(dtypes.SUPPORTED_NAMES)


def assert_same(a: Any, b: Any, path: str = "<root>") -> None:
    """Equal values and equal types, bit-exact tensors (NaNs included)."""
    assert type(a) is type(b), f"{path}: {type(a)} != {type(b)}"
    if isinstance(a, torch.Tensor):
        assert (a.dtype, a.shape, a.device) == (b.dtype, b.shape, b.device), path
        assert a.requires_grad == b.requires_grad, path
        if a.numel():
            a_bytes = a.detach().contiguous().reshape(-1).view(torch.uint8)
            b_bytes = b.detach().contiguous().reshape(-1).view(torch.uint8)
            assert torch.equal(a_bytes, b_bytes), f"{path}: tensor bytes differ"
    elif isinstance(a, dict):
        assert list(a.keys()) == list(b.keys()), path
        for k in a:
            assert_same(a[k], b[k], f"{path}.{k}")
        assert getattr(a, "_metadata", None) == getattr(b, "_metadata", None), path
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{path}[{i}]")
    elif isinstance(a, float) and math.isnan(a):
        assert math.isnan(b), path
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"


def random_tensor(name: str, shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    dtype = dtypes.from_name(name)
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (math.prod(shape) * dtype.itemsize,), dtype=torch.uint8,
                        generator=g)
    if dtype == torch.bool:
        return (raw % 2).bool().reshape(shape)
    return raw.view(dtype).reshape(shape)


@pytest.mark.parametrize("dtype_name", ALL_DTYPES)
def test_every_dtype_round_trips(tmp_path: Path, engine_name: str, dtype_name: str) -> None:
    state = {
        "big": random_tensor(dtype_name, (33, 17)),
        "scalar": random_tensor(dtype_name, ()),
        "empty": random_tensor(dtype_name, (0, 4)),
    }
    fastpersist.save(state, tmp_path / "ckpt")
    assert_same(state, fastpersist.load(tmp_path / "ckpt"))
    # The data file is a plain safetensors file.
    loaded = load_file(str(tmp_path / "ckpt" / "data-00000.safetensors"))
    for key, t in state.items():
        assert_same(t, loaded[key])


def tiny_training_state() -> dict[str, Any]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Embedding(50, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 50)
    )
    model[2].weight = model[0].weight  # tied embedding, as in GPT-2
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95))
    for _ in range(2):
        model(torch.randint(0, 50, (4, 8))).sum().backward()
        opt.step()
    return {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": 2,
            "config": {"lr": 1e-3, "name": "tiny", "betas": (0.9, 0.95), "dropout": None}}


def test_model_and_optimizer_state_round_trip(tmp_path: Path, engine_name: str) -> None:
    state = tiny_training_state()
    fastpersist.save(state, tmp_path / "ckpt")
    out = fastpersist.load(tmp_path / "ckpt")
    assert_same(state, out)
    assert isinstance(out["model"], OrderedDict)
    assert out["model"]["0.weight"] is out["model"]["2.weight"]  # still tied
    # And it loads into fresh modules.
    model = torch.nn.Sequential(
        torch.nn.Embedding(50, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 50)
    )
    model[2].weight = model[0].weight
    model.load_state_dict(out["model"])
    opt = torch.optim.AdamW(model.parameters())
    opt.load_state_dict(out["optimizer"])
    assert opt.state_dict()["param_groups"][0]["betas"] == (0.9, 0.95)


def test_plain_values_round_trip(tmp_path: Path, engine_name: str) -> None:
    state = {
        1: "int key", (2, "tuple key"): [None, True, False], "floats": [0.1, -0.0, 1e308,
        float("inf"), float("-inf"), float("nan")], "big int": 2**80, "bytes": b"\x00\xff",
        "dtype": torch.bfloat16, "device": torch.device("cuda", 1), "size": torch.Size([2, 3]),
        "nested": OrderedDict(a=[{"b": ()}]), "unicode": "héllo ✓",
    }
    fastpersist.save(state, tmp_path / "ckpt")
    assert_same(state, fastpersist.load(tmp_path / "ckpt"))


def test_views_share_storage_after_load(tmp_path: Path, engine_name: str) -> None:
    base = torch.arange(100, dtype=torch.float32).reshape(10, 10)
    state = {"base": base, "row": base[3], "cols": base[:, 2:5], "t": base.t(),
             "bytes": base.view(torch.uint8)[4:12], "same": base}
    fastpersist.save(state, tmp_path / "ckpt")
    out = fastpersist.load(tmp_path / "ckpt")
    assert_same(state, out)
    assert out["same"] is out["base"]
    ptr = out["base"].untyped_storage().data_ptr()
    for key in ("row", "cols", "t", "bytes"):
        assert out[key].untyped_storage().data_ptr() == ptr, key
    out["base"][3, 0] = -1.0  # a write through one view shows in the others
    assert out["row"][0] == -1.0


def test_tensors_of_one_buffer_with_storages_of_their_own(tmp_path: Path) -> None:
    # torch.frombuffer of a buffer and of a prefix of it: two storages at one
    # address, the smaller first (this failed with "Trying to resize storage").
    buf = bytearray(range(40))
    whole = torch.frombuffer(buf, dtype=torch.uint8)
    head = torch.frombuffer(memoryview(buf)[:8], dtype=torch.uint8)
    assert head.untyped_storage().data_ptr() == whole.untyped_storage().data_ptr()
    state = {"head": head, "whole": whole, "tail": whole[30:]}
    fastpersist.save(state, tmp_path / "ckpt")
    assert_same(state, fastpersist.load(tmp_path / "ckpt"))


def test_noncontiguous_and_partial_views_store_only_their_bytes(tmp_path: Path) -> None:
    big = torch.randn(1000, 1000)
    state = {"transposed": torch.randn(64, 32).t(), "slice": big[:2, :3]}
    fastpersist.save(state, tmp_path / "ckpt")
    out = fastpersist.load(tmp_path / "ckpt")
    assert_same(state, out)
    manifest = fastpersist.tensors.checkpoint.read_manifest(tmp_path / "ckpt")
    assert manifest.tensor_bytes == (64 * 32 + 6) * 4  # not the 4 MB storage of `big`


def test_parameters_and_requires_grad(tmp_path: Path, engine_name: str) -> None:
    p = torch.nn.Parameter(torch.randn(3, 3))
    frozen = torch.nn.Parameter(torch.randn(2), requires_grad=False)
    state = {"p": p, "frozen": frozen, "leaf": torch.randn(2, requires_grad=True)}
    fastpersist.save(state, tmp_path / "ckpt")
    out = fastpersist.load(tmp_path / "ckpt")
    assert isinstance(out["p"], torch.nn.Parameter) and out["p"].requires_grad
    assert isinstance(out["frozen"], torch.nn.Parameter) and not out["frozen"].requires_grad
    assert out["leaf"].requires_grad and not isinstance(out["leaf"], torch.nn.Parameter)
    assert torch.equal(out["p"], p)


def test_map_location(tmp_path: Path) -> None:
    fastpersist.save({"w": torch.ones(2)}, tmp_path / "ckpt")
    assert fastpersist.load(tmp_path / "ckpt", map_location="cpu")["w"].device.type == "cpu"
    out = fastpersist.load(tmp_path / "ckpt", map_location={"cpu": "meta"})
    assert out["w"].device.type == "meta"
    # torch's callable (storage, location) -> storage works (tests/test_files.py);
    # anything else is refused before a byte is read.
    assert fastpersist.load(tmp_path / "ckpt", map_location=lambda s, loc: s)["w"].sum() == 2
    with pytest.raises(TypeError, match="map_location"):
        fastpersist.load(tmp_path / "ckpt", map_location=3)


def test_saving_over_a_checkpoint_replaces_it(tmp_path: Path, engine_name: str) -> None:
    fastpersist.save({"v": torch.zeros(10)}, tmp_path / "ckpt")
    fastpersist.save({"v": torch.ones(3), "new": 1}, tmp_path / "ckpt")
    out = fastpersist.load(tmp_path / "ckpt")
    assert out["new"] == 1 and torch.equal(out["v"], torch.ones(3))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # no leftovers


def test_missing_parents_are_created(tmp_path: Path) -> None:
    fastpersist.save({"a": 1}, tmp_path / "x" / "y" / "ckpt")
    assert fastpersist.load(tmp_path / "x" / "y" / "ckpt") == {"a": 1}


def test_data_file_layout_is_safetensors_with_aligned_data(tmp_path: Path) -> None:
    state = {"w": torch.randn(5, 7), "b": torch.randn(3).to(torch.bfloat16), "i": torch.arange(3)}
    fastpersist.save(state, tmp_path / "ckpt")
    path = tmp_path / "ckpt" / "data-00000.safetensors"
    raw = path.read_bytes()
    header_len = int.from_bytes(raw[:8], "little")
    assert (8 + header_len) % 4096 == 0
    assert json.loads(raw[8 : 8 + header_len])["__metadata__"]["format"] == "pt"
    with safe_open(str(path), framework="pt") as f:
        assert sorted(f.keys()) == ["b", "i", "w"]
        for key in f.keys():  # noqa: SIM118 - safe_open is not a mapping
            assert_same(state[key], f.get_tensor(key))
    manifest = json.loads((tmp_path / "ckpt" / "manifest.json").read_bytes())
    assert manifest["schema_version"] == 1
    assert all(t["encoding"] == "raw" and isinstance(t["crc32c"], int)
               for t in manifest["tensors"])


@given(st.lists(st.tuples(
    st.sampled_from(["F32", "BF16", "I64", "BOOL"]),
    # a few shapes, so that entries repeat them (header_json caches each one's text)
    st.sampled_from([(), (0,), (3,), (2, 5), (7, 1, 4)]),
    st.sampled_from([tuple, list]),
    # names the C writer takes (plain ASCII) and ones it leaves to Python (escapes)
    st.sampled_from(["", ".é", '."q', ".b\\s", ".\t", ".\x7f", ".\x00", ". ~"])), max_size=12))
def test_header_json_is_json_dumps_of_the_header(entries: list[Any]) -> None:
    from fastpersist.format import safetensors_file

    made = [(f"t{i}{suffix}", dtype, as_seq(shape), 4 * math.prod(shape))
            for i, (dtype, shape, as_seq, suffix) in enumerate(entries)]
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    cursor = 0
    for name, dtype, shape, nbytes in made:
        header[name] = {"dtype": dtype, "shape": list(shape),
                        "data_offsets": [cursor, cursor + nbytes]}
        cursor += nbytes
    expected = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    assert safetensors_file.header_json(made, {"format": "pt"}) == expected
    assert safetensors_file.header_json(iter(made), {"format": "pt"}) == expected
    plain = all(n.isascii() and n.isprintable() and '"' not in n and "\\" not in n
                for n, *_ in made)
    from_c = _format.header_json(made, b'{"__metadata__":{"format":"pt"}')
    assert from_c == (expected if plain else None)


def test_header_json_leaves_numbers_past_64_bits_to_python() -> None:
    from fastpersist.format import safetensors_file

    for entry in [("a", "F32", (2**63,), 4), ("a", "F32", (1,), 2**63), ("a", "F32", (-1,), 4)]:
        expected = json.dumps({"__metadata__": {}, "a": {
            "dtype": "F32", "shape": list(entry[2]), "data_offsets": [0, entry[3]]}},
            separators=(",", ":"), ensure_ascii=False).encode()
        assert safetensors_file.header_json([entry], {}) == expected
    assert _format.header_json([("a", "F32", (2**63,), 4)], b"{") is None
    assert _format.header_json([("a", "F32", (True,), 4)], b"{") is None
    assert _format.header_json([("a", "F32", (-1,), 4)], b"{") == (
        b'{,"a":{"dtype":"F32","shape":[-1],"data_offsets":[0,4]}}')


# Random nested states: the two engines must write byte-identical checkpoints.
tensors = st.builds(
    random_tensor,
    st.sampled_from(ALL_DTYPES),
    st.lists(st.integers(0, 40), max_size=3).map(tuple),
    st.integers(0, 1000),
)
leaves = st.one_of(tensors, st.integers(-(2**70), 2**70), st.floats(), st.text(max_size=5),
                   st.none(), st.booleans())
nested = st.recursive(
    leaves,
    lambda inner: st.one_of(
        st.dictionaries(st.one_of(st.text(max_size=4), st.integers(0, 9)), inner, max_size=4),
        st.lists(inner, max_size=4),
        st.lists(inner, max_size=3).map(tuple),
    ),
    max_leaves=12,
)


@given(nested)
def test_random_states_identical_on_both_engines(tmp_path_factory, state: Any) -> None:
    d = tmp_path_factory.mktemp("states")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("FASTPERSIST_ENGINE", "native")
        mp.setenv("FASTPERSIST_BLOCK_SIZE", "4096")  # many blocks even for small states
        fastpersist.save({"s": state}, d / "native")
        mp.setenv("FASTPERSIST_ENGINE", "python")
        fastpersist.save({"s": state}, d / "python")
        out = fastpersist.load(d / "python")
    assert_same({"s": state}, out)
    a = (d / "native" / "data-00000.safetensors").read_bytes()
    b = (d / "python" / "data-00000.safetensors").read_bytes()
    assert a == b
    ma = json.loads((d / "native" / "manifest.json").read_bytes())
    mb = json.loads((d / "python" / "manifest.json").read_bytes())
    ma.pop("created_unix"), mb.pop("created_unix")
    assert ma == mb


def test_load_reports_progress_in_batches(tmp_path: Path, engine_name: str,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    state = {f"t{i}": torch.randn(500 + i) for i in range(20)}
    fastpersist.save(state, tmp_path / "ckpt")
    monkeypatch.setattr(fastpersist.tensors.checkpoint, "BATCH_BYTES", 8 * 1024)  # many batches
    seen: list[int] = []
    out = fastpersist.load(tmp_path / "ckpt", progress=seen.append)
    assert_same(state, out)
    assert len(seen) > 3
    assert sum(seen) == fastpersist.tensors.checkpoint.read_manifest(tmp_path / "ckpt").tensor_bytes


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA error path")
def test_cuda_checkpoint_on_a_machine_without_cuda(tmp_path: Path) -> None:
    """A tensor saved from cuda:0 loads with map_location, and without it fails
    with an error that says what to do (as torch.load does)."""
    fastpersist.save({"w": torch.ones(3)}, tmp_path / "ckpt")
    path = tmp_path / "ckpt" / "manifest.json"
    manifest = json.loads(path.read_bytes())
    manifest["tree"]["v"][0]["device"] = "cuda:0"  # as if saved from a GPU
    path.write_text(json.dumps(manifest))
    with pytest.raises(fastpersist.CheckpointError, match="map_location='cpu'"):
        fastpersist.load(tmp_path / "ckpt")
    assert fastpersist.load(tmp_path / "ckpt", map_location="cpu")["w"].device.type == "cpu"
    out = fastpersist.load(tmp_path / "ckpt", map_location={"cuda:0": "cpu"})
    assert torch.equal(out["w"], torch.ones(3))


def test_tensors_whose_paths_collide_get_names_of_their_own(tmp_path: Path) -> None:
    # "a.b" the key and a -> b the nesting name the same path: the second stored
    # tensor is named apart in the data file (and a third after it).
    state = {"a.b": torch.ones(2), "a": {"b": torch.zeros(3)}, "x": [torch.arange(4)],
             "x.0": torch.full((5,), 7.0), "x.0~1": torch.full((6,), 9.0)}
    fastpersist.save(state, tmp_path / "ckpt")
    names = [t["name"] for t in json.loads((tmp_path / "ckpt" / "manifest.json").read_bytes())
             ["tensors"]]
    assert len(set(names)) == len(names) == 5
    assert {"a.b", "a.b~1", "x.0", "x.0~1"} <= set(names)
    loaded = fastpersist.load(tmp_path / "ckpt")
    assert torch.equal(loaded["a"]["b"], state["a"]["b"])
    assert torch.equal(loaded["x"][0], state["x"][0])
    for key in ("a.b", "x.0", "x.0~1"):
        assert torch.equal(loaded[key], state[key])
