"""Replication throughput between two fastpersistd on loopback TCP vs the loopback ceiling.

    python benchmarks/replication.py                   # 1 GiB checkpoint, 5 rounds
    python benchmarks/replication.py --size-gib 0.25 --rounds 3 --json out.json
    python benchmarks/replication.py --dir /mnt/nvme0/bench   # the senders' root there

Starts two daemons on 127.0.0.1 with TLS and a token: a receiver (--replica-bytes
twice the checkpoint) and a sender (--replicas 1 --peer RECEIVER). Their roots and
--shm-dir are under --dir (default /dev/shm: the sender reads the checkpoint from
memory, so the disk is not what is measured). In each round, in alternating order:
- replication: a save of the checkpoint through the sender (not timed), then the
  time from its commit to the receiver's acknowledgement, from the sender's
  `replicated` log line (TLS, gRPC, a CRC32C per 4 MiB chunk on both sides, the
  receiver's write into its tmpfs, the peer's Info first);
- ceiling: the same data files read in 4 MiB pieces and sent over a plain
  loopback TCP socket (no TLS, no gRPC, no CRC) to a receiver process that
  writes them into a file in --dir; timed from connect to its acknowledgement.
Reported: median GB/s and spread [min-max] over the rounds, and the ratio of the
medians (goal, issue 35: >= 0.8x), and the receiver daemon's peak RSS (VmHWM).
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
GIB = 1 << 30
CHUNK = 4 << 20
GOAL = 0.8

RECEIVER = r"""
import os, socket, sys
out, total = sys.argv[1], int(sys.argv[2])
srv = socket.socket(); srv.bind(("127.0.0.1", 0)); srv.listen(1)
print(srv.getsockname()[1], flush=True)
while True:
    conn, _ = srv.accept()
    fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    buf = bytearray(4 << 20); view = memoryview(buf); got = 0
    while got < total:
        n = conn.recv_into(view)
        if not n:
            break
        os.write(fd, view[:n]); got += n
    os.close(fd)
    conn.sendall(b"k" if got == total else b"x"); conn.close()
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _tls(directory: Path) -> dict[str, Path]:
    cert, key, token = directory / "cert.pem", directory / "key.pem", directory / "token"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt",
                    "ec_paramgen_curve:prime256v1", "-nodes", "-keyout", str(key), "-out",
                    str(cert), "-days", "1", "-subj", "/CN=localhost", "-addext",
                    "subjectAltName=DNS:localhost,IP:127.0.0.1"],
                   check=True, capture_output=True)
    token.write_text(secrets.token_hex(16) + "\n")
    return {"cert": cert, "key": key, "token": token}


class Daemon:
    def __init__(self, base: Path, name: str, tls: dict[str, Path], *args: str) -> None:
        self.root, self.shm = base / name / "root", base / name / "shm"
        self.root.mkdir(parents=True)
        self.shm.mkdir()
        self.socket = Path(tempfile.mkdtemp(prefix="fpb-")) / "fpd.sock"
        self.port = _free_port()
        self.log = base / f"{name}.log"
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "fastpersist.daemon", "--root", str(self.root),
                 "--socket", str(self.socket), "--shm-dir", str(self.shm),
                 "--listen", f"127.0.0.1:{self.port}", "--tls-cert", str(tls["cert"]),
                 "--tls-key", str(tls["key"]), "--token-file", str(tls["token"]),
                 "--peer-tls-ca", str(tls["cert"]), "--node-name", name, *args],
                stdout=log, stderr=log)
        from fastpersist.protocol.client import DaemonClient

        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.socket.exists():
                client = DaemonClient(f"unix://{self.socket}")
                try:
                    if client.health(timeout=2.0) == "SERVING":
                        return
                except Exception:
                    pass
                finally:
                    client.close()
            time.sleep(0.1)
        raise SystemExit(f"{name} did not start:\n{self.log.read_text()}")

    def events(self, name: str) -> list[dict[str, Any]]:
        out = []
        for line in self.log.read_text().splitlines():
            try:
                doc = json.loads(line)
            except ValueError:
                continue
            if doc.get("event") == name:
                out.append(doc)
        return out

    def peak_rss(self) -> int:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) << 10
        return 0

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(60)
        shutil.rmtree(self.socket.parent, ignore_errors=True)


