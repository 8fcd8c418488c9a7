"""The daemon's encode of a compressed file: reading shared memory through the guarded copy.

    python benchmarks/guarded_encode.py                    # 256 MiB, 7 repeats
    python benchmarks/guarded_encode.py --mib 512 --repeats 9 --json out.json

fastpersistd compresses a client's data file (Begin's compression="zstd")
straight from the client's shared-memory segment. Since issue 33 the codec
reads it only through the engine's SIGBUS-guarded copy (`_engine.copy`, one
frame at a time into the codec thread's own buffer), so that a client that
truncates its segment fails its checkpoint instead of killing the daemon. This
measures what that copy costs on the daemon's path, `codec.packing.plan` of
one data file laid out in a real segment (/dev/shm, mapped read-only as the
daemon maps it), in the same run:

    guarded   plan(..., copy=engine.copy): what the daemon does now
    direct    plan(...) on the mapping: what it did before (unsafe)

The tensors are a GPT-style bf16 + fp32 AdamW state (benchmarks/_state.py),
the daemon's codec threads (FASTPERSIST_CODEC_THREADS) and frame size
(FASTPERSIST_FRAME_BYTES) as configured. Medians of --repeats repeats, the two
interleaved in alternating order; both must give the same plan (checked).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from _state import build_state, flatten_tensors, make_spec

from fastpersist import knobs
from fastpersist.codec import packing
from fastpersist.engine import get_engine
from fastpersist.protocol import shm

MIB = 1 << 20
DTYPES = {torch.bfloat16: "BF16", torch.float32: "F32", torch.int64: "I64"}


def lay_out(tensors: dict[str, torch.Tensor], directory: Path
            ) -> tuple[shm.Segment, list[tuple[str, str, tuple[int, ...], int, int]]]:
    """The tensors copied into one segment, back to back: (name, dtype, shape,
    offset, nbytes) of each."""
    entries, offset = [], 0
    for name, t in tensors.items():
        if t.dtype in DTYPES and t.numel():
            entries.append((name, DTYPES[t.dtype], tuple(t.shape), offset, t.nbytes))
            offset += -(-t.nbytes // 64) * 64
    seg = shm.Segment(directory, offset)
    assert seg.map is not None
    for (name, _, _, off, n) in entries:
        flat = tensors[name].contiguous().reshape(-1)
        seg.map[off:off + n] = flat.view(torch.uint8).numpy().tobytes()
    return seg, entries


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mib", type=int, default=256, help="raw bytes of the data file (MiB)")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--json", type=Path)
    args = p.parse_args()

    tensors, _ = flatten_tensors(build_state(make_spec(args.mib * MIB, seed=0)))
    seg, entries = lay_out(tensors, shm.shm_dir())
    del tensors
    engine = get_engine()
    k = knobs.current()
    dir_fd = os.open(shm.shm_dir(), os.O_RDONLY | os.O_DIRECTORY)
    try:
        seg.seal("bench")
        mapping = shm.open_range(dir_fd, seg.name, seg.data_offset, seg.size,
                                 shm.tag_for("bench"))
        raw = [packing.RawTensor(name, dtype, shape, mapping.view[off:off + n])
               for name, dtype, shape, off, n in entries]
        nbytes = sum(n for *_, n in entries)
        runs: dict[str, list[float]] = {"guarded": [], "direct": []}
        plans: dict[str, Any] = {}
        packing.plan("warm", raw, k.frame_bytes, engine.copy)  # threads and buffers made
        for r in range(args.repeats):
            order = ["guarded", "direct"] if r % 2 == 0 else ["direct", "guarded"]
            for method in order:
                copy = engine.copy if method == "guarded" else None
                t0 = time.perf_counter()
                laid = packing.plan("f", raw, k.frame_bytes, copy)
                runs[method].append(time.perf_counter() - t0)
                plans[method] = [(s.name, e.crc32c, e.stored_length)
                                 for s, e in ((t, laid.encoded[t.name]) for t in laid.order
                                              if t.name in laid.encoded)]
                del laid
        assert plans["guarded"] == plans["direct"], "the two paths encoded differently"
        for view in raw:
            view.data.release()
        mapping.close()
    finally:
        os.close(dir_fd)
        seg.close()

    med = {m: statistics.median(v) for m, v in runs.items()}
    report = {
        "raw_bytes": nbytes, "repeats": args.repeats, "codec_threads": k.codec_threads,
        "frame_bytes": k.frame_bytes, "engine": engine.name,
        "seconds": runs, "median_seconds": med,
        "mb_per_s": {m: nbytes / s / 1e6 for m, s in med.items()},
        "guarded_over_direct": med["guarded"] / med["direct"],
    }
    print(f"encode of a {nbytes / MIB:.0f} MiB data file from shared memory, "
          f"{k.codec_threads} codec threads, {k.frame_bytes // MIB} MiB frames, "
          f"medians of {args.repeats}:")
    for m in ("direct", "guarded"):
        print(f"  {m:8s} {med[m]:.3f} s  {report['mb_per_s'][m]:.0f} MB/s  "
              f"(min {min(runs[m]):.3f}, max {max(runs[m]):.3f})")
    print(f"  guarded / direct: {report['guarded_over_direct']:.3f}x")
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
