"""Time to resume: a fresh process restores a state from each place a copy can be.

    python benchmarks/time_to_resume.py                        # 2 GiB state, 5 rounds
    python benchmarks/time_to_resume.py --size-gib 0.5 --repeats 3 --json out.json
    python benchmarks/time_to_resume.py --dir /mnt/nvme0/bench   # the disk to measure
    python benchmarks/time_to_resume.py --drop data   # libraries cached, checkpoint not
    python benchmarks/time_to_resume.py --methods memory,disk   # a subset

Starts a local fastpersistd (--memory-tier-count 1, --memory-tier-bytes twice the
state) with its root in --dir and a moto server (`python -m moto.server`) as the
object store, saves the seeded GPT+AdamW state through the daemon once, uploads it to
the store, and saves the same state with torch.distributed.checkpoint (DCP's
FileSystemWriter) beside it. Then in each round, in rotated order, a new process:
- memory: fastpersist.load(path, daemon=ADDRESS): MemoryCopy, then the daemon's
  copy in /dev/shm mapped, every CRC32C checked (tensors/memory_read.py);
- disk:   the same with daemon="": the data files read from --dir;
- store:  fastpersist.load_from_tier("s3://..."): parallel ranged GETs, every
  CRC32C checked (moto is one Python process: its ceiling, not S3's);
- dcp:    torch.distributed.checkpoint.load into a state of the right shapes (as a
  trainer resuming with DCP does), from its files in --dir;
- peer:   a node whose disk is gone: the daemon (--replicas 1) sent a second save of
  the state to a peer daemon over TCP with TLS (loopback), whose replica in memory
  is what fastpersist.load(path, daemon=ADDRESS) reads once the local directory is
  deleted (the restore chain: memory, disk, then the peers), every CRC32C checked.
The page cache is dropped before each (`sync; echo 3 > /proc/sys/vm/drop_caches` as
root, else each file evicted with fadvise; with --drop data only the checkpoints'
files are evicted; the daemon's tmpfs copy is not page cache and stays either way).
Each load's result is checked against the seeded state (shapes, plain values, a few
tensors' values) outside the timed region.

The children run with bytecode caching on and fastpersist compiled beforehand
(compileall), as an installed package is: this environment sets
PYTHONDONTWRITEBYTECODE, which would make every fresh process compile fastpersist's
modules from source (about 60 ms of a 1 GiB load from memory, measured).

Reported per method, median and spread (min..max) over the rounds:
- resume: from spawning the process to the state restored (interpreter, `import torch`
  and fastpersist, the load), as a restarted trainer pays it;
- load: the load call alone, timed inside the process (imports excluded).
Goal (issue 35): from memory >= 5x faster than from disk. See benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import compileall
import json
import os
import shutil
import socket
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
METHODS = ("memory", "disk", "store", "dcp", "peer")
BUCKET = "fastpersist-resume"

# The children: load, time it, check the result against the seeded spec (untimed).
PRELUDE = """
import json, sys, time
t0 = time.perf_counter()
import torch, fastpersist
sys.path.insert(0, {here!r})
from _state import build_skeleton, make_spec, verify_nested
spec = make_spec({nbytes}, seed=0)
t1 = time.perf_counter()
"""
LOADS = {
    "memory": "state = fastpersist.load({path!r}, daemon={address!r})",
    "disk": "state = fastpersist.load({path!r}, daemon='')",
    "store": ("from fastpersist.api import load_from_tier\n"
              "state = load_from_tier({url!r}, endpoint_url={endpoint!r})"),
    # DCP loads in place into a state of the right shapes (built before the clock).
    "dcp": ("import warnings, torch.distributed.checkpoint as dcp\n"
            "warnings.filterwarnings('ignore', message='.*assuming the intent is to')\n"
            "state = build_skeleton(spec)\n"
            "t1 = time.perf_counter()\n"
            "dcp.load(state, checkpoint_id={dcp_path!r})"),
    # The local directory is gone: the chain warns and reads the peer's replica.
    "peer": ("import warnings\n"
             "warnings.filterwarnings('ignore', message='.*reading it from the peers')\n"
             "state = fastpersist.load({peer_path!r}, daemon={address!r})"),
}
EPILOGUE = """
t2 = time.perf_counter()
restored = time.time()
verify_nested(state, spec)
print(json.dumps({{"import_s": t1 - t0, "load_s": t2 - t1, "restored": restored}}))
"""


def run_load(method: str, env: dict[str, str], **where: Any) -> dict[str, float]:
    code = (PRELUDE + LOADS[method] + EPILOGUE).format(here=str(HERE), **where)
    spawned = time.time()
    done = subprocess.run([sys.executable, "-W", "error::RuntimeWarning", "-c", code], env=env,
                          capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        raise SystemExit(f"load ({method}) failed:\n{done.stderr}")
    # Up to the state restored: the check after it is not the resume's.
    times = json.loads(done.stdout.strip().splitlines()[-1])
    return {"resume_s": times.pop("restored") - spawned, **times}


def wait_for(proc: subprocess.Popen[bytes], ready: Any, what: str) -> None:
    deadline = time.monotonic() + 60
    while not ready():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"{what} did not start")
        time.sleep(0.05)


def start_daemon(root: Path, shm: Path, sock: Path, env: dict[str, str], *args: str
                 ) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "fastpersist.daemon", "--root", str(root), "--socket", str(sock),
         "--shm-dir", str(shm), "--log-level", "warning", *args],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_for(proc, sock.exists, "fastpersistd")
    return proc


def start_moto(log: Path, env: dict[str, str]) -> tuple[subprocess.Popen[bytes], str]:
    import urllib.request

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p",
                             str(port)], stdout=log.open("ab"), stderr=subprocess.STDOUT,
                            env=env)
    endpoint = f"http://127.0.0.1:{port}"

    def up() -> bool:
        try:
            urllib.request.urlopen(f"{endpoint}/moto-api/", timeout=1).close()
            return True
        except OSError:
            return False

    wait_for(proc, up, "moto server")
    return proc, endpoint


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def tls_files(work: Path) -> tuple[Path, Path, Path]:
    """A self-signed certificate for 127.0.0.1, its key, and the job's token."""
    cert, key, token = work / "peer.pem", work / "peer.key", work / "token"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt",
                    "ec_paramgen_curve:prime256v1", "-nodes", "-keyout", str(key), "-out",
                    str(cert), "-days", "1", "-subj", "/CN=localhost", "-addext",
                    "subjectAltName=IP:127.0.0.1"], check=True, capture_output=True)
    token.write_text(os.urandom(16).hex() + "\n")
    return cert, key, token


