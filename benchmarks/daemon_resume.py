"""Time to resume: a fresh process loads a state from fastpersistd's memory tier vs from disk.

    python benchmarks/daemon_resume.py                        # 2 GiB state, 5 rounds
    python benchmarks/daemon_resume.py --size-gib 0.5 --repeats 3 --json out.json
    python benchmarks/daemon_resume.py --dir /mnt/nvme0/bench   # the disk to measure
    python benchmarks/daemon_resume.py --drop data   # libraries cached, checkpoint not

Starts a local fastpersistd (--memory-tier-count 1, --memory-tier-bytes twice the
state) with its root in --dir, saves the seeded GPT+AdamW state through it once, then
in each round, in rotated order:
- memory: a new process runs fastpersist.load(path, daemon=ADDRESS): MemoryCopy, then
  the daemon's copy in /dev/shm mapped, every CRC32C checked (tensors/memory_read.py);
- disk:   the same with daemon="": the data files read from --dir.
The page cache is dropped before each (`sync; echo 3 > /proc/sys/vm/drop_caches` as
root, else each data file evicted with fadvise; with --drop data only the data files
are evicted; the daemon's tmpfs copy is not page cache and stays either way). Each
load's result is checked against the seeded state (shapes, plain values, a few tensors'
values) outside the timed region.

Reported per method, median and spread (min..max) over the rounds:
- resume: from spawning the process to the state restored (interpreter, `import torch`
  and fastpersist, the load), as a restarted trainer pays it;
- load: fastpersist.load alone, timed inside the process (imports excluded).
Goal (issue 35): from memory >= 5x faster than from disk. See benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _system import GIB, drop_page_cache, evict, machine_facts

HERE = Path(__file__).resolve().parent
REPO_ROOT = HERE.parent
GOAL = 5.0

# The child: load, time it, check the result against the seeded spec (untimed).
CHILD = """
import json, sys, time
t0 = time.perf_counter()
import torch, fastpersist
sys.path.insert(0, {here!r})
from _state import make_spec, verify_nested
t1 = time.perf_counter()
state = fastpersist.load({path!r}, daemon={daemon!r})
t2 = time.perf_counter()
restored = time.time()
verify_nested(state, make_spec({nbytes}, seed=0))
print(json.dumps({{"import_s": t1 - t0, "load_s": t2 - t1, "restored": restored}}))
"""


def run_load(path: Path, daemon: str, nbytes: int, env: dict[str, str]) -> dict[str, float]:
    code = CHILD.format(here=str(HERE), path=str(path), daemon=daemon, nbytes=nbytes)
    spawned = time.time()
    done = subprocess.run([sys.executable, "-W", "error::RuntimeWarning", "-c", code], env=env,
                          capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        raise SystemExit(f"load ({'memory' if daemon else 'disk'}) failed:\n{done.stderr}")
    # Up to the state restored: the check after it is not the resume's.
    times = json.loads(done.stdout.strip().splitlines()[-1])
    return {"resume_s": times.pop("restored") - spawned, **times}


def start_daemon(root: Path, shm: Path, sock: Path, tier_bytes: int, env: dict[str, str]
                 ) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "fastpersist.daemon", "--root", str(root), "--socket", str(sock),
         "--shm-dir", str(shm), "--memory-tier-count", "1",
         "--memory-tier-bytes", str(tier_bytes), "--log-level", "warning"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while not sock.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit("fastpersistd did not start")
        time.sleep(0.05)
    return proc


def summary(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size-gib", type=float, default=2.0)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--dir", type=Path, default=None, help="where the root lives (default: "
                   "a temporary directory under the working directory's file system)")
    p.add_argument("--drop", choices=("all", "data"), default="all",
                   help="all (default): drop the whole page cache before each load, the "
                        "interpreter's and torch's files too; data: evict only the "
                        "checkpoint's files, as for a trainer restarted on a node where the "
                        "libraries are still cached")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    nbytes = int(args.size_gib * GIB)
    work = Path(tempfile.mkdtemp(prefix="fp-resume-", dir=args.dir or REPO_ROOT))
    shm = Path(tempfile.mkdtemp(prefix="fp-resume-", dir="/dev/shm"))
    sockdir = Path(tempfile.mkdtemp(prefix="fpd-"))
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "FASTPERSIST_SHM_DIR": str(shm)}
    env.pop("FASTPERSIST_DAEMON", None)
    root = work / "root"
    root.mkdir()
    facts = machine_facts(work)
    daemon = start_daemon(root, shm, sockdir / "fpd.sock", 2 * nbytes + GIB, env)
    address = f"unix://{sockdir / 'fpd.sock'}"
    ckpt = root / "step-1"
    rounds: dict[str, list[dict[str, float]]] = {"memory": [], "disk": []}
    try:
        save = ("import sys, fastpersist\n"
                f"sys.path.insert(0, {str(HERE)!r})\n"
                "from _state import build_state, make_spec\n"
                f"fastpersist.save(build_state(make_spec({nbytes}, seed=0)), {str(ckpt)!r}, "
                f"daemon={address!r})\n")
        subprocess.run([sys.executable, "-c", save], env=env, check=True, timeout=1800)
        state_bytes = sum(f.stat().st_size for f in ckpt.glob("data-*"))
        mechanism = ""
        for r in range(args.repeats):
            order = ["memory", "disk"] if r % 2 == 0 else ["disk", "memory"]
            for method in order:
                if args.drop == "all":
                    mechanism = drop_page_cache([ckpt])
                else:
                    evict([ckpt])
                    mechanism = "fadvise of the data files only"
                rounds[method].append(run_load(ckpt, address if method == "memory" else "",
                                               nbytes, env))
                print(f"round {r + 1} {method}: " + ", ".join(
                    f"{k} {v:.3f}" for k, v in rounds[method][-1].items()), flush=True)
    finally:
        daemon.terminate()
        daemon.wait(60)
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)
        shutil.rmtree(sockdir, ignore_errors=True)
    result: dict[str, Any] = {"state_bytes": state_bytes, "repeats": args.repeats,
                              "cache_drop": mechanism, "machine": facts,
                              "rounds": rounds}
    print(f"\n{state_bytes / GIB:.2f} GiB of data files, {args.repeats} rounds, page cache "
          f"dropped by {mechanism}")
    print(f"{'method':8} {'resume s (median, min..max)':32} {'load s (median, min..max)':30}")
    for method, runs in rounds.items():
        res = summary([x["resume_s"] for x in runs])
        load = summary([x["load_s"] for x in runs])
        result[method] = {"resume_s": res, "load_s": load,
                          "load_gib_s": state_bytes / GIB / load["median"]}
        print(f"{method:8} {res['median']:6.3f} ({res['min']:.3f}..{res['max']:.3f})"
              f"{'':12} {load['median']:6.3f} ({load['min']:.3f}..{load['max']:.3f})"
              f"  {state_bytes / GIB / load['median']:.2f} GiB/s")
    for what in ("resume_s", "load_s"):
        ratio = result["disk"][what]["median"] / result["memory"][what]["median"]
        result[f"speedup_{what}"] = ratio
        print(f"memory vs disk, {what[:-2]}: {ratio:.2f}x faster (goal >= {GOAL:.0f}x: "
              f"{'met' if ratio >= GOAL else 'NOT met'})")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
