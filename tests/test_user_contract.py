"""What a user relies on without reading the code (issue 33, "the user's contract"):

- a URL given where a checkpoint path goes is refused, before anything is
  written, with an error that says how to reach an object store (item 14);
- a newer checkpoint that cannot be used is never passed over silently by
  Checkpointer.latest()/load_latest(): a warning names it, `skipped` records it,
  and strict=True raises (item 15);
- Checkpointer.save() of a step that exists is refused unless overwrite=True
  (item 16).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import pytest
import torch

import fastpersist
from fastpersist import (
    Checkpointer,
    CheckpointExistsError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    UnsupportedPathError,
)
from fastpersist.tensors.committed import read_manifest

# s3://BUCKET/PREFIX (lower case) is saved to the store (tests/test_store_save.py).
URLS = ["gs://bucket/x", "https://example.com/ckpt", "file:///tmp/x", "S3://Bucket/x"]


def state(step: int) -> dict[str, Any]:
    return {"step": step, "w": torch.full((4096,), float(step)), "b": torch.arange(step + 3)}


def assert_nothing_written(cwd: Path) -> None:
    assert sorted(p.name for p in cwd.iterdir()) == [], "a URL made local files"


# -- item 14: URLs are not paths -------------------------------------------------------------


@pytest.mark.parametrize("url", URLS)
def test_save_and_async_save_refuse_a_url(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                          url: str) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UnsupportedPathError, match="is a URL") as info:
        fastpersist.save(state(1), url)
    assert isinstance(info.value, ValueError)
    with pytest.raises(UnsupportedPathError, match="is a URL"):
        fastpersist.async_save(state(1), url)
    with pytest.raises(UnsupportedPathError, match="is a URL"):
        fastpersist.save(state(1), url, compression="zstd")
    assert_nothing_written(tmp_path)


def test_the_s3_error_says_how_to_use_the_tier(tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UnsupportedPathError) as info:
        fastpersist.save(state(1), "S3://bucket/run/step-1")
    message = str(info.value)
    assert "tier='S3://bucket/run/step-1'" in message and "fastpersistd --tier" in message
    # Through fastpersistd or a distributed job, an s3:// save says what to do instead.
    with pytest.raises(UnsupportedPathError, match=r"tier=.*fastpersistd --tier"):
        fastpersist.save(state(1), "s3://bucket/run/step-1", daemon="unix:///x.sock")
    with pytest.raises(UnsupportedPathError, match="pass the path itself"):
        fastpersist.save(state(1), "file:///tmp/x")


@pytest.mark.parametrize("url", URLS)
def test_checkpointer_refuses_a_url_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                         url: str) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UnsupportedPathError, match="a Checkpointer's root"):
        Checkpointer(url, daemon="")
    assert_nothing_written(tmp_path)


def test_a_url_is_refused_by_every_saver(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The check sits where every saver makes its path absolute, so a saver
    reached without the API (the Hugging Face adapter uses one) refuses too."""
    from support import in_process_saver

    monkeypatch.chdir(tmp_path)
    saver = in_process_saver()
    try:
        with pytest.raises(UnsupportedPathError):
            saver.save(state(1), "s3://bucket/x")
    finally:
        saver.close()
    assert_nothing_written(tmp_path)


