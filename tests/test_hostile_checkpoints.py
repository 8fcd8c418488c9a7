"""A checkpoint on disk is untrusted input (issue 10, defects 4 and 5).

Loading never returns bytes that were not written for that tensor, and every
malformed manifest is refused with a CheckpointError subclass (a ManifestError
naming the record or key path): never RecursionError, a torch RuntimeError,
ValueError, wrong data or uninitialised memory. fpctl reports the same errors
without a traceback. tests/test_manifest_fuzz.py mutates manifests at random;
these are the cases found by hand.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from hostile_support import (
    MANIFEST,
    distinct,
    distributed_checkpoint,
    distributed_state,
    edit,
    grid,
    read_doc,
    record_index,
    same,
    single_state,
)
from support import flip_bit

import fastpersist
from fastpersist import ChecksumMismatchError, ManifestError, UnsupportedValueError
from fastpersist.cli import main
from fastpersist.tensors import checkpoint

Doc = dict[str, Any]


def refused(ckpt: Path, match: str, *, verify: bool = True) -> ManifestError:
    """The manifest is refused when read on its own and when loading."""
    with pytest.raises(ManifestError, match=match):
        checkpoint.read_manifest(ckpt)
    with pytest.raises(ManifestError, match=match) as info:
        fastpersist.load(ckpt, verify=verify)
    assert str(ckpt) in str(info.value)
    return info.value


@pytest.fixture
def single(tmp_path: Path) -> Path:
    p = tmp_path / "single"
    fastpersist.save(single_state(), p)
    return p


@pytest.fixture
def dist(tmp_path: Path) -> Path:
    p = tmp_path / "dist"
    distributed_state(p)
    return p


def eight(tmp_path: Path) -> Path:
    """Defect 4's checkpoint: one global of shape [8] as two chunks of [4]."""
    p = tmp_path / "eight"
    distributed_checkpoint(p, {"x": (torch.arange(8, dtype=torch.float32), grid((8,), [[4]]))})
    return p


# --- defect 4: chunks that do not tile their global tensor ---------------------------------


def test_two_chunks_of_one_record_are_refused(tmp_path: Path) -> None:
    """The issue's reproduction loaded [0,1,2,3,0,0,1.1e-43,0]: uninitialised memory."""
    ckpt = eight(tmp_path)
    edit(ckpt, lambda d: d["globals"][0]["chunks"][1].update(
        tensor=d["globals"][0]["chunks"][0]["tensor"]))
    refused(ckpt, r"globals\[0\] \('x'\).*tensors\[\d\] \('x@0'\) is used by two chunks")


def test_overlapping_chunks_whose_volumes_add_up_are_refused(tmp_path: Path) -> None:
    ckpt = eight(tmp_path)
    edit(ckpt, lambda d: d["globals"][0]["chunks"][1].update(offsets=[2]))
    refused(ckpt, r"globals\[0\] \('x'\): chunks overlap or leave a gap")


def test_overlapping_chunks_of_a_grid_are_refused(tmp_path: Path) -> None:
    ckpt = tmp_path / "grid"
    distributed_checkpoint(ckpt, {"w": (distinct(4, 4), grid((4, 4), [[2], [2]]))})
    # Chunk (2,2) moved to (2,1): it overlaps (2,0), leaves a gap at column 3.
    edit(ckpt, lambda d: d["globals"][0]["chunks"][3].update(offsets=[2, 1]))
    refused(ckpt, r"globals\[0\] \('w'\): chunks overlap or leave a gap")


def test_a_small_file_cannot_drive_a_huge_allocation(tmp_path: Path) -> None:
    """20,000 chunks naming one 64 KiB record claim a 1.2 GiB tensor; the
    manifest is refused before anything is allocated or read."""
    ckpt = tmp_path / "big"
    distributed_checkpoint(ckpt, {"x": (distinct(16384), [((0,), (16384,))])})
    n = 20_000

    def inflate(d: Doc) -> None:
        g = d["globals"][0]
        g["shape"] = [16384 * n]
        g["chunks"] = [{"tensor": g["chunks"][0]["tensor"], "offsets": [16384 * i]}
                       for i in range(n)]

    edit(ckpt, inflate)
    refused(ckpt, "is used by two chunks")