def wait_replicated(peer: str, relpath: str, env: dict[str, str]) -> None:
    code = ("import sys, time\nfrom fastpersist.tensors import peer_read\n"
            "for _ in range(6000):\n"
            f"    if any(r.complete and r.path == {relpath!r} "
            f"for r in peer_read.replicas({peer!r})):\n"
            "        sys.exit(0)\n"
            "    time.sleep(0.1)\n"
            "sys.exit('the peer never held a complete replica')\n")
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=900)


def prepare(methods: list[str], ckpt: Path, dcp_path: Path, url: str, endpoint: str,
            address: str, nbytes: int, env: dict[str, str]) -> None:
    """One save through the daemon, its upload, the DCP save: in a child, as a trainer."""
    code = [
        "import sys, os, warnings, fastpersist",
        f"sys.path.insert(0, {str(HERE)!r})",
        "from _state import build_state, make_spec",
        f"state = build_state(make_spec({nbytes}, seed=0))",
    ]
    if "peer" in methods:  # first: the memory tier keeps the newest, ckpt
        code.append(f"fastpersist.save(state, {str(ckpt.parent / 'step-peer')!r}, "
                    f"daemon={address!r})")
    code.append(f"fastpersist.save(state, {str(ckpt)!r}, daemon={address!r})")
    if "store" in methods:
        code += [
            "from fastpersist.tier.client import S3",
            "from fastpersist.tier.upload import upload_checkpoint",
            "from fastpersist.tier.url import TierURL",
            "from fastpersist.storage import dirs",
            f"s3 = S3({endpoint!r}); s3.client.create_bucket(Bucket={BUCKET!r})",
            f"fd = os.open({str(ckpt)!r}, dirs.DIR_FLAGS)",
            f"upload_checkpoint(s3, fd, {str(ckpt)!r}, TierURL.parse({url!r}), 'none')",
            "os.close(fd)",
        ]
    if "dcp" in methods:
        code += [
            "import torch.distributed.checkpoint as dcp",
            "warnings.filterwarnings('ignore', message='.*assuming the intent is to')",
            f"dcp.save(state, checkpoint_id={str(dcp_path)!r})",
        ]
    subprocess.run([sys.executable, "-c", "\n".join(code)], env=env, check=True, timeout=1800)


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
                        "checkpoints' files, as for a trainer restarted on a node where the "
                        "libraries are still cached")
    p.add_argument("--methods", default=",".join(METHODS),
                   help=f"a comma-separated subset of {','.join(METHODS)}")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    methods = [m for m in args.methods.split(",") if m]
    if not methods or set(methods) - set(METHODS):
        p.error(f"--methods: choose from {','.join(METHODS)}")
    nbytes = int(args.size_gib * GIB)
    work = Path(tempfile.mkdtemp(prefix="fp-resume-", dir=args.dir or REPO_ROOT))
    shm = Path(tempfile.mkdtemp(prefix="fp-resume-", dir="/dev/shm"))
    sockdir = Path(tempfile.mkdtemp(prefix="fpd-"))
    # PYTHONPATH keeps what the caller had after the repo (a machine's own wheels).
    path = os.pathsep.join(x for x in (str(REPO_ROOT), os.environ.get("PYTHONPATH")) if x)
    env = {**os.environ, "PYTHONPATH": path, "FASTPERSIST_SHM_DIR": str(shm),
           "AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench",
           "AWS_DEFAULT_REGION": "us-east-1"}
    env.pop("FASTPERSIST_DAEMON", None)
    env.pop("PYTHONDONTWRITEBYTECODE", None)  # an installed package has its bytecode
    compileall.compile_dir(str(REPO_ROOT / "fastpersist"), quiet=1)
    root = work / "root"
    root.mkdir()
    facts = machine_facts(work)
    memory_tier = ["--memory-tier-count", "1", "--memory-tier-bytes", str(2 * nbytes + GIB)]
    peer_daemon = None
    peer_args: list[str] = []
    if "peer" in methods:
        cert, key, token = tls_files(work)
        env.update(FASTPERSIST_DAEMON_CA_FILE=str(cert), FASTPERSIST_DAEMON_TOKEN_FILE=str(token))
        tls = ["--tls-cert", str(cert), "--tls-key", str(key), "--token-file", str(token),
               "--peer-tls-ca", str(cert), "--job", "resume"]
        peer_port = free_port()
        (work / "peer-root").mkdir()
        peer_shm = Path(tempfile.mkdtemp(prefix="fp-resume-peer-", dir="/dev/shm"))
        peer_daemon = start_daemon(work / "peer-root", peer_shm, sockdir / "peer.sock", env,
                                   "--listen", f"127.0.0.1:{peer_port}", *tls,
                                   "--node-name", "b", "--replica-bytes", str(3 * nbytes + GIB))
        peer_args = ["--listen", f"127.0.0.1:{free_port()}", *tls, "--node-name", "a",
                     "--replicas", "1", "--peer", f"127.0.0.1:{peer_port}"]
    daemon = start_daemon(root, shm, sockdir / "fpd.sock", env, *memory_tier, *peer_args)
    moto, endpoint = start_moto(work / "moto.log", env) if "store" in methods else (None, "")
    address = f"unix://{sockdir / 'fpd.sock'}"
    ckpt, dcp_path = root / "step-1", work / "dcp-step-1"
    url = f"s3://{BUCKET}/resume/step-1"
    where = {"path": str(ckpt), "address": address, "url": url, "endpoint": endpoint,
             "dcp_path": str(dcp_path), "peer_path": str(root / "step-peer"), "nbytes": nbytes}
    rounds: dict[str, list[dict[str, float]]] = {m: [] for m in methods}
    try:
        prepare(methods, ckpt, dcp_path, url, endpoint, address, nbytes, env)
        if peer_daemon is not None:  # then node a loses the copy the peer replicated
            wait_replicated(f"https://127.0.0.1:{peer_port}", "step-peer", env)
            shutil.rmtree(root / "step-peer")
        state_bytes = sum(f.stat().st_size for f in ckpt.glob("data-*"))
        mechanism = ""
        for r in range(args.repeats):
            order = methods[r % len(methods):] + methods[:r % len(methods)]  # rotated
            for method in order:
                if args.drop == "all":
                    mechanism = drop_page_cache([ckpt, dcp_path])
                else:
                    evict([ckpt] + ([dcp_path] if dcp_path.exists() else []))
                    mechanism = "fadvise of the checkpoints' files only"
                rounds[method].append(run_load(method, env, **where))
                print(f"round {r + 1} {method}: " + ", ".join(
                    f"{k} {v:.3f}" for k, v in rounds[method][-1].items()), flush=True)
    finally:
        daemon.terminate()
        daemon.wait(60)
        if moto is not None:
            moto.kill()
            moto.wait(60)
        if peer_daemon is not None:
            peer_daemon.terminate()
            peer_daemon.wait(60)
            shutil.rmtree(peer_shm, ignore_errors=True)
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
    if {"memory", "disk"} <= set(methods):
        for what in ("resume_s", "load_s"):
            ratio = result["disk"][what]["median"] / result["memory"][what]["median"]
            result[f"speedup_{what}"] = ratio
            print(f"memory vs disk, {what[:-2]}: {ratio:.2f}x faster (goal >= {GOAL:.0f}x: "
                  f"{'met' if ratio >= GOAL else 'NOT met'})")
    for other in (m for m in methods if m not in ("memory", "disk")):
        if "memory" in methods:
            ratio = result[other]["resume_s"]["median"] / result["memory"]["resume_s"]["median"]
            print(f"memory vs {other}, resume: {ratio:.2f}x faster")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
