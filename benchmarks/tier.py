"""The object-store tier against plain boto3 on the same bytes, in the same run.

    python benchmarks/tier.py                          # 2 GiB state, 5 repeats, local moto
    python benchmarks/tier.py --size-gib 0.25 --repeats 1
    python benchmarks/tier.py --endpoint http://HOST:PORT --bucket B   # an existing store
    python benchmarks/tier.py --compression zstd       # compressed on the way (the default
                                                       # of Checkpointer and fastpersistd)

Measured, interleaved within each repeat (medians reported):
1. drain: uploading one committed checkpoint with the tier (tier/upload.py:
   parallel multipart data files, then the conditional manifest), against the
   ceiling: boto3's upload_file of the same files with the transfer manager at
   the concurrency that was fastest in a sweep before the repeats (and the
   same part size);
2. restore: fastpersist.load("s3://...") (ranged GETs into the tensors, every
   CRC32C checked, the state rebuilt), against the ceiling: boto3's
   download_file of the same objects (ranged GETs of the same size, at the
   best concurrency) into files on /dev/shm.

Without --endpoint a moto server (`python -m moto.server`) is started on
localhost: the ceiling is then moto's, a single Python process, and says
nothing about S3. moto also reads a whole object for each ranged GET, so
reads of large objects cost it more than their bytes.

--compression zstd: the tier compresses the (raw) checkpoint on the way
(tier/compress.py) and the restore decodes it; MiB/s are then of the raw
checkpoint's bytes (what the user saves and gets back), and the stored
ratio is printed. The ceiling still moves the raw bytes.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from _state import build_state, make_spec
from _system import GIB, machine_facts

import fastpersist
from fastpersist.format.manifest import MANIFEST_NAME, Manifest
from fastpersist.knobs import current as current_knobs
from fastpersist.storage import dirs
from fastpersist.tier.client import S3
from fastpersist.tier.upload import upload_checkpoint
from fastpersist.tier.url import TierURL

MIB = 1 << 20


def start_moto(port: int, log: Path) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p",
                             str(port)], stdout=log.open("ab"), stderr=subprocess.STDOUT)
    for _ in range(300):
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/moto-api/", timeout=1).close()
            return proc
        except OSError:
            time.sleep(0.1)
    proc.kill()
    raise SystemExit("moto_server did not start")


def delete_prefix(client: Any, bucket: str, prefix: str) -> None:
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        objs = [{"Key": o["Key"]} for o in page.get("Contents", [])]
        if objs:
            client.delete_objects(Bucket=bucket, Delete={"Objects": objs, "Quiet": True})


def transfer_config(concurrency: int) -> Any:
    from boto3.s3.transfer import TransferConfig

    part = current_knobs().tier_part_bytes
    return TransferConfig(multipart_threshold=part, multipart_chunksize=part,
                          max_concurrency=concurrency, preferred_transfer_client="classic")


def plain_upload(s3: S3, ckpt: Path, files: list[str], bucket: str, prefix: str,
                 concurrency: int) -> float:
    """boto3 upload_file of the checkpoint's files, all at once through one manager."""
    from boto3.s3.transfer import create_transfer_manager

    start = time.perf_counter()
    with create_transfer_manager(s3.client, transfer_config(concurrency)) as tm:
        futures = [tm.upload(str(ckpt / name), bucket, f"{prefix}/{name}") for name in files]
        for f in futures:
            f.result()
    return time.perf_counter() - start


def plain_download(s3: S3, files: list[str], bucket: str, prefix: str, concurrency: int,
                   scratch: Path) -> float:
    from boto3.s3.transfer import create_transfer_manager

    start = time.perf_counter()
    with create_transfer_manager(s3.client, transfer_config(concurrency)) as tm:
        futures = [tm.download(bucket, f"{prefix}/{name}", str(scratch / name))
                   for name in files]
        for f in futures:
            f.result()
    seconds = time.perf_counter() - start
    for name in files:
        (scratch / name).unlink()
    return seconds


SENT: list[int] = []  # bytes each tier upload sent


def tier_upload(s3: S3, ckpt: Path, url: TierURL, compression: str) -> float:
    fd = os.open(ckpt, dirs.DIR_FLAGS)
    try:
        start = time.perf_counter()
        done = upload_checkpoint(s3, fd, str(ckpt), url, compression)
        seconds = time.perf_counter() - start
    finally:
        os.close(fd)
    assert not done.already
    SENT.append(done.bytes)
    return seconds


