"""Manifest schema 3: a global may leave out "chunks", which the tensor records'
names then imply (`<global name>@<offsets>`, the names a distributed save
gives its pieces), so that a large job's coordinator need not list them.

Real manifests throughout: made in memory and round-tripped through their
bytes, rewritten from a simulated distributed checkpoint (hostile_support)
and from a real two-rank save, and damaged to check each refusal's message.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from hostile_support import (
    distinct,
    distributed_checkpoint,
    distributed_state,
    edit,
    grid,
    read_doc,
    record_index,
    same,
    write_doc,
)

import fastpersist
from fastpersist._version import __version__
from fastpersist.cli import main as fpctl
from fastpersist.errors import ManifestError
from fastpersist.format.manifest import (
    IMPLIED_CHUNKS_SCHEMA_VERSION,
    SCHEMA_VERSION,
    Chunk,
    FileRecord,
    GlobalTensor,
    Manifest,
    TensorRecord,
)
from fastpersist.tensors import state
from fastpersist.tensors.checkpoint import read_manifest

FILE = "data-r00000-000.safetensors"


def test_the_versions() -> None:
    assert SCHEMA_VERSION == IMPLIED_CHUNKS_SCHEMA_VERSION == 3


# --- the in-memory model round-trips byte for byte ----------------------------------------


def _records(*specs: tuple[str, str, tuple[int, ...]]) -> tuple[FileRecord, list[TensorRecord]]:
    """Raw records (name, dtype, shape) laid out one after another in one file."""
    itemsize = {"F32": 4, "I64": 8, "F16": 2}
    offset, out = 4096, []
    for n, (name, dtype, shape) in enumerate(specs):
        length = itemsize[dtype] * int(torch.Size(shape).numel())
        out.append(TensorRecord(name, FILE, offset, length, dtype, shape, 100 + n))
        offset += length
    return FileRecord(FILE, offset, 4096, 7, node="n0"), out


def _implied_manifest() -> Manifest:
    """A 2-D global cut into row pieces, a 0-dim one and one whose name holds
    an "@", all implied; one that lists its chunks; and a record that is in no
    global's chunks ('w@00,0' is not a chunk's name)."""
    f, records = _records(
        ("w@2,0", "F32", (2, 4)), ("step@", "I64", ()), ("w@0,0", "F32", (2, 4)),
        ("a@b@0,0", "F16", (1, 2)), ("x@0", "F32", (3,)), ("w@00,0", "F32", (1,)),
        ("w@4,0", "F32", (1, 4)))
    tree, leaves = state.encode({"w": torch.zeros(5, 4), "step": torch.tensor(1),
                                 "a@b": torch.zeros(1, 2, dtype=torch.float16),
                                 "x": torch.zeros(3)}, sharded=True)
    for e, leaf in enumerate(leaves):
        leaf.node["e"] = e
    return Manifest(
        files=(f,), tensors=tuple(records), tree=tree, fastpersist_version=__version__,
        created_unix=1_764_400_000.5, schema_version=3,
        globals=(
            # Chunks in the records' order, not the offsets'.
            GlobalTensor("w", "F32", (5, 4), (Chunk(0, (2, 0)), Chunk(2, (0, 0)),
                                              Chunk(6, (4, 0))), implied=True),
            GlobalTensor("step", "I64", (), (Chunk(1, ()),), implied=True),
            GlobalTensor("a@b", "F16", (1, 2), (Chunk(3, (0, 0)),), implied=True),
            GlobalTensor("x", "F32", (3,), (Chunk(4, (0,)),)),
        ))


def test_a_schema_3_manifest_round_trips_bytes_and_objects() -> None:
    m = _implied_manifest()
    data = m.to_json()
    lines = [json.loads(line.strip().rstrip(",")) for line in data.decode().splitlines()
             if line.startswith('  {"name":"') and '"dtype"' in line and '"file"' not in line]
    assert lines == [
        {"name": "w", "dtype": "F32", "shape": [5, 4]},
        {"name": "step", "dtype": "I64", "shape": []},
        {"name": "a@b", "dtype": "F16", "shape": [1, 2]},
        {"name": "x", "dtype": "F32", "shape": [3], "chunks": [{"tensor": 4, "offsets": [0]}]},
    ]
    back = Manifest.from_json(data, "m")
    assert back == m
    assert back.to_json() == data
    # The general parser (not the records' C scan) reads it the same.
    assert Manifest.from_json(json.dumps(json.loads(data)).encode(), "m") == m


def test_a_schema_2_manifest_with_listed_chunks_parses_as_before(tmp_path: Path) -> None:
    expected = distributed_state(tmp_path / "ckpt")
    doc = read_doc(tmp_path / "ckpt")
    m = read_manifest(tmp_path / "ckpt")
    assert m.schema_version == 2 and m.globals is not None
    assert [g.implied for g in m.globals] == [False] * len(doc["globals"])
    assert [[[c.tensor, list(c.offsets)] for c in g.chunks] for g in m.globals] == [
        [[c["tensor"], c["offsets"]] for c in g["chunks"]] for g in doc["globals"]]
    data = m.to_json()
    assert Manifest.from_json(data, "m").to_json() == data
    assert all(g["chunks"] for g in json.loads(data)["globals"])  # still listed
    assert same(fastpersist.load(tmp_path / "ckpt"), expected)


# --- loading a checkpoint whose manifest implies its chunks -------------------------------


def _imply(doc: dict[str, Any], keep: tuple[str, ...] = ()) -> None:
    """Rewrite a schema-2 manifest to schema 3, its globals' chunks implied
    (but those named in `keep`)."""
    doc["schema_version"] = 3
    for g in doc["globals"]:
        if g["name"] not in keep:
            del g["chunks"]


@pytest.mark.parametrize("compression", [None, "zstd"])
def test_a_simulated_distributed_checkpoint_loads_with_implied_chunks(
        tmp_path: Path, compression: str | None) -> None:
    ckpt = tmp_path / "ckpt"
    expected = distributed_checkpoint(ckpt, {
        "w": (distinct(6, 4, start=1), grid((6, 4), [[3], [2]])),
        "rows": (distinct(8, dtype=torch.int64, start=100), grid((8,), [[3, 5]])),
        "s": (torch.tensor(2.5, dtype=torch.float64), [((), ())]),
        "e": (torch.zeros(0, 3), [((0, 0), (0, 3))]),
        "a@b": (distinct(4, 2, start=500), grid((4, 2), [[1]])),
        "listed": (distinct(3, start=900), grid((3,), [[1]])),
    }, aliases={"w_tied": "w"}, values={"step": 3}, compression=compression)
    listed = read_manifest(ckpt)
    edit(ckpt, lambda d: _imply(d, keep=("listed",)))
    m = read_manifest(ckpt)
    assert m.schema_version == 3 and m.globals is not None and listed.globals is not None
    assert [g.implied for g in m.globals] == [True] * 5 + [False]
    # The same chunks as listed (in the records' order).
    assert [sorted(g.chunks) for g in m.globals] == [sorted(g.chunks) for g in listed.globals]
    assert same(fastpersist.load(ckpt), expected)
    assert fpctl(["verify", str(ckpt)]) == 0


def _loaded(ckpt: Path) -> Any:
    from dist_support import describe_here
    return describe_here(fastpersist.load(ckpt))


@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch without distributed")
def test_a_real_distributed_checkpoint_loads_with_implied_chunks(tmp_path: Path) -> None:
    from dist_support import check_loaded, ok, run_job

    # A distributed save writes schema 3, every global's chunks implied.
    ckpt = tmp_path / "shared" / "ckpt"
    ok(run_job(tmp_path, "save", ["n0", "n0"], {"path": str(ckpt)}))
    assert b'"chunks"' not in (ckpt / "manifest.json").read_bytes()
    m = read_manifest(ckpt)
    assert m.schema_version == 3 and m.globals is not None
    assert all(g.implied for g in m.globals)
    assert max(len(g.chunks) for g in m.globals) > 1  # cut over the two writers
    check_loaded(_loaded(ckpt), tp=False)
    # A job of two ranks restores its shards from it.
    for report in run_job(tmp_path, "load", ["n0", "n0"], {"path": str(ckpt)}):
        check_loaded(report, tp=False)


def test_a_partial_read_uses_the_implied_chunks(tmp_path: Path) -> None:
    from fastpersist.distributed import restore
    from fastpersist.tensors.source import LocalSource

    ckpt = tmp_path / "ckpt"
    full = distinct(9, 4, start=1)
    distributed_checkpoint(ckpt, {"w": (full, grid((9, 4), [[2, 5, 7]]))})
    edit(ckpt, _imply)
    m = read_manifest(ckpt)
    box = ((3, 1), (4, 2))
    (got,) = restore.read_boxes(LocalSource(ckpt), m, {0: box}, verify=True).values()
    assert torch.equal(got, full[3:7, 1:3])


# --- a daemon commits a job manifest of schema 3 ------------------------------------------


def test_the_daemon_accepts_a_job_manifest_with_implied_chunks(daemon: Any) -> None:
    from fastpersist.distributed.storage import ThroughDaemon
    from fastpersist.saving.files import StagedFiles
    from fastpersist.saving.snapshot import stage_file
    from fastpersist.tensors.plan import StoredTensor

    storage = ThroughDaemon(daemon.address)
    try:
        target = daemon.root / "ckpt"
        full = torch.arange(32, dtype=torch.float32).reshape(8, 4)
        job = storage.stage(target)
        records = []
        for rank, (name, part) in enumerate([("w@0,0", full[:3]), ("w@3,0", full[3:])]):
            part = part.clone()
            stored = [StoredTensor(name, "F32", tuple(part.shape), part, part.nbytes)]
            buffer = storage.pool.acquire(part.nbytes, 0, False)
            records += storage.write(target, job, rank,
                                     StagedFiles.copied([stage_file(stored, buffer, False)]),
                                     None)
        tree, leaves = state.encode({"w": full}, sharded=True)
        leaves[0].node["e"] = 0
        tensors = tuple(t for _, ts in records for t in ts)
        chunks = tuple(Chunk(i, (int(t.name[2]), 0)) for i, t in enumerate(tensors))
        m = Manifest(files=tuple(f for f, _ in records), tensors=tensors, tree=tree,
                     fastpersist_version=__version__, created_unix=time.time(),
                     schema_version=3,
                     globals=(GlobalTensor("w", "F32", (8, 4), chunks, implied=True),))
        assert b'"chunks"' not in m.to_json()
        storage.publish(job, m.to_json(), None)
        assert torch.equal(fastpersist.load(target)["w"], full)
    finally:
        storage.close()


# --- what is refused, and why --------------------------------------------------------------


@pytest.fixture
def rows(tmp_path: Path) -> Path:
    """Schema 3: `w` (6 x 4) implied from four records w@0,0 w@0,2 w@3,0 w@3,2;
    `v` (3,) lists its chunks."""
    ckpt = tmp_path / "ckpt"
    distributed_checkpoint(ckpt, {"w": (distinct(6, 4, start=1), grid((6, 4), [[3], [2]])),
                                  "v": (distinct(3, start=50), grid((3,), [[1]]))})
    edit(ckpt, lambda d: _imply(d, keep=("v",)))
    assert same(fastpersist.load(ckpt)["w"], distinct(6, 4, start=1))
    return ckpt


def _rename(ckpt: Path, old: str, new: str) -> None:
    def rename(doc: dict[str, Any]) -> None:
        doc["tensors"][record_index(doc, old)]["name"] = new
    edit(ckpt, rename)


def _refused(ckpt: Path, message: str) -> None:
    with pytest.raises(ManifestError, match=message):
        fastpersist.load(ckpt)
    with pytest.raises(ManifestError, match=message):
        Manifest.from_json((ckpt / "manifest.json").read_bytes(), "m")


W = r"globals\[0\] \('w'\)"


@pytest.mark.parametrize("name", ["w@03,2", "w@+3,2", "w@3, 2", "w@ 3,2", "w@3,2,",
                                  "w@3,,2", "w@3;2", "w@0x3,2", "w@\uff13,2", "w@3,2 ", "w@-3,2",
                                  "w@3.0,2", "w@3,2@", "w@3_0,2"])
def test_a_name_whose_offsets_are_not_canonical_is_no_chunk(rows: Path, name: str) -> None:
    _rename(rows, "w@3,2", name)
    _refused(rows, f"{W}: chunks hold 18 elements of 24")


@pytest.mark.parametrize("name, shown", [
    ("w@3", r"\[3\]"), ("w@3,2,0", r"\[3, 2, 0\]"), ("w@4,2", r"\[4, 2\]"),
    ("w@3,3", r"\[3, 3\]"), ("w@", r"\[\]"), ("w@" + "9" * 5000 + ",2", r"\['9999"),
])
def test_offsets_that_do_not_fit_are_refused(rows: Path, name: str, shown: str) -> None:
    _rename(rows, "w@3,2", name)
    _refused(rows, rf"{W}: chunk \d \('w@.*'\) at {shown}.* of shape \[3, 2\] "
             r"does not fit in \[6, 4\]")


def test_a_chunk_of_another_dtype_is_refused(rows: Path) -> None:
    edit(rows, lambda d: d["globals"][0].update(dtype="F16"))
    _refused(rows, rf"{W}: chunk \d \('w@[0-9],[0-9]'\) of dtype F32 does not fit a tensor "
             "of dtype F16")


def test_chunks_that_overlap_are_refused(rows: Path) -> None:
    # Unique names in canonical form never give two chunks the same offsets;
    # shifted ones overlap (and leave a gap of as many elements).
    _rename(rows, "w@3,2", "w@2,2")
    _refused(rows, rf"{W}: chunks overlap or leave a gap")


def test_a_record_in_a_listed_chunk_and_an_implied_one_is_refused(rows: Path) -> None:
    def share(doc: dict[str, Any]) -> None:
        doc["globals"][1]["chunks"][0]["tensor"] = record_index(doc, "w@0,0")
    edit(rows, share)
    _refused(rows, r"used by two chunks \(also globals\[0\] chunk \d\)")


def test_a_record_named_like_a_chunk_of_a_global_that_lists_them_is_not_implied(
        rows: Path) -> None:
    edit(rows, lambda d: d["globals"][1]["chunks"].pop())  # record v@1 is still there
    _refused(rows, r"globals\[1\] \('v'\): chunks hold 1 elements of 3")


def test_a_global_without_chunks_needs_schema_3(rows: Path) -> None:
    edit(rows, lambda d: d.update(schema_version=2))
    _refused(rows, rf"{W}: 'chunks' must be a list \(a global may leave it out only from "
             r"schema version 3; this manifest is 2\)")


def test_a_newer_schema_is_refused(rows: Path) -> None:
    edit(rows, lambda d: d.update(schema_version=4))
    _refused(rows, r"schema version 4 is newer than this fastpersist understands \(3\); "
             "upgrade fastpersist")


def test_an_implied_global_with_no_records_is_refused(rows: Path) -> None:
    edit(rows, lambda d: d["globals"][0].update(name="u"))
    _refused(rows, r"globals\[0\] \('u'\): chunks hold 0 elements of 24")


def test_a_listed_and_implied_pair_still_writes_back(rows: Path) -> None:
    data = (rows / "manifest.json").read_bytes()
    m = Manifest.from_json(data, "m")
    assert m.globals is not None and [g.implied for g in m.globals] == [True, False]
    doc = json.loads(m.to_json())
    assert "chunks" not in doc["globals"][0] and doc["globals"][1]["chunks"]
    write_doc(rows, doc)
    assert Manifest.from_json((rows / "manifest.json").read_bytes(), "m") == m
