"""Saving a state to an object store, five ways, on one moto server, in one run.

    python benchmarks/s3_save.py                       # 0.5 GiB state, 5 rounds
    python benchmarks/s3_save.py --size-gib 0.25 --rounds 1

Each round runs every contender once, in an order rotated by the round
(interleaved: a slow minute of the shared machine hits them all); the medians,
the spread (min-max) and each one's ratio to fastpersist.save("s3://...")
come from the same run. Each contender starts from the same state in memory
and ends when its checkpoint is in the store (for fastpersist: the manifest's
conditional put returned). The objects are deleted after each save (moto keeps
them in its memory).

1. fp_s3:        fastpersist.save(state, "s3://...") (saving/store_sink.py:
                 the files streamed from the tensors as multipart parts)
2. fp_local_tier: fastpersist.save to a local directory, then the tier's
                 upload of it (tier/upload.py, raw: every byte re-read and
                 checked against its CRC32C on the way)
3. fp_local_boto3: fastpersist.save locally, then boto3 upload_file of each
                 file (its transfer manager)
4. torch_boto3:  torch.save into a BytesIO, then boto3 upload_fileobj of it
5. s3tc_dcp:     torch.distributed.checkpoint.save with s3torchconnector's
                 S3StorageWriter (AWS's CRT client), if installed
                 (pip install 'fastpersist[bench]')

boto3 contenders use the tier's part size (FASTPERSIST_TIER_PART_BYTES) and
concurrency (FASTPERSIST_TIER_CONCURRENCY); s3torchconnector its own defaults
with the same thread count. moto is one Python process: the ceiling here is
moto's, and says nothing about S3.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from _state import build_state, make_spec
from _system import GIB, machine_facts
from tier import delete_prefix, start_moto, transfer_config

import fastpersist
from fastpersist.knobs import current as current_knobs
from fastpersist.saving import registry
from fastpersist.storage import dirs
from fastpersist.tier.client import S3
from fastpersist.tier.upload import upload_checkpoint
from fastpersist.tier.url import TierURL

BUCKET = "s3save"


class Contenders:
    def __init__(self, state: dict[str, Any], s3: S3, endpoint: str, local: Path) -> None:
        self.state, self.s3, self.endpoint, self.local = state, s3, endpoint, local
        self.concurrency = current_knobs().tier_concurrency
        self.writer_fs: Any = None

    def fp_s3(self, prefix: str) -> None:
        fastpersist.save(self.state, f"s3://{BUCKET}/{prefix}")

    def _local(self) -> Path:
        target = self.local / "ckpt"
        fastpersist.save(self.state, target)
        return target

    def fp_local_tier(self, prefix: str) -> None:
        ckpt = self._local()
        fd = os.open(ckpt, dirs.DIR_FLAGS)
        try:
            upload_checkpoint(self.s3, fd, str(ckpt), TierURL(BUCKET, prefix), None)
        finally:
            os.close(fd)

    def fp_local_boto3(self, prefix: str) -> None:
        from boto3.s3.transfer import create_transfer_manager

        ckpt = self._local()
        with create_transfer_manager(self.s3.client, transfer_config(self.concurrency)) as tm:
            futures = [tm.upload(str(f), BUCKET, f"{prefix}/{f.name}")
                       for f in sorted(ckpt.iterdir())]
            for f in futures:
                f.result()

    def torch_boto3(self, prefix: str) -> None:
        buf = io.BytesIO()
        torch.save(self.state, buf)
        buf.seek(0)
        self.s3.client.upload_fileobj(buf, BUCKET, f"{prefix}/model.pt",
                                      Config=transfer_config(self.concurrency))

    def s3tc_dcp(self, prefix: str) -> None:
        import torch.distributed.checkpoint as dcp
        from s3torchconnector import S3ClientConfig
        from s3torchconnector._s3client import S3Client
        from s3torchconnector.dcp import S3StorageWriter
        from s3torchconnector.dcp.s3_file_system import S3FileSystem

        writer = S3StorageWriter("us-east-1", f"s3://{BUCKET}/{prefix}",
                                 thread_count=self.concurrency)
        if self.writer_fs is None:  # its client made once, as a trainer would
            self.writer_fs = S3FileSystem("us-east-1", s3_client=S3Client(
                "us-east-1", endpoint=self.endpoint,
                s3client_config=S3ClientConfig(force_path_style=True)))
        writer.fs = self.writer_fs  # the writer has no endpoint argument of its own
        dcp.save(self.state, storage_writer=writer)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--size-gib", type=float, default=0.5)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--port", type=int, default=5391)
    p.add_argument("--workdir", type=Path, default=None, help="local directory (disk)")
    p.add_argument("--out", type=Path, default=None, help="write the raw result (JSON) here")
    args = p.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="s3save-", dir=args.workdir))
    moto = start_moto(args.port, workdir / "moto.log")
    endpoint = f"http://127.0.0.1:{args.port}"
    os.environ.update({"AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": "bench",
                       "AWS_SECRET_ACCESS_KEY": "bench", "AWS_DEFAULT_REGION": "us-east-1"})
    try:
        return run(args, workdir, endpoint)
    finally:
        registry.close_shared()
        moto.kill()
        moto.wait()
        shutil.rmtree(workdir, ignore_errors=True)


def run(args: argparse.Namespace, workdir: Path, endpoint: str) -> int:
    s3 = S3(endpoint)
    s3.client.create_bucket(Bucket=BUCKET)
    spec = make_spec(int(args.size_gib * GIB))
    state = build_state(spec)
    nbytes = sum(t.nbytes for t in spec.tensors)
    c = Contenders(state, s3, endpoint, workdir)
    names = ["fp_s3", "fp_local_tier", "fp_local_boto3", "torch_boto3"]
    skipped: dict[str, str] = {}
    try:
        import s3torchconnector  # noqa: F401
        names.append("s3tc_dcp")
    except ImportError as exc:
        skipped["s3tc_dcp"] = f"not installed ({exc})"
    # Correctness once, outside the timings: what fastpersist saved loads back.
    c.fp_s3("check")
    got = fastpersist.load(f"s3://{BUCKET}/check")
    assert all(torch.equal(a, b) for a, b in zip(_tensors(got), _tensors(state), strict=True))
    del got
    delete_prefix(s3.client, BUCKET, "check/")
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(args.rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        for name in order:
            fn: Callable[[str], None] = getattr(c, name)
            prefix = f"{name}/r{r}"
            start = time.perf_counter()
            fn(prefix)
            times[name].append(time.perf_counter() - start)
            delete_prefix(s3.client, BUCKET, prefix + "/")
            shutil.rmtree(workdir / "ckpt", ignore_errors=True)
        print(f"round {r}: " + ", ".join(f"{n} {times[n][-1]:.2f}s" for n in names),
              flush=True)
    base = statistics.median(times["fp_s3"])
    rows = {n: {"seconds": t, "median_s": statistics.median(t), "min_s": min(t),
                "max_s": max(t), "mib_s": nbytes / (1 << 20) / statistics.median(t),
                "time_vs_fp_s3": statistics.median(t) / base} for n, t in times.items()}
    result = {"state_bytes": nbytes, "rounds": args.rounds, "rows": rows, "skipped": skipped,
              "part_bytes": current_knobs().tier_part_bytes,
              "concurrency": current_knobs().tier_concurrency,
              "machine": machine_facts(workdir), "argv": sys.argv}
    print(f"{nbytes / GIB:.2f} GiB state, {args.rounds} interleaved rounds, one moto server")
    print(f"{'contender':<16}{'median s':>10}{'min-max s':>16}{'MiB/s':>8}{'x fp_s3 time':>14}")
    for n, row in rows.items():
        print(f"{n:<16}{row['median_s']:>10.2f}{row['min_s']:>8.2f}-{row['max_s']:<7.2f}"
              f"{row['mib_s']:>8.1f}{row['time_vs_fp_s3']:>14.2f}")
    for n, why in skipped.items():
        print(f"{n}: skipped, {why}")
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=1, default=str))
    return 0


def _tensors(node: Any) -> list[torch.Tensor]:
    if isinstance(node, torch.Tensor):
        return [node]
    if isinstance(node, dict):
        return [t for k in sorted(node, key=str) for t in _tensors(node[k])]
    if isinstance(node, (list, tuple)):
        return [t for v in node for t in _tensors(v)]
    return []


if __name__ == "__main__":
    sys.exit(main())