def test_chunks_out_of_bounds_or_of_another_rank_are_refused(tmp_path: Path) -> None:
    ckpt = eight(tmp_path)
    edit(ckpt, lambda d: d["globals"][0]["chunks"][1].update(offsets=[5]))
    refused(ckpt, r"chunk 1 \('x@4'\) at \[5\] of shape \[4\] does not fit in \[8\]")
    edit(ckpt, lambda d: d["globals"][0]["chunks"][1].update(offsets=[4, 0]))
    refused(ckpt, r"chunk 1 \('x@4'\) at \[4, 0\] of shape \[4\] does not fit in \[8\]")


def test_a_record_in_two_globals_is_refused(tmp_path: Path) -> None:
    ckpt = tmp_path / "two"
    distributed_checkpoint(ckpt, {"a": (distinct(4), [((0,), (4,))]),
                                  "b": (distinct(4, start=9), [((0,), (4,))])})
    edit(ckpt, lambda d: d["globals"][1]["chunks"][0].update(
        tensor=d["globals"][0]["chunks"][0]["tensor"]))
    refused(ckpt, r"globals\[1\] \('b'\).*is used by two chunks")


def test_duplicate_global_names_are_refused(dist: Path) -> None:
    edit(dist, lambda d: d["globals"][1].update(name=d["globals"][0]["name"]))
    refused(dist, r"globals\[1\]: duplicate name 'w'")


# --- defect 5: other hostile inputs --------------------------------------------------------


def test_duplicate_tensor_names_in_one_file_are_refused(tmp_path: Path) -> None:
    """The issue's reproduction: a tree pointing at record 1 loaded another tensor's bytes."""
    ckpt = tmp_path / "dup"
    fastpersist.save({"a": torch.tensor([1.0, 1.0]), "b": torch.tensor([7.0, 7.0])}, ckpt)
    edit(ckpt, lambda d: d["tensors"][1].update(name="a"))
    refused(ckpt, r"tensors\[1\]: duplicate name 'a'")


@pytest.mark.parametrize("where", ["json", "tree"])
def test_deep_nesting_is_a_manifest_error(single: Path, where: str) -> None:
    """json.loads and the tree's decoder recursed into a RecursionError."""
    if where == "json":  # too deep for the JSON parser itself
        text = (single / MANIFEST).read_text()
        (single / MANIFEST).write_text(text.replace('"tree": ', '"tree": ' + "[" * 100_000 + "]"
                                                    * 100_000 + ", \"x\": ", 1))
        refused(single, "nested too deeply")
    else:  # parses, but nests 300 lists
        node: Any = 1
        for _ in range(300):
            node = {"t": "list", "v": [node]}
        edit(single, lambda d: d.update(tree=node))
        refused(single, r"tree at 0\.0\.0\..*: nested deeper than \d+ levels")


def test_saving_state_nested_too_deep_is_refused(tmp_path: Path) -> None:
    """What load refuses, save refuses first (it recursed into a RecursionError
    a little deeper); 100 levels, the most that load takes, round-trip."""

    def nested(levels: int) -> Any:
        obj: Any = torch.ones(1)  # the innermost value is the last level
        for _ in range(levels - 2):
            obj = [obj]
        return {"deep": obj}

    fastpersist.save(nested(100), tmp_path / "ok")
    assert same(fastpersist.load(tmp_path / "ok"), nested(100))
    with pytest.raises(UnsupportedValueError, match=r"nested deeper than 100 levels"):
        fastpersist.save(nested(101), tmp_path / "deep")
    with pytest.raises(UnsupportedValueError, match=r"nested deeper than 100 levels"):
        fastpersist.save(nested(400), tmp_path / "deep")
    assert not (tmp_path / "deep").exists()


