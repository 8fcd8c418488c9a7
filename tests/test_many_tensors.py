"""States of many small tensors (issue 14): what the per-tensor fast paths must keep.

Loaded tensors each have a storage of their own (carved from shared arenas, but
never one storage for many, which a later save would store as views of one
span); the manifest keeps a line per record; headers that fastpersist would not
write itself still go through the full comparison; the collector is paused
only while a save or load runs.
"""

from __future__ import annotations

import gc
import json
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from test_roundtrip import assert_same

import fastpersist
from fastpersist import gcpause
from fastpersist.tensors import plan


def small_state(n: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(14)
    model: dict[str, torch.Tensor] = {}
    for i in range(n):
        kind = i % 5
        if kind == 0:
            model[f"l{i}.w"] = torch.randn(8, 3 + i % 7, generator=g).to(torch.bfloat16)
        elif kind == 1:
            model[f"l{i}.b"] = torch.randn(1 + i % 300, generator=g)
        elif kind == 2:
            model[f"l{i}.step"] = torch.tensor(float(i))  # 0-d
        elif kind == 3:
            model[f"l{i}.mask"] = torch.rand(17, generator=g) > 0.5
        else:
            model[f"l{i}.empty"] = torch.empty(0, 3)
    return {"model": model, "step": n, "big": torch.randn(300_000, generator=g)}


def test_many_small_tensors_round_trip(tmp_path: Path, engine_name: str) -> None:
    state = small_state(3000)
    fastpersist.save(state, tmp_path / "c")
    assert_same(fastpersist.load(tmp_path / "c"), state)


def test_each_loaded_tensor_has_its_own_storage(tmp_path: Path) -> None:
    fastpersist.save(small_state(2000), tmp_path / "c")
    loaded = fastpersist.load(tmp_path / "c")
    tensors = [t for t in loaded["model"].values() if t.numel()]
    pointers = {t.untyped_storage().data_ptr() for t in tensors}
    assert len(pointers) == len(tensors)
    for t in tensors:
        assert t.untyped_storage().nbytes() == t.nbytes
        # At its place in the file (a multiple of its element size), as
        # safetensors.s own mmap loads place it.
        assert t.data_ptr() % t.element_size() == 0
    loaded["model"]["l1.b"].add_(1)  # writable, and no other tensor changes
    # Saved again, every tensor is its own record: no views of a shared span.
    fastpersist.save(loaded, tmp_path / "again")
    doc = json.loads((tmp_path / "again" / "manifest.json").read_bytes())
    assert not any(r["name"].endswith(".__storage__") for r in doc["tensors"])
    assert len(doc["tensors"]) == len(loaded["model"]) + 1


def test_a_tensor_named_like_the_header_metadata(tmp_path: Path) -> None:
    """The header writer's own fallback (a dict) and the reader's full comparison."""
    state = {"__metadata__": torch.arange(3.0), "x": torch.ones(2)}
    fastpersist.save(state, tmp_path / "c")
    assert_same(fastpersist.load(tmp_path / "c"), state)


def test_memory_of_is_the_tensors_bytes() -> None:
    t = torch.arange(10, dtype=torch.int16)
    view = plan.memory_of(t)
    assert view.nbytes == 20 and not view.readonly and bytes(view) == t.numpy().tobytes()
    view[0] = 7
    assert t[0].item() == 7
    assert plan.memory_of(torch.empty(0)).nbytes == 0


def test_the_collector_resumes_after_nested_and_threaded_pauses() -> None:
    assert gc.isenabled()
    inside = threading.Event()
    release = threading.Event()

    def other() -> None:
        with gcpause.paused():
            inside.set()
            release.wait()

    thread = threading.Thread(target=other)
    with gcpause.paused():
        thread.start()
        inside.wait()
        with gcpause.paused():
            assert not gc.isenabled()
    assert not gc.isenabled()  # the other thread is still inside
    release.set()
    thread.join()
    assert gc.isenabled()


def test_a_disabled_collector_stays_disabled(tmp_path: Path) -> None:
    gc.disable()
    try:
        fastpersist.save({"x": torch.ones(3)}, tmp_path / "c")
        fastpersist.load(tmp_path / "c")
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_save_and_load_leave_the_collector_enabled(tmp_path: Path) -> None:
    fastpersist.save({"x": torch.ones(3)}, tmp_path / "c")
    fastpersist.load(tmp_path / "c")
    with pytest.raises(fastpersist.CheckpointNotFoundError):
        fastpersist.load(tmp_path / "missing")
    assert gc.isenabled()


def test_errors_of_several_files_come_in_file_order(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Loads of several files read one file while checking the next: a corrupt
    tensor in the first file is still the error, not a bad header in the last."""
    monkeypatch.setenv("FASTPERSIST_FILE_BYTES", str(1 << 20))
    state = {f"w{i}": torch.randn(1 << 18) for i in range(3)}  # a file each
    fastpersist.save(state, tmp_path / "c")
    doc = json.loads((tmp_path / "c" / "manifest.json").read_bytes())
    first, last = doc["files"][0], doc["files"][-1]
    record = next(r for r in doc["tensors"] if r["file"] == first["name"])
    with open(tmp_path / "c" / first["name"], "r+b") as f:  # a flipped byte in a tensor
        f.seek(record["offset"] + 5)
        byte = f.read(1)
        f.seek(record["offset"] + 5)
        f.write(bytes([byte[0] ^ 0xFF]))
    with open(tmp_path / "c" / last["name"], "r+b") as f:  # and in the last header
        f.seek(20)
        f.write(b"#")
    with pytest.raises(fastpersist.ChecksumMismatchError) as info:
        fastpersist.load(tmp_path / "c")
    assert info.value.tensor == record["name"]
    fastpersist.save(state, tmp_path / "d")
    last = json.loads((tmp_path / "d" / "manifest.json").read_bytes())["files"][-1]
    with open(tmp_path / "d" / last["name"], "r+b") as f:
        f.truncate(last["size"] - 1)
    with pytest.raises(fastpersist.TruncatedFileError):
        fastpersist.load(tmp_path / "d")


def test_a_load_of_several_files_reports_progress_file_by_file(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FASTPERSIST_FILE_BYTES", str(1 << 20))
    state = {f"w{i}": torch.randn(1 << 18) for i in range(4)}  # a file each
    fastpersist.save(state, tmp_path / "c")
    seen: list[int] = []
    loaded = fastpersist.load(tmp_path / "c", progress=seen.append)
    assert_same(loaded, state)
    assert seen == [1 << 20] * 4


def test_verify_of_several_files_reports_problems_in_file_order(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """verify reads two files at once, and still lists problems file by file."""
    from fastpersist.engine import get_engine
    from fastpersist.tensors import verifying

    monkeypatch.setenv("FASTPERSIST_FILE_BYTES", str(1 << 20))
    state = {f"w{i}": torch.randn(1 << 18) for i in range(4)}
    fastpersist.save(state, tmp_path / "c")
    doc = json.loads((tmp_path / "c" / "manifest.json").read_bytes())
    files = doc["files"]
    first = next(r for r in doc["tensors"] if r["file"] == files[0]["name"])
    with open(tmp_path / "c" / files[0]["name"], "r+b") as f:  # a flipped byte
        f.seek(first["offset"] + 7)
        byte = f.read(1)
        f.seek(first["offset"] + 7)
        f.write(bytes([byte[0] ^ 0x01]))
    with open(tmp_path / "c" / files[2]["name"], "r+b") as f:  # a short file
        f.truncate(files[2]["size"] - 1)
    seen: list[int] = []
    report = verifying.verify(tmp_path / "c", get_engine(), progress=seen.append)
    assert len(report.problems) == 2, report.problems
    assert first["name"] in report.problems[0]
    assert files[2]["name"] in report.problems[1]
    assert report.files == 4 and report.tensors == 3 and seen == [1 << 20] * 3


def test_an_interrupted_verify_reads_no_further(tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """^C in `fpctl verify` (here: the progress callback raising) cancels the
    batches not started; only those already in flight finish (without the
    cancel, all 8 would be read)."""
    from fastpersist.engine import get_engine
    from fastpersist.tensors import checkpoint, verifying

    monkeypatch.setenv("FASTPERSIST_FILE_BYTES", str(1 << 20))
    fastpersist.save({f"w{i}": torch.randn(1 << 18) for i in range(8)}, tmp_path / "c")
    calls = []
    real = verifying._verify_batch

    def counted(*args: Any, **kwargs: Any) -> list[str]:
        calls.append(1)
        time.sleep(1.0)  # a slow disk: the interrupt comes while batches wait
        return real(*args, **kwargs)

    def interrupt(_: int) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(verifying, "_verify_batch", counted)
    with pytest.raises(KeyboardInterrupt):
        verifying.verify(tmp_path / "c", get_engine(), progress=interrupt)
    # The first batch, the one beside it, and one each reader may have taken
    # as they finished.
    assert 1 <= len(calls) <= 2 * checkpoint.FILES_IN_FLIGHT
