"""What fpctl ls and gc see below an s3:// URL (fastpersist/tier/listing.py):
checkpoints at any depth (the daemon uploads ROOT/run1/step-5 to
PREFIX/run1/step-5), runs, incomplete uploads, and keys another tool put
there. gc removes only incomplete uploads, never a byte of a checkpoint.
Against a real S3 server (moto, a subprocess)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from tier_support import keys

import fastpersist
from fastpersist.cli import main as fpctl
from fastpersist.storage import dirs
from fastpersist.tier.client import S3
from fastpersist.tier.upload import upload_checkpoint
from fastpersist.tier.url import TierURL


def _uploaded(s3: Any, tmp_path: Path, rel: str, seed: int = 0) -> dict[str, int]:
    """Save a checkpoint locally and upload it to TIER/rel; its objects' keys."""
    local = tmp_path / "local" / rel
    fastpersist.save({"w": torch.full((1000,), float(seed)), "step": seed}, local)
    fd = os.open(local, dirs.DIR_FLAGS)
    try:
        upload_checkpoint(S3(), fd, str(local), TierURL.parse(s3.url).child(rel))
    finally:
        os.close(fd)
    return keys(s3.client, s3.bucket, f"ckpts/{rel}/")


def _put(s3: Any, key: str, body: bytes = b"partial") -> None:
    s3.client.put_object(Bucket=s3.bucket, Key=key, Body=body)


def _rows(capsys: pytest.CaptureFixture[str], *args: str) -> dict[str, dict[str, Any]]:
    capsys.readouterr()
    assert fpctl(["ls", *args, "--json"]) == 0
    return {r["name"]: r for r in json.loads(capsys.readouterr().out)}