@pytest.mark.parametrize("case", ["record", "view", "global"])
def test_a_shape_whose_strides_overflow_is_refused(single: Path, dist: Path, case: str) -> None:
    """shape [0, 2**62, 2**62] holds no element but overflowed torch's stride calculation."""
    huge = [0, 2**62, 2**62]
    if case == "record":
        edit(single, lambda d: d["tensors"][record_index(d, "empty")].update(shape=huge))
        refused(single, r"tensors\[\d+\] \('empty'\): shape \[0, 4611686018427387904, .*too large")
    elif case == "view":
        edit(single, lambda d: d["tree"]["v"][1]["v"][1]["view"].update(shape=huge,
                                                                         stride=[1, 1, 1]))
        refused(single, r"tree at views\.1: view shape .* too large")
    else:
        edit(dist, lambda d: d["globals"][3].update(shape=huge))
        refused(dist, r"globals\[3\] \('e'\): shape .* too large")


@pytest.mark.parametrize("device", ["cuda:abc", "cpu:-1", "meta", 7, ["cpu"]])
def test_bad_device_strings_are_refused(single: Path, device: Any) -> None:
    """Torch raised RuntimeError for a bad string; "meta" loaded a tensor without data."""
    edit(single, lambda d: d["tree"]["v"][3].update(device=device))
    refused(single, r"tree at scalar: bad device")


def test_device_types_torch_does_not_know_are_refused_on_load(single: Path) -> None:
    """Which device types exist is torch's to say (a renamed privateuse1 backend
    adds one), so these pass the manifest's checks and are refused on load."""
    edit(single, lambda d: d["tree"]["v"][3].update(device="bogus"))
    with pytest.raises(ManifestError, match=r"tree at scalar: bad device 'bogus'"):
        fastpersist.load(single)
    edit(single, lambda d: (d["tree"]["v"][3].pop("device"),
                            d["tree"]["v"][13].update(v="nonsense")))
    with pytest.raises(ManifestError, match=r"tree at device: bad device 'nonsense'"):
        fastpersist.load(single)


@pytest.mark.parametrize(("change", "match"), [
    ({"shape": [-1]}, "view shape"),
    ({"shape": [2, 2], "stride": [1]}, "view shape"),
    ({"stride": [-1]}, "view stride"),
    ({"offset": 1}, "view offset 1"),
    ({"offset": 36}, "view of 16 bytes at offset 36 lies outside"),
    ({"dtype": "F128"}, "view dtype"),
])
def test_bad_views_are_refused(single: Path, change: Doc, match: str) -> None:
    """A negative dimension raised torch RuntimeError."""
    edit(single, lambda d: d["tree"]["v"][1]["v"][1]["view"].update(change))
    refused(single, rf"tree at views\.1: {match}")


@pytest.mark.parametrize("entry", [True, -1, 99, 1.0, "0", None])
def test_bad_entry_indices_are_refused(single: Path, entry: Any) -> None:
    """`true` was taken as entry 1: another tensor."""
    edit(single, lambda d: d["tree"]["v"][2].update(e=entry))
    refused(single, r"tree at param: tensor entry")


def test_gradients_on_an_integer_tensor_are_refused(single: Path) -> None:
    """Found by the fuzz test: torch raised RuntimeError ("Only Tensors of
    floating point ... can require gradients")."""
    edit(single, lambda d: d["tree"]["v"][0]["v"][2].update(grad=True))  # model.b, int64
    with pytest.raises(ManifestError, match="cannot be a parameter or require gradients"):
        fastpersist.load(single)


def test_metadata_on_a_plain_dict_is_refused(single: Path) -> None:
    """Found by the fuzz test: setting _metadata on a dict raised AttributeError."""
    edit(single, lambda d: d["tree"].update(meta={"t": "dict", "k": [], "v": []}))
    refused(single, r"tree at <root>: a plain dict with _metadata")