def tier_restore(url: TierURL, endpoint: str) -> float:
    from fastpersist.api import load_from_tier

    start = time.perf_counter()
    state = load_from_tier(str(url), endpoint_url=endpoint)
    seconds = time.perf_counter() - start
    del state
    return seconds


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size-gib", type=float, default=2.0)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--endpoint", help="an S3 endpoint to use instead of a local moto server")
    p.add_argument("--bucket", default="fastpersist-bench")
    p.add_argument("--dir", type=Path, default=None, help="where the local checkpoint goes")
    p.add_argument("--sweep", default="4,8,16", help="concurrencies tried for the ceiling")
    p.add_argument("--json", type=Path, help="write every sample here")
    p.add_argument("--compression", choices=("none", "zstd"), default="none",
                   help="the tier's tier_compression (default none: raw, as the ceiling)")
    args = p.parse_args()

    workdir = Path(tempfile.mkdtemp(prefix="fp-tier-bench-", dir=args.dir))
    moto = None
    endpoint = args.endpoint
    if endpoint is None:
        import socket

        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        moto = start_moto(port, workdir / "moto.log")
        endpoint = f"http://127.0.0.1:{port}"
        for k, v in {"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench",
                     "AWS_DEFAULT_REGION": "us-east-1"}.items():
            os.environ.setdefault(k, v)
    try:
        return run(args, workdir, endpoint, moto is not None)
    finally:
        if moto is not None:
            moto.kill()
        import shutil

        shutil.rmtree(workdir, ignore_errors=True)


def run(args: argparse.Namespace, workdir: Path, endpoint: str, is_moto: bool) -> int:
    s3 = S3(endpoint)
    client = s3.client
    try:
        client.create_bucket(Bucket=args.bucket)
    except Exception as exc:  # exists already
        print(f"(create_bucket: {exc})")
    nbytes = int(args.size_gib * GIB)
    ckpt = workdir / "step-00000001"
    fastpersist.save(build_state(make_spec(nbytes, seed=0)), ckpt)
    manifest = Manifest.from_json((ckpt / MANIFEST_NAME).read_bytes(), str(ckpt))
    files = [f.name for f in manifest.files] + [MANIFEST_NAME]
    total = sum((ckpt / n).stat().st_size for n in files)
    k = current_knobs()
    print(json.dumps({**machine_facts(workdir), "endpoint": endpoint, "moto": is_moto,
                      "bytes": total, "files": len(files), "tensors": len(manifest.tensors),
                      "part_bytes": k.tier_part_bytes,
                      "tier_concurrency": k.tier_concurrency,
                      "compression": args.compression,
                      "codec_threads": k.codec_threads}, indent=1))
    scratch = Path(tempfile.mkdtemp(prefix="fp-tier-dl-", dir="/dev/shm"))

    # The ceiling's concurrency: the fastest of a sweep, one run each.
    best, best_s = 0, float("inf")
    for c in [int(x) for x in args.sweep.split(",")]:
        seconds = plain_upload(s3, ckpt, files, args.bucket, "sweep", c)
        delete_prefix(client, args.bucket, "sweep/")
        print(f"sweep: upload_file at concurrency {c}: {total / seconds / MIB:.1f} MiB/s")
        if seconds < best_s:
            best, best_s = c, seconds
    print(f"ceiling concurrency: {best}")

    samples: dict[str, list[float]] = {"tier_drain": [], "boto3_upload": [],
                                       "tier_restore": [], "boto3_download": []}
    base = TierURL(args.bucket, "bench")
    for rep in range(args.repeats):
        # Alternate the order within the pair, so neither always goes first.
        url = base.child(f"tier-{rep}", "step-00000001")
        pair = [("tier_drain", lambda u=url: tier_upload(s3, ckpt, u, args.compression)),
                ("boto3_upload", lambda r=rep: plain_upload(s3, ckpt, files, args.bucket,
                                                            f"plain-{r}", best))]
        for name, fn in pair if rep % 2 == 0 else pair[::-1]:
            samples[name].append(fn())
        pair = [("tier_restore", lambda u=url: tier_restore(u, endpoint)),
                ("boto3_download", lambda r=rep: plain_download(s3, files, args.bucket,
                                                                f"plain-{r}", best, scratch))]
        for name, fn in pair if rep % 2 == 0 else pair[::-1]:
            samples[name].append(fn())
        delete_prefix(client, args.bucket, f"bench/tier-{rep}/")
        delete_prefix(client, args.bucket, f"plain-{rep}/")
        print(f"repeat {rep}: " + ", ".join(f"{n} {total / v[-1] / MIB:.1f} MiB/s"
                                            for n, v in samples.items()), flush=True)
    scratch.rmdir()

    med = {n: statistics.median(v) for n, v in samples.items()}
    print(f"\nmedians of {args.repeats} interleaved repeats, {total / GIB:.2f} GiB "
          f"({len(files)} objects), {'moto' if is_moto else endpoint}:")
    for n, v in med.items():
        print(f"  {n:15s} {v:7.2f} s  {total / v / MIB:7.1f} MiB/s")
    print(f"  drain / ceiling   {med['boto3_upload'] / med['tier_drain']:.2f}x throughput")
    print(f"  restore / ceiling {med['boto3_download'] / med['tier_restore']:.2f}x throughput")
    data = total - (ckpt / MANIFEST_NAME).stat().st_size
    print(f"  stored / raw data {statistics.median(SENT) / data:.3f} "
          f"({statistics.median(SENT) / MIB:.0f} of {data / MIB:.0f} MiB sent)")
    if args.json:
        args.json.write_text(json.dumps({"bytes": total, "ceiling_concurrency": best,
                                         "compression": args.compression, "sent": SENT,
                                         "samples": samples, "medians": med}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
