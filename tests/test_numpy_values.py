"""numpy arrays and scalars are stored as tensors, without pickle (issue 12, part 1).

A Hugging Face Trainer-style RNG state ({"python": random.getstate(), "numpy":
np.random.get_state(), "cpu": torch.random.get_rng_state()}) saves without
allow_pickle, and restoring it gives the same subsequent draws. numpy values
come back as numpy, of the same dtype and shape, bit for bit, C-contiguous and
writeable, from every way of saving. Malformed numpy marks in a manifest are in
test_hostile_checkpoints.py.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import fastpersist
from fastpersist import UnsupportedValueError
from fastpersist.cli import main as fpctl
from fastpersist.tensors import state

# Every numpy dtype stored as a tensor (complex128 as float64 pairs).
DTYPES = ["bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
          "float16", "float32", "float64", "complex64", "complex128"]
LAYOUTS = ["c", "fortran", "reversed", "strided", "transposed", "read-only"]


def same_array(out: Any, expected: np.ndarray) -> None:
    """A numpy array of the same dtype and shape, bit for bit (NaN payloads
    included), C-contiguous and writeable."""
    assert type(out) is np.ndarray, type(out)
    assert out.dtype == expected.dtype and out.shape == expected.shape
    assert out.tobytes() == expected.tobytes()
    assert out.flags.c_contiguous and out.flags.writeable


def same_scalar(out: Any, expected: np.generic) -> None:
    assert type(out) is type(expected) and out.dtype == expected.dtype
    assert out.tobytes() == expected.tobytes()


def roundtrip(obj: Any, path: Path, **save: Any) -> Any:
    fastpersist.save(obj, path, **save)
    return fastpersist.load(path)


def _layout(arr: np.ndarray, layout: str) -> np.ndarray:
    if layout == "fortran":
        return np.asfortranarray(arr)
    if layout == "reversed" and arr.ndim:
        return arr[::-1]
    if layout == "strided" and arr.ndim:
        return np.repeat(arr, 2, axis=0)[::2]  # every other row of a bigger array
    if layout == "transposed":
        return arr.T
    if layout == "read-only":
        arr = arr.copy()
        arr.flags.writeable = False
    return arr


@st.composite
def arrays(draw: st.DrawFn) -> np.ndarray:
    """Arrays of every stored dtype and random bytes (so floats hold NaNs with
    any payload), of 0 to 4 dimensions, in several memory layouts."""
    dtype = np.dtype(draw(st.sampled_from(DTYPES)))
    shape = draw(hnp.array_shapes(min_dims=0, max_dims=4, min_side=0, max_side=4))
    n = int(np.prod(shape)) * dtype.itemsize
    if dtype == np.bool_:
        arr = draw(hnp.arrays(np.bool_, shape))
    else:
        arr = np.frombuffer(draw(st.binary(min_size=n, max_size=n)), dtype=dtype).reshape(shape)
    return _layout(arr.copy(), draw(st.sampled_from(LAYOUTS)))


@given(arrays())
def test_arrays_round_trip_bit_for_bit(arr: np.ndarray) -> None:
    with tempfile.TemporaryDirectory() as d:
        out = roundtrip({"a": arr, "nested": [(arr,)]}, Path(d) / "ck")
    same_array(out["a"], arr)
    same_array(out["nested"][0][0], arr)
    if arr.size:  # one array object, stored once (empty ones, as empty tensors, are not tied)
        assert out["nested"][0][0] is out["a"]


@given(st.sampled_from(DTYPES), st.data())
def test_scalars_round_trip_bit_for_bit(dtype_name: str, data: st.DataObject) -> None:
    dtype = np.dtype(dtype_name)
    if dtype == np.bool_:
        value: np.generic = np.bool_(data.draw(st.booleans()))
    else:
        raw = data.draw(st.binary(min_size=dtype.itemsize, max_size=dtype.itemsize))
        value = np.frombuffer(raw, dtype=dtype)[0]
    with tempfile.TemporaryDirectory() as d:
        out = roundtrip({"s": value}, Path(d) / "ck")
    same_scalar(out["s"], value)


def test_zero_d_empty_and_odd_layouts(tmp_path: Path) -> None:
    base = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
    values = {
        "zero_d": np.array(7.5), "zero_d_c128": np.array(1 + 2j),
        "empty": np.zeros((0, 3), np.int64), "empty_c128": np.zeros((2, 0), np.complex128),
        "fortran": np.asfortranarray(base), "negative": base[::-1, :, ::-2],
        "transposed": base.transpose(2, 0, 1), "sliced": base[:, 1],
        "broadcast": np.broadcast_to(np.arange(3), (4, 3)),  # zero strides, read-only
        "big_endian": np.arange(5, dtype=">i4"),
    }
    out = roundtrip(values, tmp_path / "ck")
    for k, v in values.items():
        if k == "big_endian":  # stored, and loaded, in native byte order
            assert out[k].dtype == np.dtype("<i4") and np.array_equal(out[k], v)
            continue
        same_array(out[k], v)
    assert not np.shares_memory(out["fortran"], out["negative"])


def test_scalars_of_each_kind(tmp_path: Path) -> None:
    values = {"f32": np.float32(1.5), "i64": np.int64(3), "b": np.bool_(True),
              "f64": np.float64(-0.0), "c64": np.complex64(1 - 2j), "c128": np.complex128(3j),
              "u64": np.uint64(2**64 - 1), "nan": np.float16("nan")}
    out = roundtrip(values, tmp_path / "ck")
    for k, v in values.items():
        same_scalar(out[k], v)


def test_torch_tensors_and_plain_values_beside_numpy_are_unchanged(tmp_path: Path) -> None:
    w = torch.randn(3, 4)
    arr = np.arange(4.0)
    obj = {"w": w, "tied": w, "t": torch.from_numpy(arr), "a": arr, "x": 1.5, "n": None}
    out = roundtrip(obj, tmp_path / "ck")
    assert type(out["w"]) is torch.Tensor and out["tied"] is out["w"]
    assert torch.equal(out["w"], w) and torch.equal(out["t"], torch.from_numpy(arr))
    same_array(out["a"], arr)
    assert out["x"] == 1.5 and out["n"] is None


def rng_state() -> dict[str, Any]:
    """What transformers' Trainer saves as rng_state.pth."""
    return {"python": random.getstate(), "numpy": np.random.get_state(),
            "cpu": torch.random.get_rng_state()}