@pytest.mark.parametrize("where", ["global dtype", "view dtype", "float"])
def test_unhashable_values_where_names_belong_are_refused(single: Path, dist: Path,
                                                         where: str) -> None:
    """Found by the fuzz test in the new checks: `[] in frozenset()` raised TypeError."""
    if where == "global dtype":
        edit(dist, lambda d: d["globals"][0].update(dtype=[]))
        refused(dist, r"globals\[0\] \('w'\): unknown dtype \[\]")
        return
    if where == "view dtype":
        edit(single, lambda d: d["tree"]["v"][1]["v"][1]["view"].update(dtype=[]))
    else:
        edit(single, lambda d: d["tree"]["v"][15].update(v=[]))
    refused(single, r"tree at (views\.1|inf): ")


@pytest.mark.parametrize("verify", [True, False])
def test_records_must_match_the_data_files_header(tmp_path: Path, verify: bool) -> None:
    """Two records of the same size with their places swapped: without the CRC
    check each loaded the other's bytes."""
    ckpt = tmp_path / "swap"
    fastpersist.save({"a": distinct(4), "b": distinct(4, start=50)}, ckpt)

    def swap(d: Doc) -> None:
        a, b = d["tensors"]
        a["offset"], b["offset"] = b["offset"], a["offset"]
        a["crc32c"], b["crc32c"] = b["crc32c"], a["crc32c"]

    edit(ckpt, swap)
    checkpoint.read_manifest(ckpt)  # consistent on its own
    with pytest.raises(ManifestError, match=r"tensor 'a' .*data-00000.safetensors.*header"):
        fastpersist.load(ckpt, verify=verify)


@pytest.mark.parametrize("data_start", [8, 4088, 4095])
def test_a_data_start_that_is_not_the_headers_end_is_refused(tmp_path: Path,
                                                             data_start: int) -> None:
    """Found by the fuzz test: with data_start cut short and verify=False, the
    header was never compared (now it is read by its own length)."""
    ckpt = tmp_path / "start"
    fastpersist.save({"a": distinct(4096)}, ckpt)
    edit(ckpt, lambda d: d["files"][0].update(data_start=data_start))
    with pytest.raises(ManifestError, match="header ends at 4096, manifest says"):
        fastpersist.load(ckpt, verify=False)


def _two_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """a and b in data-00000 and c alone in data-00001: a load of several
    files reads each file's header with its tensors (checkpoint._read_overlapped)."""
    monkeypatch.setenv("FASTPERSIST_FILE_BYTES", str(8 << 10))
    ckpt = tmp_path / "two"
    fastpersist.save({"a": distinct(4), "b": distinct(4, start=50),
                      "c": distinct(4096, start=100)}, ckpt)
    assert len(read_doc(ckpt)["files"]) == 2
    return ckpt


@pytest.mark.parametrize("into", [False, True])
@pytest.mark.parametrize("verify", [True, False])
def test_records_must_match_the_header_read_with_the_data(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, verify: bool, into: bool) -> None:
    ckpt = _two_files(tmp_path, monkeypatch)

    def swap(d: Doc) -> None:
        a, b = (r for r in d["tensors"] if r["name"] in ("a", "b"))
        a["offset"], b["offset"] = b["offset"], a["offset"]
        a["crc32c"], b["crc32c"] = b["crc32c"], a["crc32c"]

    edit(ckpt, swap)
    target = {"a": torch.zeros(4), "b": torch.zeros(4), "c": torch.zeros(4096)}
    with pytest.raises(ManifestError, match=r"tensor 'a' .*data-00000.safetensors.*header"):
        fastpersist.load(ckpt, verify=verify, into=target if into else None)