def test_a_relative_path_with_a_colon_is_still_a_path(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    fastpersist.save(state(2), "run:a/step-2")  # no "://": a plain (odd) name
    assert torch.equal(fastpersist.load(tmp_path / "run:a" / "step-2")["w"], state(2)["w"])


def test_load_of_a_foreign_url_is_refused_by_name(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UnsupportedPathError, match="gs://"):
        fastpersist.load("gs://bucket/x")


# -- item 16: a step is saved once ----------------------------------------------------------


def test_saving_an_existing_step_is_refused(tmp_path: Path) -> None:
    with Checkpointer(tmp_path, daemon="") as ckpt:
        ckpt.save(3, state(3)).result()
        before = (ckpt.path_for(3) / "manifest.json").read_bytes()
        with pytest.raises(CheckpointExistsError, match="step 3 is already saved") as info:
            ckpt.save(3, state(30))
        assert "overwrite=True" in str(info.value)
        assert isinstance(info.value, FileExistsError)
    assert (tmp_path / "step-00000003" / "manifest.json").read_bytes() == before
    assert torch.equal(fastpersist.load(tmp_path / "step-00000003")["w"], state(3)["w"])


def test_overwrite_true_replaces_the_step(tmp_path: Path) -> None:
    with Checkpointer(tmp_path, daemon="") as ckpt:
        ckpt.save(3, state(3)).result()
        ckpt.save(3, state(30), overwrite=True).result()
        assert ckpt.steps() == [3]
    assert torch.equal(fastpersist.load(tmp_path / "step-00000003")["w"], state(30)["w"])


def test_a_step_in_flight_is_refused_too(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The first save of step 5 is not committed yet (its writer is held back):
    the directory does not exist, but the second save must still be refused."""
    import threading

    from fastpersist.saving.persist import CheckpointWriter

    release = threading.Event()
    real = CheckpointWriter.commit

    def held(self: CheckpointWriter) -> None:
        release.wait(30)
        real(self)

    monkeypatch.setattr(CheckpointWriter, "commit", held)
    ckpt = Checkpointer(tmp_path, daemon="", max_in_flight=2)
    try:
        first = ckpt.save(5, state(5))
        with pytest.raises(CheckpointExistsError, match="in flight"):
            ckpt.save(5, state(50))
    finally:
        release.set()
    first.result()
    ckpt.close()
    assert torch.equal(fastpersist.load(tmp_path / "step-00000005")["w"], state(5)["w"])


def test_a_hand_named_step_counts_as_saved(tmp_path: Path) -> None:
    fastpersist.save(state(7), tmp_path / "step-7")
    with Checkpointer(tmp_path, daemon="") as ckpt, pytest.raises(CheckpointExistsError):
        ckpt.save(7, state(7))


# -- item 15: nothing passed over silently ---------------------------------------------------


def make_run(root: Path, steps: list[int]) -> None:
    with Checkpointer(root, daemon="") as ckpt:
        for s in steps:
            ckpt.save(s, state(s)).result()


def truncate_a_data_file(ckpt: Path) -> str:
    f = read_manifest(ckpt).files[0].name
    with open(ckpt / f, "r+b") as fh:
        fh.truncate(os.path.getsize(ckpt / f) - 4096)
    return f


def flip_a_tensor_byte(ckpt: Path) -> None:
    m = read_manifest(ckpt)
    rec = max(m.tensors, key=lambda t: t.length)
    with open(ckpt / rec.file, "r+b") as fh:
        fh.seek(rec.offset + 100)
        b = fh.read(1)
        fh.seek(rec.offset + 100)
        fh.write(bytes([b[0] ^ 0xFF]))


@pytest.mark.parametrize("damage", ["truncated", "manifest", "no-manifest", "missing-file"])
def test_latest_warns_about_a_damaged_newest_checkpoint(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, damage: str) -> None:
    make_run(tmp_path, [1, 2, 3])
    newest = tmp_path / "step-00000003"
    if damage == "truncated":
        name = truncate_a_data_file(newest)
        why = f"data file {name} is truncated"
    elif damage == "manifest":
        (newest / "manifest.json").write_text("{not json")
        why = "manifest"
    elif damage == "no-manifest":
        (newest / "manifest.json").unlink()
        why = "has no manifest.json"
    else:
        name = read_manifest(newest).files[0].name
        (newest / name).unlink()
        why = f"data file {name} is missing"
    ckpt = Checkpointer(tmp_path, daemon="")
    with caplog.at_level(logging.WARNING, logger="fastpersist.checkpointer"):
        assert ckpt.latest() == tmp_path / "step-00000002"
    assert [s.path for s in ckpt.skipped] == [newest]
    assert why in ckpt.skipped[0].reason
    warned = [r.getMessage() for r in caplog.records if r.name == "fastpersist.checkpointer"]
    assert len(warned) == 1 and str(newest) in warned[0] and why in warned[0]
    assert ckpt.load_latest()["step"] == 2
    assert ckpt.steps() == [1, 2]

    strict = Checkpointer(tmp_path, daemon="", strict=True)
    with pytest.raises(CorruptCheckpointError, match="strict=True") as info:
        strict.latest()
    assert str(newest) in str(info.value)
    with pytest.raises(CorruptCheckpointError):
        strict.load_latest()


def test_load_latest_falls_back_past_a_checksum_mismatch_with_a_warning(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    make_run(tmp_path, [1, 2])
    flip_a_tensor_byte(tmp_path / "step-00000002")
    ckpt = Checkpointer(tmp_path, daemon="")
    # Sizes are right: latest() cannot tell without reading every byte.
    assert ckpt.latest() == tmp_path / "step-00000002" and ckpt.skipped == []
    with caplog.at_level(logging.WARNING, logger="fastpersist.checkpointer"):
        loaded = ckpt.load_latest()
    assert loaded["step"] == 1
    assert [s.path for s in ckpt.skipped] == [tmp_path / "step-00000002"]
    assert "crc32c" in ckpt.skipped[0].reason.lower() and "is corrupt" in ckpt.skipped[0].reason
    assert any("step-00000002" in r.getMessage() for r in caplog.records)

    strict = Checkpointer(tmp_path, daemon="", strict=True)
    with pytest.raises(CorruptCheckpointError, match="step-00000002"):
        strict.load_latest()


def test_when_every_checkpoint_is_damaged_the_error_names_them(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    make_run(tmp_path, [1, 2])
    for s in (1, 2):
        truncate_a_data_file(tmp_path / f"step-{s:08d}")
    ckpt = Checkpointer(tmp_path, daemon="")
    with caplog.at_level(logging.WARNING, logger="fastpersist.checkpointer"):
        assert ckpt.latest() is None  # a loop would start afresh, but not silently:
    assert [s.path.name for s in ckpt.skipped] == ["step-00000002", "step-00000001"]  # type: ignore[union-attr]
    assert len([r for r in caplog.records if r.name == "fastpersist.checkpointer"]) == 2
    with pytest.raises(CheckpointNotFoundError, match="passed over") as info:
        ckpt.load_latest()
    assert "step-00000001" in str(info.value) and "step-00000002" in str(info.value)


def test_a_whole_newest_checkpoint_skips_nothing(tmp_path: Path,
                                                 caplog: pytest.LogCaptureFixture) -> None:
    make_run(tmp_path, [1, 2])
    truncate_a_data_file(tmp_path / "step-00000001")  # older than the answer: not looked at
    ckpt = Checkpointer(tmp_path, daemon="", strict=True)
    with caplog.at_level(logging.WARNING, logger="fastpersist.checkpointer"):
        assert ckpt.latest() == tmp_path / "step-00000002"
        assert ckpt.load_latest()["step"] == 2
    assert ckpt.skipped == [] and not caplog.records


def test_a_rolled_back_pointer_is_not_a_skip(tmp_path: Path,
                                             caplog: pytest.LogCaptureFixture) -> None:
    """An operator pointed `latest` back at step 1: step 2 (committed before
    the pointer was written) is passed over by design, without a warning."""
    make_run(tmp_path, [1, 2])
    (tmp_path / "latest").write_text("step-00000001\n")
    ckpt = Checkpointer(tmp_path, daemon="")
    with caplog.at_level(logging.WARNING, logger="fastpersist.checkpointer"):
        assert ckpt.latest() == tmp_path / "step-00000001"
    assert ckpt.skipped == [] and not caplog.records
