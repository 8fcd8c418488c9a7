"""One measured operation in a fresh process: `python _worker.py JOB.json`.

A fresh process per measurement keeps one method's allocator state, page-locked buffers
and threads from leaking into the next, and makes the peak-RSS figure that method's own:
the state is built, the peak is reset to the current RSS, and only the timed call remains.
The result goes to the JSON file named in the job, never to stdout, which libraries use.
"""

from __future__ import annotations

import ctypes
import gc
import json
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch
from _peers import METHODS, Method
from _state import build_state, iter_tensors, spec_from
from _system import drop_page_cache, peak_rss_bytes, reset_peak_rss, rss_bytes

PAGE = 4096
SMALL = 16 * PAGE  # tensors touched through ctypes rather than torch ops


def _measure(call: Any) -> tuple[dict[str, Any], object]:
    """Run `call` once; return its time, the CPU time of all the process's threads
    (steadier than wall time on a shared machine), RSS before it and peak RSS
    increase, and its result."""
    gc.collect()
    if not reset_peak_rss():
        raise RuntimeError("cannot reset VmHWM (/proc/self/clear_refs); peak memory would be wrong")
    before = rss_bytes()
    cpu = time.process_time()
    start = time.perf_counter()
    result = call()
    seconds = time.perf_counter() - start
    return {
        "seconds": seconds,
        "cpu_seconds": time.process_time() - cpu,
        "rss_before": before,
        "peak_increase": peak_rss_bytes() - before,
    }, result


def _touch_every_page(loaded: object) -> int:
    """Read one byte of every 4 KiB of every loaded tensor; returns a checksum to keep it live.

    safetensors' default backend returns tensors over a private mmap whose pages are read
    only when touched; without this its "load" would time little more than the header.
    For tensors already in memory this costs a strided read, a few ms per GiB. Small
    contiguous tensors are read a byte a page through ctypes: the torch ops of a
    strided sum cost ~8 us a tensor, most of the load of 100,000 small tensors.
    """
    total = 0
    for tensor in iter_tensors(loaded):
        nbytes = tensor.numel() * tensor.element_size()
        if nbytes <= SMALL and tensor.device.type == "cpu" and tensor.is_contiguous():
            address = tensor.data_ptr()
            for offset in range(0, nbytes, PAGE):
                total += ctypes.string_at(address + offset, 1)[0]
            continue
        raw = tensor.detach().reshape(-1).view(torch.uint8)
        total += int(raw[::PAGE].sum())
    return total


def _save(method: Method, job: dict[str, Any]) -> dict[str, Any]:
    spec = spec_from(job["state"], job["seed"])
    state = build_state(spec)
    method.setup()
    path = Path(job["path"])
    method.prepare_save(path)
    measured, _ = _measure(lambda: method.save(state, path))
    return {**method.facts(), **measured}


def _load(method: Method, job: dict[str, Any]) -> dict[str, Any]:
    spec = spec_from(job["state"], job["seed"])
    path = Path(job["path"])
    method.prepare_load(spec)
    cache = drop_page_cache([path])  # after imports, right before the timed read

    def load_and_touch() -> object:
        loaded = method.load(path, spec)
        _touch_every_page(loaded)
        return loaded

    measured, loaded = _measure(load_and_touch)
    verified = "ok"
    try:
        method.verify(loaded, spec)
    except Exception as exc:  # reported with the timing, so a wrong load cannot pass as fast
        verified = f"{type(exc).__name__}: {exc}"
    return {**method.facts(), **measured, "cache": cache, "verified": verified}


def main(job_file: str) -> int:
    job = json.loads(Path(job_file).read_text())
    if job.get("baseline"):
        sys.path.insert(0, job["baseline"])  # before anything imports fastpersist
    method = METHODS[job["method"]]
    result: dict[str, Any]
    try:
        if job["op"] == "probe":
            result = {"skip": method.probe()}
        elif job["op"] == "save":
            result = _save(method, job)
        else:
            result = _load(method, job)
        module = sys.modules.get("fastpersist")
        if job["op"] != "probe" and module is not None:
            result["module"] = module.__file__  # which fastpersist was measured
            if job.get("baseline") and not str(module.__file__).startswith(job["baseline"]):
                raise RuntimeError(f"the baseline imported {module.__file__}, not from "
                                   f"{job['baseline']}")
    except Exception as exc:
        traceback.print_exc()
        result = {"error": f"{type(exc).__name__}: {exc}"}
    Path(job["result"]).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