def test_a_data_start_short_of_the_header_read_with_the_data(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The header's own length reaches past data_start: its end is read from the file."""
    ckpt = _two_files(tmp_path, monkeypatch)
    edit(ckpt, lambda d: d["files"][1].update(data_start=8))
    with pytest.raises(ManifestError, match=r"data-00001\.safetensors: header ends at 4096, "
                                            r"manifest says 8"):
        fastpersist.load(ckpt, verify=False)


@pytest.mark.parametrize("into", [False, True])
def test_a_corrupt_header_read_with_the_data_is_named(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, into: bool) -> None:
    """A flipped bit in the second file's header (in its JSON, which then no
    longer parses): the CRC32C mismatch names the header, before any parse."""
    ckpt = _two_files(tmp_path, monkeypatch)
    flip_bit(ckpt / "data-00001.safetensors", 20)
    target = {"a": torch.zeros(4), "b": torch.zeros(4), "c": torch.zeros(4096)}
    with pytest.raises(ChecksumMismatchError,
                       match=r"safetensors header in data-00001\.safetensors is corrupt") as info:
        fastpersist.load(ckpt, into=target if into else None)
    assert (info.value.file, info.value.tensor) == ("data-00001.safetensors", "<header>")


def test_records_sharing_bytes_are_refused(tmp_path: Path) -> None:
    """b described as a's bytes (CRC included) loaded a's values as b."""
    ckpt = tmp_path / "overlap"
    fastpersist.save({"a": distinct(4), "b": distinct(4, start=50)}, ckpt)
    edit(ckpt, lambda d: d["tensors"][1].update(
        {k: d["tensors"][0][k] for k in ("offset", "length", "crc32c")}))
    refused(ckpt, r"tensors\[1\] \('b'\): bytes \d+\.\.\d+ overlap tensors\[0\] \('a'\)")


@pytest.mark.parametrize(("text", "match"), [
    ("12" * 3000, "not valid JSON"),  # int() refuses > 4300 digits: a ValueError
    ("NaN", "not valid JSON"),
    ("1e400", "created_unix"),
    ("-1", "created_unix"),
])
def test_numbers_json_or_python_cannot_hold(single: Path, text: str, match: str) -> None:
    doc = (single / MANIFEST).read_text()
    (single / MANIFEST).write_text(doc.replace('"created_unix": ', f'"created_unix": {text}, '
                                               '"was": ', 1))
    refused(single, match)


def test_duplicate_json_keys_are_refused(single: Path) -> None:
    """Parsers disagree on which of two values counts; the manifest must not be ambiguous."""
    doc = (single / MANIFEST).read_text()
    (single / MANIFEST).write_text(doc.replace('"offset":', '"offset":0,"offset":', 1))
    refused(single, "duplicate key 'offset'")


def test_duplicate_dict_keys_in_the_tree_are_refused(single: Path) -> None:
    def dup(d: Doc) -> None:
        d["tree"]["k"].append("step")
        d["tree"]["v"].append(8)

    edit(single, dup)
    refused(single, r"tree at <root>: duplicate key 'step'")


def test_tensor_dict_keys_are_refused(single: Path) -> None:
    edit(single, lambda d: d["tree"]["k"].__setitem__(6, {"t": "tensor", "e": 0}))
    refused(single, r"tree at <root>: a tensor as a dict key")


# --- numpy values (issue 12): their marks, and the tensor they stand for -------------------


def numpy_checkpoint(path: Path) -> Path:
    import numpy as np

    base = distinct(12, dtype=torch.float64)
    fastpersist.save({"a": np.arange(6, dtype=np.float32).reshape(2, 3), "s": np.float32(1.5),
                      "c": np.array([1 + 2j, 3j]), "half": distinct(3, dtype=torch.bfloat16),
                      "t": distinct(3), "views": [base, base[1::3]]}, path)
    return path


def _node(d: Doc, key: str) -> Doc:
    node: Doc = d["tree"]["v"][d["tree"]["k"].index(key)]
    return node


@pytest.mark.parametrize(("key", "change", "match"), [
    ("a", {"np": "matrix"}, "numpy kind 'matrix' is not 'array' or 'scalar'"),
    ("a", {"np": ["array"]}, r"numpy kind \['array'\]"),
    ("a", {"np": None}, "numpy kind None"),
    ("a", {"np_dtype": "float32"}, "numpy dtype 'float32' is not 'complex128'"),
    ("c", {"np_dtype": {}}, r"numpy dtype \{\}"),
    ("t", {"np_dtype": "complex128"}, "numpy kind None"),  # np_dtype without np
    ("a", {"device": "cuda:0"}, "a numpy value with 'device'"),
    ("a", {"param": False}, "a numpy value with 'param'"),
    ("a", {"grad": True}, "a numpy value with 'grad'"),
    ("a", {"sharded": False}, "a numpy value with 'sharded'"),
])
def test_bad_numpy_marks_are_refused(tmp_path: Path, key: str, change: Doc, match: str) -> None:
    ckpt = numpy_checkpoint(tmp_path / "np")
    edit(ckpt, lambda d: _node(d, key).update(change))
    refused(ckpt, rf"tree at {key}: {match}")


@pytest.mark.parametrize(("key", "change", "match"), [
    ("t", {"np": "scalar"}, r"a numpy scalar stored with shape \[3\]"),
    ("half", {"np": "array"}, "a numpy value cannot be stored as torch.bfloat16"),
    ("s", {"np_dtype": "complex128"}, r"a complex128 numpy value stored as torch.float32 \[\]"),
    ("t", {"np": "array", "np_dtype": "complex128"},
     r"a complex128 numpy value stored as torch.float32 \[3\]"),
])
def test_numpy_marks_on_tensors_numpy_cannot_hold_are_refused_on_load(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], key: str, change: Doc,
        match: str) -> None:
    """The manifest is well formed; the stored tensor is not what the mark says."""
    ckpt = numpy_checkpoint(tmp_path / "np")
    edit(ckpt, lambda d: _node(d, key).update(change))
    checkpoint.read_manifest(ckpt)
    for verify in (True, False):
        with pytest.raises(ManifestError, match=rf"tree at {key}: {match}"):
            fastpersist.load(ckpt, verify=verify)
    assert main(["inspect", str(ckpt)]) == 0  # describes what the manifest says
    assert main(["restore", str(ckpt), "--to", str(tmp_path / "out.pt")]) == 2
    assert "Traceback" not in "".join(capsys.readouterr())
    assert not (tmp_path / "out.pt").exists()