def replicate_once(sender: Daemon, state: dict[str, Any], nbytes: int) -> float:
    import fastpersist

    before = len(sender.events("replicated"))
    os.environ["FASTPERSIST_SHM_DIR"] = str(sender.shm)
    fastpersist.save(state, sender.root / "ck", daemon=f"unix://{sender.socket}")
    deadline = time.monotonic() + 600
    while len(sender.events("replicated")) == before:
        if time.monotonic() > deadline:
            raise SystemExit("replication did not finish in 600 s")
        time.sleep(0.05)
    return nbytes / float(sender.events("replicated")[-1]["seconds"])


def ceiling_once(files: list[Path], port: int) -> float:
    total = sum(f.stat().st_size for f in files)
    t0 = time.perf_counter()
    with socket.create_connection(("127.0.0.1", port)) as s:
        for f in files:
            fd = os.open(f, os.O_RDONLY)
            try:
                offset = 0
                while chunk := os.pread(fd, CHUNK, offset):
                    s.sendall(chunk)
                    offset += len(chunk)
            finally:
                os.close(fd)
        if s.recv(1) != b"k":
            raise SystemExit("the ceiling's receiver got the wrong number of bytes")
    return total / (time.perf_counter() - t0)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size-gib", type=float, default=1.0)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--dir", type=Path, default=Path("/dev/shm"))
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    import torch

    nbytes = int(args.size_gib * GIB)
    pieces = 16
    state = {f"t{i}": torch.full((nbytes // pieces // 4,), float(i)) for i in range(pieces)}
    nbytes = sum(t.nbytes for t in state.values())
    base = Path(tempfile.mkdtemp(prefix="fp-repl-bench-", dir=args.dir))
    tls = _tls(base)
    daemons: list[Daemon] = []
    ceiling_proc = None
    try:
        receiver = Daemon(base, "receiver", tls, "--replica-bytes",
                          str(2 * nbytes + (64 << 20)))
        daemons.append(receiver)
        sender = Daemon(base, "sender", tls, "--replicas", "1",
                        "--peer", f"127.0.0.1:{receiver.port}")
        daemons.append(sender)
        results: dict[str, list[float]] = {"replication": [], "ceiling": []}
        for r in range(args.rounds):
            order = ["replication", "ceiling"] if r % 2 == 0 else ["ceiling", "replication"]
            for method in order:
                if method == "replication":
                    results[method].append(replicate_once(sender, state, nbytes))
                    continue
                if not (sender.root / "ck").exists():
                    replicate_once(sender, state, nbytes)  # the files to copy
                files = sorted((sender.root / "ck").glob("data-*"))
                if ceiling_proc is None:
                    total = sum(f.stat().st_size for f in files)
                    ceiling_proc = subprocess.Popen(
                        [sys.executable, "-c", RECEIVER, str(base / "ceiling.bin"), str(total)],
                        stdout=subprocess.PIPE)
                    assert ceiling_proc.stdout is not None
                    port = int(ceiling_proc.stdout.readline())
                results[method].append(ceiling_once(files, port))
            print(f"round {r + 1}: " + ", ".join(f"{m} {results[m][-1] / 1e9:.2f} GB/s"
                                                 for m in order), flush=True)
        rss = receiver.peak_rss()
    finally:
        if ceiling_proc is not None:
            ceiling_proc.kill()
        for d in daemons:
            d.stop()
        shutil.rmtree(base, ignore_errors=True)
    med = {m: statistics.median(v) for m, v in results.items()}
    print(f"\n{nbytes / GIB:.2f} GiB checkpoint, {args.rounds} rounds, loopback, {os.cpu_count()} "
          f"CPUs; roots in {args.dir}")
    for m, v in results.items():
        print(f"  {m:12s} {med[m] / 1e9:6.2f} GB/s  [{min(v) / 1e9:.2f}-{max(v) / 1e9:.2f}]")
    ratio = med["replication"] / med["ceiling"]
    print(f"  ratio        {ratio:.2f}x of the loopback ceiling (goal >= {GOAL}x: "
          f"{'met' if ratio >= GOAL else 'NOT met'})")
    print(f"  receiver daemon peak RSS: {rss / (1 << 20):.0f} MiB")
    if args.json:
        args.json.write_text(json.dumps({"bytes": nbytes, "results": results, "ratio": ratio,
                                         "receiver_peak_rss": rss}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
