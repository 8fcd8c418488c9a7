"""Distributed checkpoints in the object-store tier: saved by 4 gloo ranks on
shared storage, uploaded (compressed on the way, or raw), and loaded from
s3:// by 2 ranks resharding with like=, reading only the chunks (and of
compressed chunks, the frames) each rank needs. Against a real S3 server
(moto, a subprocess)."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import torch
from dist_support import check_loaded, full_tensors, ok, run_job

import fastpersist
from fastpersist.distributed import restore
from fastpersist.storage import dirs
from fastpersist.tensors import tier_read
from fastpersist.tier.client import S3
from fastpersist.tier.remote import entries, read_manifest
from fastpersist.tier.upload import upload_checkpoint
from fastpersist.tier.url import TierURL


def _upload(path: Path, url: TierURL, compression: str) -> None:
    fd = os.open(path, dirs.DIR_FLAGS)
    try:
        upload_checkpoint(S3(), fd, str(path), url, compression)
    finally:
        os.close(fd)


def test_a_distributed_checkpoint_loads_from_the_store_resharded(
        s3: Any, tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    ok(run_job(tmp_path, "save", ["n0", "n0", "n1", "n1"],
               {"path": str(ckpt), "dp": 2, "tp": 2}))
    base = TierURL.parse(s3.url)
    _upload(ckpt, base.child("zstd"), "zstd")
    _upload(ckpt, base.child("raw"), "none")
    zstd = str(base.child("zstd"))
    assert any(t.frames for t in read_manifest(S3(), base.child("zstd"))[0].tensors)

    # Two ranks with the opposite sharding, from the store (compressed chunks).
    for r in run_job(tmp_path, "load", ["n0", "n0"], {"path": zstd, "like": True}):
        check_loaded(r, tp=True)
        assert r["tensors"]["tp.rows"]["dtensor"] and r["tensors"]["tp.rows"]["local_equal"]
        assert r["tensors"]["tp.rows"]["local_shape"] == [64, 24]
        assert r["tensors"]["tp.cols"]["local_equal"]
    # One process, everything whole, raw and compressed.
    for url in (zstd, str(base.child("raw"))):
        loaded = fastpersist.load(url)
        assert torch.equal(loaded["model"]["big"], full_tensors()["big"])

    # A box of "embed" reads only the chunks that hold it: count the bytes GET.
    for name in ("raw", "zstd"):
        client, url = S3(), base.child(name)
        got: list[int] = []

        def count(params: Any, got: list[int] = got, **_: Any) -> None:
            m = re.fullmatch(r"bytes=(\d+)-(\d+)", params.get("Range") or "")
            if m and m[1] != "0":  # not a file's header
                got.append(int(m[2]) - int(m[1]) + 1)

        client.client.meta.events.register("before-parameter-build.s3.GetObject", count)
        m = read_manifest(client, url)[0]
        assert m.globals is not None
        index = next(i for i, g in enumerate(m.globals) if g.name == "model.embed")
        box = ((10, 0), (3, 256))
        t = restore.read_boxes(tier_read.TierSource(client, url), m, {index: box},
                               verify=True)[index]
        assert torch.equal(t, full_tensors()["embed"][10:13])
        # embed is 1 MB in chunks of 64 KiB (FASTPERSIST_PIECE_BYTES), ~4.8 MB in all.
        assert 0 < sum(got) <= 192 << 10, (name, got)


def test_a_distributed_checkpointer_uploads_from_rank_0(s3: Any, tmp_path: Path) -> None:
    """Checkpointer(tier=..., process_group=...) without a daemon: rank 0 uploads
    each committed checkpoint and local retention keeps it until it is in the
    store; 2 ranks then load the last one from the store, resharded."""
    root = tmp_path / "ckpts"
    tier = TierURL.parse(s3.url).child("run")
    reports = run_job(tmp_path, "tier_checkpointer", ["n0", "n0", "n1", "n1"],
                      {"path": str(root), "dp": 2, "tp": 2, "tier": str(tier)})
    ok(reports)
    assert [r["uploaded"] for r in reports] == [3, 0, 0, 0]  # rank 0 uploads
    assert all(r["pending"] == [] and r["last_error"] is None for r in reports)
    # keep_last=1, applied by rank 0 as each upload finished (the other ranks
    # looked before rank 0's close() had waited for the uploads)
    assert reports[0]["steps"] == [2]
    assert sorted(p.name for p in root.iterdir() if p.name.startswith("step-")) == [
        "step-00000002"]
    names = sorted(e.name for e in entries(S3(), tier) if e.committed)
    assert names == ["step-00000000", "step-00000001", "step-00000002"]
    # compressed on the way (the uploader's default)
    assert any(t.frames for t in read_manifest(S3(), tier.child("step-00000002"))[0].tensors)
    for r in run_job(tmp_path, "load", ["n0", "n0"],
                     {"path": str(tier.child("step-00000002")), "like": True}):
        check_loaded(r, tp=True)