def draws() -> tuple[Any, ...]:
    return (random.random(), random.getrandbits(100), np.random.rand(3).tobytes(),
            np.random.randn(), torch.rand(3))


def test_hf_rng_state_round_trips_and_restores_the_same_draws(tmp_path: Path) -> None:
    random.seed(12)
    np.random.seed(12)
    np.random.randn()  # a cached Gaussian: get_state()'s last two fields are set
    torch.manual_seed(12)
    saved = rng_state()
    ckpt = tmp_path / "ck"
    fastpersist.save({"rng_state": saved}, ckpt)  # no allow_pickle
    expected = draws()
    loaded = fastpersist.load(ckpt)["rng_state"]
    # Exactly the types the getters return: tuples, not lists; ints; a uint32 array.
    py = loaded["python"]
    assert type(py) is tuple and type(py[1]) is tuple and py == saved["python"]
    name, keys, pos, has_gauss, cached = loaded["numpy"]
    assert (name, pos, has_gauss, cached) == (saved["numpy"][0], *saved["numpy"][2:])
    assert type(loaded["numpy"]) is tuple and type(pos) is int and has_gauss == 1
    same_array(keys, saved["numpy"][1])
    assert keys.dtype == np.uint32
    assert torch.equal(loaded["cpu"], saved["cpu"])
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)
    random.setstate(loaded["python"])
    np.random.set_state(loaded["numpy"])
    torch.random.set_rng_state(loaded["cpu"])
    again = draws()
    assert again[:4] == expected[:4] and torch.equal(again[4], expected[4])


