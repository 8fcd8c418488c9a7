"""The C scanner of a manifest's tensor records (format/record_scan.py) is a
shortcut that never changes what a manifest means.

For manifests as fastpersist writes them it must engage (or it saves nothing)
and give the Manifest the general parser gives. For any other text, written
variants and edits of every check the records go through, and Hypothesis's
byte-level edits of the records' lines, `Manifest.from_json` must return what
the general parser alone returns: the same Manifest, or a ManifestError with
the same message.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from hostile_support import MANIFEST, distributed_state, single_state
from hypothesis import given, settings
from hypothesis import strategies as st

import fastpersist
from fastpersist.errors import ManifestError
from fastpersist.format import dtypes, record_scan
from fastpersist.format import manifest as mf
from fastpersist.format.records import TensorRecord

WHERE = "ckpt"


def general(text: bytes) -> Any:
    """What the general parser alone makes of `text`."""
    try:
        return mf._validate(mf.parse_json(text, WHERE), WHERE)
    except ManifestError as exc:
        return ("refused", str(exc))


def parsed(text: bytes) -> Any:
    try:
        return mf.Manifest.from_json(text, WHERE)
    except ManifestError as exc:
        return ("refused", str(exc))


def shortcut_taken(text: bytes) -> bool:
    scan = record_scan.Scan.of(text)
    if scan is None:
        return False
    try:
        return mf._build(mf.parse_json(scan.rest, WHERE), WHERE, scan) is not None
    except ManifestError:
        return False


def same_outcome(text: bytes) -> Any:
    got, expected = parsed(text), general(text)
    assert got == expected
    if isinstance(got, mf.Manifest):  # records compare by value; types too
        assert [type(t) for t in got.tensors] == [type(t) for t in expected.tensors]
    return got


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    """A manifest as save writes it: a small state with every kind of value."""
    path = tmp_path_factory.mktemp("scan") / "ckpt"
    fastpersist.save(single_state(), path)
    return (path / MANIFEST).read_bytes()


def test_the_scanner_is_built() -> None:
    # (The shortcut declines without it: a build that lost it would pass the rest silently.)
    assert record_scan._format is not None


def test_manifests_as_written_take_the_shortcut_and_mean_the_same(
        written: bytes, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert shortcut_taken(written)
    manifest = same_outcome(written)
    assert isinstance(manifest, mf.Manifest) and len(manifest.tensors) >= 8
    many = {f"layer.{i}": torch.full((i % 7, 3), float(i % 100), dtype=dtype)
            for i, dtype in enumerate([torch.float32, torch.bfloat16, torch.int8, torch.bool,
                                       torch.float64, torch.uint8] * 50)}
    fastpersist.save(many, tmp_path / "many")
    text = (tmp_path / "many" / MANIFEST).read_bytes()
    assert shortcut_taken(text)
    assert len(same_outcome(text).tensors) == 300
    monkeypatch.setenv("FASTPERSIST_FILE_BYTES", "4096")  # many data files
    fastpersist.save(many, tmp_path / "split")
    assert shortcut_taken((tmp_path / "split" / MANIFEST).read_bytes())
    assert len(same_outcome((tmp_path / "split" / MANIFEST).read_bytes()).files) > 1
    loaded = fastpersist.load(tmp_path / "split")
    assert all(torch.equal(loaded[k], v) for k, v in many.items())


def test_a_distributed_manifest_takes_the_shortcut(tmp_path: Path) -> None:
    distributed_state(tmp_path / "dist")  # (its helper writes the manifest with json.dumps)
    text = general((tmp_path / "dist" / MANIFEST).read_bytes()).to_json()
    assert shortcut_taken(text)
    assert same_outcome(text).globals


def test_scanned_records_are_ordinary_frozen_records(written: bytes) -> None:
    manifest = mf.Manifest.from_json(written, WHERE)
    record = manifest.tensors[0]
    assert type(record) is TensorRecord and record.stored_span == record.length
    with pytest.raises(dataclasses.FrozenInstanceError):
        record.offset = 0  # type: ignore[misc]
    assert dataclasses.replace(record, offset=record.offset) == record
    assert hash(record) == hash(dataclasses.replace(record))
    assert {r: i for i, r in enumerate(manifest.tensors)}[record] == 0


def test_names_the_writer_escapes_are_parsed_the_general_way(tmp_path: Path) -> None:
    # A quote, a backslash, non-ASCII: the writer escapes them, the scanner declines.
    state = {'q"uote': torch.ones(2), "back\\slash": torch.ones(3), "naïve": torch.ones(4)}
    fastpersist.save(state, tmp_path / "ckpt")
    text = (tmp_path / "ckpt" / MANIFEST).read_bytes()
    assert not shortcut_taken(text)
    assert isinstance(same_outcome(text), mf.Manifest)
    assert set(fastpersist.load(tmp_path / "ckpt")) == set(state)


def test_compressed_records_are_parsed_the_general_way(tmp_path: Path) -> None:
    state = {"w": torch.zeros(64 << 10), "b": torch.arange(10.0)}
    fastpersist.save(state, tmp_path / "ckpt", compression="zstd")
    text = (tmp_path / "ckpt" / MANIFEST).read_bytes()
    assert not shortcut_taken(text)
    assert isinstance(same_outcome(text), mf.Manifest)


def _record_lines(text: bytes) -> tuple[list[str], int, int]:
    lines = text.decode().split("\n")
    first = lines.index(' "tensors": [') + 1
    last = lines.index(" ],", first)
    return lines, first, last


def _respell(text: bytes, index: int, change: Any) -> bytes:
    """The manifest with record `index` as change(its dict) makes it, spelled
    as the writer spells."""
    lines, first, _ = _record_lines(text)
    line = lines[first + index]
    comma = line.endswith(",")
    doc = change(json.loads(line.strip().rstrip(",")))
    lines[first + index] = "  " + json.dumps(doc, separators=(",", ":")) + ("," if comma else "")
    return "\n".join(lines).encode()


def _edit_record(text: bytes, index: int, **changes: Any) -> bytes:
    return _respell(text, index, lambda doc: {**doc, **changes})


def _raw_edit(text: bytes, old: str, new: str) -> bytes:
    assert old.encode() in text
    return text.replace(old.encode(), new.encode(), 1)


def _first(text: bytes, key: str) -> Any:
    lines, first, _ = _record_lines(text)
    return json.loads(lines[first].strip().rstrip(","))[key]


def _itemsize(text: bytes) -> int:
    return dtypes.itemsize(_first(text, "dtype"))


EDITS: dict[str, Any] = {
    "offset with a leading zero": lambda t: _raw_edit(
        t, f'"offset":{_first(t, "offset")},', f'"offset":0{_first(t, "offset")},'),
    "a 20-digit length": lambda t: _edit_record(t, 0, length=10**19),
    "a negative offset": lambda t: _edit_record(t, 0, offset=-1),
    "an offset past the file": lambda t: _edit_record(t, 0, offset=1 << 40),
    "an offset inside the header": lambda t: _edit_record(t, 0, offset=8),
    "a length that is not shape x itemsize": lambda t: _edit_record(
        t, 0, length=_first(t, "length") + 4),
    "a CRC of 33 bits": lambda t: _edit_record(t, 0, crc32c=1 << 32),
    # (Shapes with a length that fits them: only the bound is wrong.)
    "65 dimensions": lambda t: _edit_record(t, 0, shape=[1] * 65, length=_itemsize(t)),
    "64 dimensions": lambda t: _edit_record(t, 0, shape=[1] * 64, length=_itemsize(t)),
    "a shape past the element bound": lambda t: _edit_record(
        t, 0, shape=[0, 1 << 31, 1 << 31], length=0),
    "a dimension past the element bound": lambda t: _edit_record(
        t, 0, shape=[0, (1 << 60) + 1], length=0),
    "a float in a shape": lambda t: _raw_edit(t, '"shape":[', '"shape":[1.0,'),
    "an unknown dtype": lambda t: _edit_record(t, 0, dtype="F128"),
    "an unlisted file": lambda t: _edit_record(t, 0, file="data-99999.safetensors"),
    "another encoding": lambda t: _edit_record(t, 0, encoding="zstd-bytegroup-v1"),
    "keys in another order": lambda t: _respell(t, 0, lambda doc: dict(reversed(doc.items()))),
    "an extra key": lambda t: _raw_edit(t, ',"encoding":"raw"}', ',"encoding":"raw","x":1}'),
    "a key twice": lambda t: _raw_edit(t, ',"encoding":"raw"}', ',"encoding":"raw","name":"x"}'),
    "a space after a comma": lambda t: _raw_edit(t, ',"file":', ', "file":'),
    "a name twice": lambda t: _edit_record(t, 1, name=_first(t, "name")),
    "two records on the same bytes": lambda t: _edit_record(
        t, 1, offset=_first(t, "offset")),
    "a name with a tab": lambda t: _edit_record(t, 0, name="a\tb"),
    "a truncated record line": lambda t: _raw_edit(t, ',"encoding":"raw"}', ',"encoding":"ra'),
    "no records": lambda t: b"\n".join(
        line for line in t.split(b"\n") if not line.startswith(b"  {\"name\"")),
    "a second top-level tensors key": lambda t: _raw_edit(
        t, ' "tree": ', ' "tensors": [],\n "tree": '),
    "a tensors array nested before the real one": lambda t: _raw_edit(
        t, ' "files": [', ' "x": {\n "tensors": [\n  {"name":"n"}\n ]},\n "files": ['),
    "the tensors array moved into the tree": lambda t: _raw_edit(
        t, ' "tensors": [', ' "tensorz": [').replace(b'"tree": ', b'"tensors": [], "tree": ', 1),
}


@pytest.mark.parametrize("edit", sorted(EDITS))
def test_every_check_gives_the_general_parsers_answer(written: bytes, edit: str) -> None:
    text = EDITS[edit](written)
    assert text != written
    same_outcome(text)


def test_the_checks_refuse_what_they_must(written: bytes) -> None:
    # A few of the edits above, refused (not merely the same on both paths).
    for edit in ("a name twice", "two records on the same bytes", "an unknown dtype",
                 "a CRC of 33 bits", "an offset inside the header", "65 dimensions",
                 "a shape past the element bound", "a dimension past the element bound",
                 "a length that is not shape x itemsize", "a key twice"):
        outcome = parsed(EDITS[edit](written))
        assert isinstance(outcome, tuple) and outcome[0] == "refused", edit
    for edit in ("a space after a comma", "64 dimensions", "keys in another order"):
        assert isinstance(parsed(EDITS[edit](written)), mf.Manifest), edit


def test_without_the_extension_every_manifest_is_parsed_the_general_way(
        written: bytes, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(record_scan, "_format", None)
    assert record_scan.Scan.of(written) is None
    assert parsed(written) == general(written)


_ALPHABET = b'0123456789",:{}[] \n\\-e.x'


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_byte_edits_of_the_records_give_the_general_parsers_answer(
        written: bytes, data: st.DataObject) -> None:
    start = written.index(b' "tensors": [')
    stop = written.index(b"\n ],", start) + 4
    text = bytearray(written)
    for _ in range(data.draw(st.integers(1, 3), label="edits")):
        at = data.draw(st.integers(start, min(stop, len(text)) - 1), label="at")
        op = data.draw(st.sampled_from(["replace", "insert", "delete"]), label="op")
        byte = data.draw(st.sampled_from(list(_ALPHABET)), label="byte")
        if op == "replace":
            text[at] = byte
        elif op == "insert":
            text.insert(at, byte)
        else:
            del text[at]
    same_outcome(bytes(text))