def test_gc_never_deletes_checkpoints_in_run_directories(
        s3: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 33 item 1: a run directory PREFIX/run1 of checkpoints was listed
    as "incomplete" (no manifest directly in it) and gc wiped it."""
    kept = {**_uploaded(s3, tmp_path, "run1/step-00000005", 5),
            **_uploaded(s3, tmp_path, "run1/step-00000006", 6),
            **_uploaded(s3, tmp_path, "deep/a/b/step-00000001", 1),
            **_uploaded(s3, tmp_path, "step-00000002", 2)}
    _put(s3, "ckpts/run1/step-00000007/data-00000.safetensors")  # died before its manifest
    _put(s3, "ckpts/run2/step-00000001/data-00000.safetensors")  # a run with nothing committed
    _put(s3, "ckpts/run1/notes.txt")  # loose in a run directory: not ours to judge
    capsys.readouterr()
    assert fpctl(["gc", s3.url, "--older-than", "0", "--dry-run", "--json"]) == 0
    assert sorted(a["path"] for a in json.loads(capsys.readouterr().out)) == [
        f"{s3.url}/run1/step-00000007", f"{s3.url}/run2/step-00000001"]
    rows = _rows(capsys, s3.url)
    assert {n: r["state"].split(" ")[0] for n, r in rows.items()} == {
        "deep": "run", "deep/a": "run", "deep/a/b": "run",
        "deep/a/b/step-00000001": "committed", "run1": "run",
        "run1/step-00000005": "committed", "run1/step-00000006": "committed",
        "run1/step-00000007": "incomplete", "run2/step-00000001": "incomplete",
        "step-00000002": "committed"}
    assert rows["run1"]["state"] == "run (2 checkpoint(s) below)"
    assert rows["run1/step-00000005"]["path"] == f"{s3.url}/run1/step-00000005"
    assert rows["run1/step-00000005"]["tensors"] == 1
    # Listing one level down: the run's own view.
    assert sorted(_rows(capsys, f"{s3.url}/run1")) == [
        "step-00000005", "step-00000006", "step-00000007"]

    assert fpctl(["gc", s3.url, "--older-than", "0"]) == 0
    assert sorted(capsys.readouterr().out.splitlines()) == [
        f"removed incomplete {s3.url}/run1/step-00000007",
        f"removed incomplete {s3.url}/run2/step-00000001"]
    left = keys(s3.client, s3.bucket)
    assert left == {**kept, "ckpts/run1/notes.txt": 7}
    loaded = fastpersist.load(f"{s3.url}/run1/step-00000005")
    assert loaded["step"] == 5


def test_incomplete_uploads_at_any_depth(s3: Any, tmp_path: Path) -> None:
    from fastpersist.tier.listing import CHECKPOINT, INCOMPLETE, RUN, listing

    _uploaded(s3, tmp_path, "run1/step-00000001", 1)
    _put(s3, "ckpts/run1/step-00000002/data-00000.safetensors")
    _put(s3, "ckpts/run1/step-00000002/sub/x")  # inside an incomplete one: part of it
    _put(s3, "ckpts/lone/step-1/x")
    _put(s3, "ckpts/lone/step-2/x")
    _put(s3, "ckpts/top.txt")  # directly at the listed URL: left alone
    found = listing(S3(), TierURL.parse(s3.url))
    kinds = {e.name: e.kind for e in found.entries}
    assert kinds == {"run1": RUN, "run1/step-00000001": CHECKPOINT,
                     "run1/step-00000002": INCOMPLETE, "lone/step-1": INCOMPLETE,
                     "lone/step-2": INCOMPLETE}
    partial = {e.name: e for e in found.entries}["run1/step-00000002"]
    assert sorted(partial.keys) == ["ckpts/run1/step-00000002/data-00000.safetensors",
                                    "ckpts/run1/step-00000002/sub/x"]
    assert found.odd == () and not found.is_checkpoint
    assert listing(S3(), TierURL.parse(s3.url).child("run1/step-00000001")).is_checkpoint


ODD = ["ckpts/back\\slash/data", "ckpts/run1//data", "ckpts/./x", "ckpts/run1/../y",
       "ckpts/folder/"]


def test_ls_and_gc_name_odd_keys_and_list_the_rest(
        s3: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 33 item 13: a key no fastpersist path can name (another tool's)
    made fpctl ls and gc crash with an uncaught ValueError."""
    kept = _uploaded(s3, tmp_path, "run1/step-00000001", 1)
    for key in ODD:
        _put(s3, key)
    _put(s3, "ckpts/step-00000009/data-00000.safetensors")
    capsys.readouterr()
    assert fpctl(["ls", s3.url]) == 0
    captured = capsys.readouterr()
    assert "run1/step-00000001" in captured.out and "committed" in captured.out
    assert "step-00000009" in captured.out and "incomplete" in captured.out
    for key in ODD:
        assert f"s3://{s3.bucket}/{key!r}: not a valid path below {s3.url}" in captured.err
    rows = _rows(capsys, s3.url)
    assert rows["back\\slash/data"]["state"].startswith("odd key")
    assert rows["run1/step-00000001"]["state"] == "committed"

    assert fpctl(["gc", s3.url, "--older-than", "0"]) == 0
    captured = capsys.readouterr()
    assert f"removed incomplete {s3.url}/step-00000009" in captured.out
    assert "not removing" in captured.err and "back\\\\slash" in captured.err
    assert keys(s3.client, s3.bucket) == {**kept, **{k: 7 for k in ODD}}
    capsys.readouterr()
    assert fpctl(["gc", s3.url, "--older-than", "0", "--json"]) == 0
    actions = json.loads(capsys.readouterr().out)
    assert {a["kind"] for a in actions} == {"odd-key"}
    assert sorted(a["path"] for a in actions) == sorted(f"s3://{s3.bucket}/{k}" for k in ODD)


def test_gc_leaves_an_upload_that_finished_since_it_was_listed(
        s3: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """gc deletes the keys it listed, after checking that no manifest
    appeared: an upload that completes meanwhile is not cut into."""
    from fastpersist.tier.listing import INCOMPLETE, listing
    from fastpersist.tier.retention import delete_incomplete

    client = S3()
    url = TierURL.parse(s3.url)
    _put(s3, "ckpts/run1/step-00000003/data-00000.safetensors")
    (entry,) = [e for e in listing(client, url).entries if e.kind == INCOMPLETE]
    full = _uploaded(s3, tmp_path, "run1/step-00000003", 3)  # the upload finishes
    with pytest.raises(Exception, match="holds a checkpoint now"):
        delete_incomplete(client, url, entry)
    assert keys(s3.client, s3.bucket) == full


def test_an_upload_whose_objects_were_removed_meanwhile_is_not_reported_uploaded(
        s3: Any, tmp_path: Path) -> None:
    """A gc with an --older-than shorter than an upload removes its data
    objects before the manifest goes up: the uploader finds them missing
    after writing the manifest, takes the manifest down again and fails (to
    be retried), instead of reporting a checkpoint whose bytes are gone."""
    from fastpersist.errors import TierError

    local = tmp_path / "step-00000001"
    fastpersist.save({"w": torch.ones(1000)}, local)
    client = S3()
    data_key = "ckpts/step-00000001/data-00000.safetensors"

    def gc_strikes(params: Any, **_: Any) -> None:
        if str(params.get("Key", "")).endswith("manifest.json"):
            s3.client.delete_object(Bucket=s3.bucket, Key=data_key)

    client.client.meta.events.register("before-parameter-build.s3.PutObject", gc_strikes)
    url = TierURL.parse(s3.url).child(local.name)
    fd = os.open(local, dirs.DIR_FLAGS)
    try:
        with pytest.raises(TierError, match=r"data-00000\.safetensors of .* vanished"):
            upload_checkpoint(client, fd, str(local), url)
        assert keys(s3.client, s3.bucket) == {}
        done = upload_checkpoint(S3(), fd, str(local), url)  # the retry
    finally:
        os.close(fd)
    assert not done.already
    assert fastpersist.load(str(url))["w"].sum() == 1000