def test_generator_states_with_large_ints_restore(tmp_path: Path) -> None:
    """np.random.Generator's state is a dict of 128-bit ints; RandomState's
    legacy tuple holds a uint32 array."""
    gen = np.random.default_rng(5)
    legacy = np.random.RandomState(6)
    saved = {"pcg64": gen.bit_generator.state, "legacy": legacy.get_state(),
             "big": 2**200 + 1, "neg": -(2**100)}
    out = roundtrip(saved, tmp_path / "ck")
    assert out["big"] == 2**200 + 1 and out["neg"] == -(2**100)
    expected = (gen.random(4).tobytes(), legacy.random_sample(4).tobytes())
    gen2, legacy2 = np.random.default_rng(0), np.random.RandomState(0)
    gen2.bit_generator.state = out["pcg64"]
    legacy2.set_state(out["legacy"])
    assert (gen2.random(4).tobytes(), legacy2.random_sample(4).tobytes()) == expected


def test_ints_json_cannot_hold_need_pickle(tmp_path: Path) -> None:
    with pytest.raises(UnsupportedValueError, match=r"^x\.0: an integer of 20001 bits"):
        fastpersist.save({"x": [2**20000]}, tmp_path / "no")
    assert not (tmp_path / "no").exists()
    fastpersist.save({"x": 2**20000}, tmp_path / "ck", allow_pickle=True)
    assert fastpersist.load(tmp_path / "ck", allow_pickle=True)["x"] == 2**20000


@pytest.mark.parametrize(("value", "dtype"), [
    (np.array(["a", "bc"]), "<U2"),
    (np.array([b"x"]), "|S1"),
    (np.array([object()]), "object"),
    (np.zeros(2, dtype="datetime64[s]"), r"datetime64\[s\]"),
    (np.zeros(2, dtype=[("a", "<i4"), ("b", "<f8")]), r"\[\('a', '<i4'\), \('b', '<f8'\)\]"),
    (np.zeros(2, dtype=np.longdouble), "float128"),
    (np.datetime64("2026-01-01"), "datetime64"),
    (np.bytes_(b"ab"), "|S2"),
])
def test_unsupported_dtypes_name_the_key_path_and_dtype(tmp_path: Path, value: Any,
                                                         dtype: str) -> None:
    kind = "array" if isinstance(value, np.ndarray) else "scalar"
    with pytest.raises(UnsupportedValueError,
                       match=rf"^opt\.state\.0: a numpy {kind} of dtype {dtype}.* without pickle"):
        fastpersist.save({"opt": {"state": [value]}}, tmp_path / "no")
    assert not (tmp_path / "no").exists()
    # As any other object: pickled with allow_pickle=True.
    fastpersist.save({"v": value}, tmp_path / "ck", allow_pickle=True)
    out = fastpersist.load(tmp_path / "ck", allow_pickle=True)["v"]
    assert type(out) is type(value) and out.dtype == value.dtype


def test_subclasses_and_numpy_dict_keys_need_pickle(tmp_path: Path) -> None:
    with pytest.raises(UnsupportedValueError, match=r"^m: a value of type MaskedArray"):
        fastpersist.save({"m": np.ma.array([1, 2], mask=[0, 1])}, tmp_path / "no")
    with pytest.raises(UnsupportedValueError, match=r"^d: a numpy dict key \(int64\)"):
        fastpersist.save({"d": {np.int64(3): 1}}, tmp_path / "no")
    fastpersist.save({"d": {np.int64(3): np.int64(4)}}, tmp_path / "ck", allow_pickle=True)
    out = fastpersist.load(tmp_path / "ck", allow_pickle=True)["d"]
    ((k, v),) = out.items()
    same_scalar(k, np.int64(3))
    same_scalar(v, np.int64(4))


