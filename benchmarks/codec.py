"""compression="zstd" on realistic tensors: ratio and single-core speed against peers.

    python benchmarks/codec.py                      # 300 training steps, 5 repeats
    python benchmarks/codec.py --repeats 7 --json out.json
    python benchmarks/codec.py --steps 50 --repeats 1   # quick look

The tensors are those of a checkpoint of a small model actually trained: a
4-layer transformer (d_model 256, 4 heads, feed-forward 1024, vocabulary 1024)
trained for --steps steps with AdamW (lr 1e-3) on CPU, on synthetic sequences
(each token a function of the previous two, with noise), so that the weights
have moved from their initialisation and the Adam moments are those of real
training. Each class of tensor is measured as one buffer (every parameter's
tensor, flattened and concatenated):

    bf16 weights      the parameters cast to bfloat16 (what a bf16 model saves)
    fp32 master       the fp32 parameters (mixed precision's master weights)
    fp32 exp_avg      AdamW's first moments
    fp32 exp_avg_sq   AdamW's second moments

Methods, each on one core (torch and every library limited to one thread):

    fastpersist    fastpersist.codec: byte planes + zstd in 4 MiB frames, with
                   the CRC32Cs a save computes (frames and raw); decode checks
                   the stored and raw CRC32Cs as a load does
    zstd-1, zstd-3 plain zstd (python zstandard) of the whole buffer
    zipnn          ZipNN (pip install zipnn; threads=1, its defaults otherwise:
                   byte grouping with Huffman/zstd), if it is installed, on the
                   same 4 MiB frames as fastpersist: zipnn 0.5.4 compressing a
                   whole 9-19 MB buffer in one call did not decode back to the
                   same bytes here (the report says whether it does)

ratio = stored bytes / raw bytes (lower is better). Speeds are raw MB/s
(10^6 bytes) per core: medians over --repeats repeats, methods interleaved in
a rotating order within each repeat. Every decode is checked bit for bit.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import zstandard

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from fastpersist import checksum
from fastpersist.codec import frames

FRAME_BYTES = 4 << 20


# --- the tensors --------------------------------------------------------------------------


def trained_tensors(steps: int, seed: int = 0) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    vocab, d, seq, batch = 1024, 256, 64, 16
    layer = torch.nn.TransformerEncoderLayer(d, 4, 4 * d, dropout=0.0, batch_first=True)
    model = torch.nn.ModuleDict({
        "emb": torch.nn.Embedding(vocab, d),
        "body": torch.nn.TransformerEncoder(layer, 4, enable_nested_tensor=False),
        "head": torch.nn.Linear(d, vocab),
    })
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    mask = torch.nn.Transformer.generate_square_subsequent_mask(seq)
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.empty(batch, seq, dtype=torch.long)
        x[:, :2] = torch.randint(0, vocab, (batch, 2), generator=g)
        noise = torch.randint(0, 8, (batch, seq), generator=g)
        for t in range(2, seq):
            x[:, t] = (3 * x[:, t - 1] + 5 * x[:, t - 2] + noise[:, t]) % vocab
        h = model["body"](model["emb"](x[:, :-1]), mask=mask[:-1, :-1], is_causal=True)
        loss = torch.nn.functional.cross_entropy(model["head"](h).reshape(-1, vocab),
                                                 x[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
    params = list(model.parameters())
    st = opt.state_dict()["state"]

    def cat(ts: list[torch.Tensor]) -> torch.Tensor:
        return torch.cat([t.detach().reshape(-1) for t in ts])

    return {
        "bf16 weights": cat(params).bfloat16(),
        "fp32 master": cat(params),
        "fp32 exp_avg": cat([st[i]["exp_avg"] for i in range(len(params))]),
        "fp32 exp_avg_sq": cat([st[i]["exp_avg_sq"] for i in range(len(params))]),
    }


# --- the methods --------------------------------------------------------------------------

Codec = tuple[Callable[[bytes], Any], Callable[[Any], bytes], Callable[[Any], int]]


def fastpersist_codec(dtype: str) -> Codec:
    def encode(raw: bytes) -> frames.Encoded:
        (e,) = frames.encode_tensors([(memoryview(raw), dtype)], FRAME_BYTES)
        return e

    def decode(e: frames.Encoded) -> bytes:
        out = bytearray(sum(f.raw_length for f in e.frames))
        view = memoryview(out)
        jobs = [frames.DecodeJob(memoryview(p), dtype,
                                 view[f.raw_offset:f.raw_offset + f.raw_length], f.crc32c)
                for f, p in zip(e.frames, e.parts, strict=True)]
        results = frames.decode_frames(jobs, raw_crc=True)
        crc = checksum.combine([(r.raw_crc32c or 0, f.raw_length)
                              for r, f in zip(results, e.frames, strict=True)])
        assert crc == e.crc32c and all(r.error is None for r in results)
        return bytes(out)

    return encode, decode, lambda e: e.stored_length


def zstd_codec(level: int) -> Codec:
    c = zstandard.ZstdCompressor(level=level)
    d = zstandard.ZstdDecompressor()
    return c.compress, d.decompress, len


def zipnn_codec(dtype: str) -> Codec | str:
    try:
        from zipnn import ZipNN
    except ImportError as exc:
        return f"skipped: zipnn is not installed ({exc}); pip install zipnn"
    z = ZipNN(input_format="byte", bytearray_dtype="bfloat16" if dtype == "BF16" else "float32",
              threads=1)

    def encode(raw: bytes) -> list[bytes]:
        return [z.compress(raw[i:i + FRAME_BYTES]) for i in range(0, len(raw), FRAME_BYTES)]

    def decode(parts: list[bytes]) -> bytes:
        return b"".join(bytes(z.decompress(p)) for p in parts)

    return encode, decode, lambda parts: sum(len(p) for p in parts)


def zipnn_whole_buffer_round_trips(tensors: dict[str, torch.Tensor]) -> dict[str, bool]:
    """Whether ZipNN decodes each whole buffer, compressed in one call, back to it."""
    try:
        from zipnn import ZipNN
    except ImportError:
        return {}
    out = {}
    for name, t in tensors.items():
        raw = t.view(torch.uint8).numpy().tobytes()
        z = ZipNN(input_format="byte", threads=1,
                  bytearray_dtype="bfloat16" if name.startswith("bf16") else "float32")
        out[name] = bytes(z.decompress(z.compress(raw))) == raw
    return out


# --- measuring ----------------------------------------------------------------------------


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


def run(tensors: dict[str, torch.Tensor], repeats: int) -> dict[str, Any]:
    raw = {name: t.view(torch.uint8).numpy().tobytes() for name, t in tensors.items()}
    methods: dict[str, Callable[[str], Codec | str]] = {
        "fastpersist": fastpersist_codec,
        "zstd-1": lambda _: zstd_codec(1),
        "zstd-3": lambda _: zstd_codec(3),
        "zipnn": zipnn_codec,
    }
    samples: dict[tuple[str, str], dict[str, list[float]]] = {}
    skipped: dict[str, str] = {}
    for rep in range(repeats):
        order = list(methods)
        order = order[rep % len(order):] + order[:rep % len(order)]
        for method in order:
            for cls, data in raw.items():
                codec = methods[method]("BF16" if cls.startswith("bf16") else "F32")
                if isinstance(codec, str):
                    skipped[method] = codec
                    continue
                encode, decode, size = codec
                enc_s, packed = timed(lambda: encode(data))  # noqa: B023
                dec_s, back = timed(lambda: decode(packed))  # noqa: B023
                if bytes(back) != data:
                    raise AssertionError(f"{method} did not round-trip {cls}")
                s = samples.setdefault((cls, method), {"ratio": [], "enc": [], "dec": []})
                s["ratio"].append(size(packed) / len(data))
                s["enc"].append(len(data) / enc_s / 1e6)
                s["dec"].append(len(data) / dec_s / 1e6)
        print(f"repeat {rep + 1}/{repeats} done", file=sys.stderr)
    results = {f"{cls} | {m}": {k: statistics.median(v) for k, v in s.items()} | {
        "samples": s, "bytes": len(raw[cls])} for (cls, m), s in samples.items()}
    return {"results": results, "skipped": skipped}


def parallel_decode(tensors: dict[str, torch.Tensor], threads: int) -> float:
    """MB/s of decoding every class with `threads` codec threads (one repeat)."""
    os.environ["FASTPERSIST_CODEC_THREADS"] = str(threads)
    total, seconds = 0, 0.0
    for name, t in tensors.items():
        raw = t.view(torch.uint8).numpy().tobytes()
        enc, dec, _ = fastpersist_codec("BF16" if name.startswith("bf16") else "F32")
        packed = enc(raw)
        s, _ = timed(lambda: dec(packed))  # noqa: B023
        total, seconds = total + len(raw), seconds + s
    return total / seconds / 1e6


def report(out: dict[str, Any], classes: list[str]) -> list[str]:
    res = out["results"]
    lines = [f"{'tensor class':<16} {'method':<12} {'ratio':>7} {'encode MB/s':>12} "
             f"{'decode MB/s':>12}"]
    for cls in classes:
        for m in ("fastpersist", "zstd-1", "zstd-3", "zipnn"):
            r = res.get(f"{cls} | {m}")
            if r:
                lines.append(f"{cls:<16} {m:<12} {r['ratio']:>7.4f} {r['enc']:>12.0f} "
                             f"{r['dec']:>12.0f}")
    for m, why in out["skipped"].items():
        lines.append(f"{m}: {why}")
    lines.append("")
    for cls in classes:
        ours, peer = res.get(f"{cls} | fastpersist"), res.get(f"{cls} | zipnn")
        if not ours or not peer:
            continue
        ok_ratio = ours["ratio"] <= peer["ratio"]
        ok_speed = ours["enc"] >= peer["enc"]
        lines.append(f"{'PASS' if ok_ratio and ok_speed else 'MISS'} {cls}: ratio "
                     f"{ours['ratio']:.4f} vs ZipNN {peer['ratio']:.4f} "
                     f"({'<=' if ok_ratio else '>'}), encode {ours['enc']:.0f} vs "
                     f"{peer['enc']:.0f} MB/s ({'>=' if ok_speed else '<'})")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=300, help="training steps (300)")
    parser.add_argument("--repeats", type=int, default=5, help="repeats, medians (5)")
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--cache", type=Path, help="keep the trained tensors in this file "
                        "(torch.save) and reuse them on the next run")
    args = parser.parse_args()
    torch.set_num_threads(1)  # one core for every method
    os.environ["FASTPERSIST_CODEC_THREADS"] = "1"
    start = time.perf_counter()
    if args.cache and args.cache.exists():
        tensors = torch.load(args.cache)
    else:
        tensors = trained_tensors(args.steps)
        if args.cache:
            torch.save(tensors, args.cache)
    print(f"trained {args.steps} steps in {time.perf_counter() - start:.0f} s; "
          + ", ".join(f"{k} {t.numel() * t.element_size() / 2**20:.1f} MiB"
                      for k, t in tensors.items()), file=sys.stderr)
    out = run(tensors, args.repeats)
    cores = len(os.sched_getaffinity(0))
    out["parallel_decode_mbps"] = {n: parallel_decode(tensors, n) for n in sorted({1, cores})}
    out["zipnn_whole_buffer_round_trips"] = zipnn_whole_buffer_round_trips(tensors)
    lines = report(out, list(tensors))
    if out["zipnn_whole_buffer_round_trips"]:
        lines.append("zipnn on each whole buffer in one call decodes back to it: " + ", ".join(
            f"{k}: {'yes' if v else 'NO'}"
            for k, v in out["zipnn_whole_buffer_round_trips"].items()))
    lines.append("decode with FASTPERSIST_CODEC_THREADS=n, all classes, MB/s: " + ", ".join(
        f"n={n}: {v:.0f}" for n, v in out["parallel_decode_mbps"].items())
        + f" ({cores} cores here)")
    print("\n".join(lines))
    if args.json:
        out["args"] = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
        out["versions"] = {"torch": torch.__version__, "zstandard": zstandard.__version__}
        try:
            from importlib.metadata import version

            import zipnn  # noqa: F401

            out["versions"]["zipnn"] = version("zipnn")
        except ImportError:
            pass
        args.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