def test_complex128_marks_on_other_float64_tensors(tmp_path: Path) -> None:
    """float64 pairs make complex128 values: a last dimension of 2 is needed, and
    any float64 tensor with one loads as what it says (its bytes were written)."""
    import numpy as np

    ckpt = tmp_path / "c"
    fastpersist.save({"odd": distinct(3, dtype=torch.float64),
                      "pairs": distinct(2, 2, dtype=torch.float64)}, ckpt)
    edit(ckpt, lambda d: _node(d, "odd").update(np="array", np_dtype="complex128"))
    with pytest.raises(ManifestError, match=r"tree at odd: a complex128 numpy value stored "
                       r"as torch.float64 \[3\], not float64 pairs"):
        fastpersist.load(ckpt)
    edit(ckpt, lambda d: (_node(d, "odd").clear(), _node(d, "odd").update(t="tensor", e=0),
                          _node(d, "pairs").update(np="array", np_dtype="complex128")))
    out = fastpersist.load(ckpt)["pairs"]
    assert out.dtype == np.complex128 and out.tolist() == [1 + 2j, 3 + 4j]


def test_numpy_marks_on_views_load_as_contiguous_copies(tmp_path: Path) -> None:
    """A view with strides (base[1::3]) marked numpy: a C-contiguous array of
    its elements, not a window on other bytes; a mark on a tensor shared with
    a torch node leaves that tensor as it was."""
    import numpy as np

    ckpt = numpy_checkpoint(tmp_path / "np")
    edit(ckpt, lambda d: [n.update(np="array") for n in _node(d, "views")["v"][1:]])
    out = fastpersist.load(ckpt)["views"]
    assert type(out[0]) is torch.Tensor and torch.equal(out[0], distinct(12, dtype=torch.float64))
    assert type(out[1]) is np.ndarray and out[1].flags.c_contiguous
    assert out[1].tolist() == [2.0, 5.0, 8.0, 11.0]