def test_numpy_values_load_on_the_cpu_whatever_map_location_says(tmp_path: Path) -> None:
    fastpersist.save({"w": torch.ones(2), "a": np.ones(2)}, tmp_path / "ck")
    out = fastpersist.load(tmp_path / "ck", map_location="meta")
    assert out["w"].device.type == "meta"
    same_array(out["a"], np.ones(2))


def test_tree_marks_numpy_leaves_and_nothing_else(tmp_path: Path) -> None:
    tree, leaves = state.encode({"a": np.zeros(3, np.float32), "s": np.int8(1),
                                 "c": np.zeros(2, np.complex128), "t": torch.zeros(3)})
    assert tree["v"] == [{"t": "tensor", "np": "array"}, {"t": "tensor", "np": "scalar"},
                         {"t": "tensor", "np": "array", "np_dtype": "complex128"},
                         {"t": "tensor"}]
    assert [tuple(leaf.tensor.shape) for leaf in leaves] == [(3,), (), (2, 2), (3,)]


def test_checkpoints_without_numpy_are_unchanged(tmp_path: Path) -> None:
    """No numpy value, no numpy mark: the layout fixture's tree has none, and a
    save and load of plain state works with numpy not importable at all."""
    fixture = json.loads((Path(__file__).parent / "fixtures" / "layout-v1" /
                          "manifest.json").read_text())
    assert '"np' not in json.dumps(fixture["tree"])
    loaded = fastpersist.load(Path(__file__).parent / "fixtures" / "layout-v1")
    assert not any(type(v).__module__.startswith("numpy") for v in _leaves(loaded))
    fastpersist.save({"a": np.ones(2)}, tmp_path / "with-numpy")
    script = f"""
import sys, warnings
sys.modules["numpy"] = None  # import numpy raises ImportError
warnings.simplefilter("ignore")
import torch, fastpersist
obj = {{"w": torch.arange(4.0), "cfg": {{"lr": 0.5, "betas": (0.9, 0.99)}}, "n": 2**70}}
fastpersist.save(obj, {str(tmp_path / "plain")!r})
out = fastpersist.load({str(tmp_path / "plain")!r})
assert torch.equal(out["w"], obj["w"]) and out["cfg"] == obj["cfg"] and out["n"] == 2**70
try:
    fastpersist.load({str(tmp_path / "with-numpy")!r})
except fastpersist.CheckpointError as exc:
    assert "a is a numpy value; install numpy to load this checkpoint" in str(exc), exc
else:
    raise AssertionError("loaded numpy values without numpy")
# The GPU load's ring, run on the CPU as its tests do, needs no numpy either.
from fastpersist.engine import get_engine
from fastpersist.tensors import checkpoint, device_load
saved = __import__("pathlib").Path({str(tmp_path / "plain")!r})
manifest = checkpoint.read_manifest(saved)
ringed = device_load.read_to_device(saved, manifest, get_engine(), torch.device("cpu"),
                                    verify=True, ring_bytes=64)
assert any(torch.equal(t, obj["w"]) for t in ringed), ringed
assert sys.modules["numpy"] is None
print("ok")
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr


def _leaves(obj: Any) -> list[Any]:
    if isinstance(obj, dict):
        return [x for v in obj.values() for x in _leaves(v)]
    if isinstance(obj, (list, tuple)):
        return [x for v in obj for x in _leaves(v)]
    return [obj]


def test_async_save_and_checkpointer(tmp_path: Path) -> None:
    arr = np.arange(10, dtype=np.float64)
    obj = {"a": arr, "s": np.float32(0.25), "rng": rng_state()}
    expected = {"a": arr.copy(), "s": np.float32(0.25)}
    future = fastpersist.async_save(obj, tmp_path / "async")
    arr += 100  # after the snapshot: must not reach the checkpoint
    future.result()
    out = fastpersist.load(tmp_path / "async")
    same_array(out["a"], expected["a"])
    same_scalar(out["s"], expected["s"])
    with fastpersist.Checkpointer(tmp_path / "run", keep_last=1) as ckpt:
        for step in range(2):
            ckpt.save(step, {"a": arr + step, "rng": rng_state()})
    out = ckpt.load_latest()
    same_array(out["a"], arr + 1)
    assert out["rng"]["python"] == random.getstate()


def test_through_the_daemon(tmp_path: Path, daemon: Any) -> None:
    obj = {"rng_state": rng_state(), "a": np.asfortranarray(np.ones((3, 2), np.int32)),
           "c": np.array([1 + 1j, 2j]), "s": np.uint16(7), "w": torch.ones(3)}
    fastpersist.save(obj, daemon.root / "ck", daemon=daemon.address)
    fastpersist.save(obj, tmp_path / "local")
    out = fastpersist.load(daemon.root / "ck")
    same_array(out["a"], np.ones((3, 2), np.int32))
    same_array(out["c"], obj["c"])
    same_scalar(out["s"], np.uint16(7))
    same_array(out["rng_state"]["numpy"][1], obj["rng_state"]["numpy"][1])
    assert out["rng_state"]["python"] == obj["rng_state"]["python"]
    # The daemon wrote what an in-process save writes.
    for name in ("data-00000.safetensors",):
        assert (daemon.root / "ck" / name).read_bytes() == (tmp_path / "local" / name).read_bytes()
    fastpersist.async_save({"a": np.arange(3)}, daemon.root / "ck2",
                           daemon=daemon.address).result()
    same_array(fastpersist.load(daemon.root / "ck2")["a"], np.arange(3))


def test_fpctl_inspect_shows_numpy_values(tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    ckpt = tmp_path / "ck"
    fastpersist.save({"rng_state": rng_state(), "loss": np.float32(0.5),
                      "c": np.ones((2, 3), np.complex128), "w": torch.ones(2)}, ckpt)
    assert fpctl(["inspect", str(ckpt)]) == 0
    out = capsys.readouterr().out
    assert "5 tensor references (3 of them numpy values)" in out
    assert "  loss: numpy scalar float32 [] (tensor loss)" in out
    assert "  c: numpy array complex128 [2, 3] (tensor c)" in out
    assert "  rng_state.numpy.1: numpy array uint32 [624] (tensor rng_state.numpy.1)" in out
    assert "  w: tensor w" in out
    assert fpctl(["inspect", "--json", str(ckpt)]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["tree"]["numpy_values"][0] == {
        "path": "rng_state.numpy.1", "kind": "array", "dtype": "uint32", "shape": [624],
        "tensor": "rng_state.numpy.1"}
    assert fpctl(["verify", str(ckpt)]) == 0


@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch without distributed")
def test_distributed_save(tmp_path: Path) -> None:
    """Stored once per job like small tensors (one rank's copy), and a per-rank
    numpy RNG state is among the values the ranks are warned differ."""
    from dist_support import ok, run_job

    ckpt = tmp_path / "ckpt"
    reports = run_job(tmp_path, "save", ["n0", "n1"], {"path": str(ckpt), "numpy_values": True})
    ok(reports)
    assert "np.rng.1" in reports[0]["log"] and "np.same" not in reports[0]["log"]
    out = fastpersist.load(ckpt)["np"]
    same_array(out["same"], np.arange(6, dtype=np.int16).reshape(2, 3))
    same_scalar(out["scalar"], np.float32(2.5))
    assert any(np.array_equal(out["rng"][1], np.random.RandomState(r).get_state()[1])
               for r in (0, 1))
    assert type(out["rng"]) is tuple and out["rng"][0] == "MT19937"