# --- what must keep loading ----------------------------------------------------------------


def test_legitimate_checkpoints_still_load(single: Path, dist: Path, tmp_path: Path) -> None:
    """0-element and 0-d tensors, views, tied weights, a Parameter, a 2x2 grid of
    chunks, uneven row pieces, and many small chunks."""
    assert same(fastpersist.load(single), single_state())
    loaded = fastpersist.load(dist)
    assert same(loaded, distributed_state(tmp_path / "again"))
    assert loaded["w_tied"] is loaded["w"]
    many = tmp_path / "many"
    expected = distributed_checkpoint(many, {"x": (distinct(300, 2), grid(
        (300, 2), [list(range(1, 300)), [1]]))})
    assert len(read_doc(many)["globals"][0]["chunks"]) == 600
    assert same(fastpersist.load(many), expected)


# --- fpctl ---------------------------------------------------------------------------------


def _deep(d: Doc) -> None:
    node: Any = 1
    for _ in range(300):
        node = {"t": "list", "v": [node]}
    d["tree"] = node


HOSTILE: dict[str, Callable[[Doc], None]] = {
    "deep-tree": _deep,
    "created-nan": lambda d: d.update(created_unix=float("nan")),
    "stride-overflow": lambda d: d["tensors"][record_index(d, "empty")].update(
        shape=[0, 2**62, 2**62]),
    "bad-device": lambda d: d["tree"]["v"][3].update(device="cuda:x"),
    "bad-numpy-mark": lambda d: d["tree"]["v"][3].update(np="matrix"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
@pytest.mark.parametrize("command", ["inspect", "verify", "restore", "ls"])
def test_fpctl_reports_hostile_checkpoints_without_a_traceback(
        single: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], case: str,
        command: str) -> None:
    doc = read_doc(single)
    HOSTILE[case](doc)
    (single / MANIFEST).write_text(json.dumps(doc))  # NaN allowed: a hostile writer
    argv = {"inspect": ["inspect", str(single)], "verify": ["verify", str(single)],
            "restore": ["restore", str(single), "--to", str(tmp_path / "out.pt")],
            "ls": ["ls", str(single.parent)]}[command]
    rc = main(argv)
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    if command == "ls":
        assert rc == 0 and "corrupt: " in out and "manifest" in out
    else:
        assert rc == (1 if command == "verify" else 2)
        assert "manifest" in err and str(single) in err
    assert not (tmp_path / "out.pt").exists()


# --- compressed records: the frame index (issue 13) ------------------------------------------


@pytest.fixture
def packed_ckpt(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A compressed checkpoint whose 'w' (16 KiB) is four frames of 4 KiB."""
    monkeypatch.setenv("FASTPERSIST_FRAME_BYTES", "4096")
    p = tmp_path / "packed"
    fastpersist.save({"w": distinct(64, 64), "b": distinct(3)}, p, compression="zstd")
    assert [len(t.get("frames", [])) for t in read_doc(p)["tensors"]] == [4, 0]
    return p


def _frames(d: Doc) -> list[list[int]]:
    frames: list[list[int]] = d["tensors"][record_index(d, "w")]["frames"]
    return frames


def _overlap(d: Doc) -> None:  # frame 2 starts one stored byte early
    _frames(d)[2][2] -= 1


def _gap(d: Doc) -> None:  # frame 1 raw bytes start late
    _frames(d)[1][0] += 4


def _past_end(d: Doc) -> None:  # the record and its last frame run past the file
    w = d["tensors"][record_index(d, "w")]
    w["stored_length"] += 100_000
    _frames(d)[3][3] += 100_000


def _many(d: Doc) -> None:  # a million frames for 16 KiB: refused before any is read
    _frames(d).extend([[0, 4, 0, 4, 0]] * 1_000_000)


def _huge_frame(d: Doc) -> None:  # one frame of 128 MiB raw bytes
    w = d["tensors"][record_index(d, "w")]
    w["shape"] = [1 << 25]
    w["length"] = 1 << 27
    w["frames"] = [[0, 1 << 27, 0, w["stored_length"], 0]]


FRAME_CASES: dict[str, tuple[Callable[[Doc], None], str]] = {
    "overlap": (_overlap, r"frames\[2\] starts at raw 8192, stored \d+; the frames must tile"),
    "gap": (_gap, r"frames\[1\] starts at raw 4100"),
    "past-end": (_past_end, r"frames\[3\] has \d+ stored bytes for 4096 raw ones"),
    "past-file": (lambda d: d["tensors"][record_index(d, "w")].update(
        offset=d["files"][0]["size"] - 10), r"lie outside the data section"),
    "count": (_many, r"1000004 frames for 16384 bytes \(at most 4\)"),
    "huge-frame": (_huge_frame, r"frames\[0\] has 134217728 raw bytes"),
    "short": (lambda d: _frames(d).pop(), r"the frames cover 12288 raw"),
    "not-ints": (lambda d: _frames(d)[0].__setitem__(1, "4096"), r"five integers"),
    "crc-range": (lambda d: _frames(d)[0].__setitem__(4, 1 << 32), r"five integers"),
    "odd-elements": (lambda d: (_frames(d)[0].__setitem__(1, 4094),
                                _frames(d)[1].__setitem__(0, 4094)),
                     r"frames\[0\] has 4094 raw bytes \(whole elements"),
    "no-frames": (lambda d: d["tensors"][record_index(d, "w")].pop("frames"),
                  r"'frames' must be a list"),
    "no-stored-length": (lambda d: d["tensors"][record_index(d, "w")].pop("stored_length"),
                         r"'stored_length' must be an integer"),
    "raw-with-frames": (lambda d: d["tensors"][record_index(d, "b")].update(frames=[]),
                        r"a raw record has no 'stored_length' or 'frames'"),
    "unknown-encoding": (lambda d: d["tensors"][record_index(d, "w")].update(encoding="lz4"),
                         r"unknown encoding 'lz4'"),
}


@pytest.mark.parametrize("case", sorted(FRAME_CASES))
def test_hostile_frame_indexes_are_refused(packed_ckpt: Path, case: str) -> None:
    mutate, match = FRAME_CASES[case]
    edit(packed_ckpt, mutate)
    name = "b" if case == "raw-with-frames" else "w"
    refused(packed_ckpt, rf"tensors\[\d\] \('{name}'\): .*" + match)
    for argv in (["inspect", str(packed_ckpt)], ["verify", str(packed_ckpt)]):
        assert main(argv) in (1, 2)


def test_a_record_whose_encoding_differs_from_the_file_header_is_refused(
        packed_ckpt: Path) -> None:
    """Raw in the manifest, compressed in the packed file's header: the manifest
    could make a load read compressed bytes as a tensor's."""

    def to_raw(d: Doc) -> None:  # the stored bytes, claimed as a raw U8 tensor
        w = d["tensors"][record_index(d, "w")]
        n = w.pop("stored_length")
        del w["frames"]
        w.update(encoding="raw", dtype="U8", shape=[n], length=n)

    edit(packed_ckpt, to_raw)
    with pytest.raises(ManifestError, match=r"tensor 'w' in data-00000\.fpz does not match "
                       r"the file's header.*raw.*zstd-bytegroup-v1"):
        fastpersist.load(packed_ckpt)
