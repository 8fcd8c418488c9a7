"""What checkpointing costs a training loop: trainer-visible stall and lost throughput.

A GPT-2-style transformer (examples/gpt.py, torch.nn, AdamW) trains on the CPU
and checkpoints model + optimizer every step and every 10 steps with:

    fastpersist      Checkpointer.save (async_save: snapshot, then background persist)
    torch.save       torch.save + fsync (synchronous, durable)
    dcp.async_save   torch.distributed.checkpoint.async_save (1-process gloo group)
    copy floor       a plain copy of the same bytes into preallocated memory:
                     the least any consistent snapshot can cost
    write floor      (--modes ...,write) the copy floor into one page-aligned
                     buffer, then that buffer written to a file with O_DIRECT
                     (8 MiB pwrites) and fsynced by a background thread at
                     fastpersist's background priority: no checksums, no
                     manifest, no rename, one checkpoint in flight (as
                     fastpersist's default). What a bare durable write of
                     these bytes costs the trainer on this machine (the
                     write's own CPU, the kernel's and the hypervisor's I/O
                     work on the same cores, the memory traffic); a writer
                     with more I/Os in flight might cost a little less.
    fastpersist+tier (--modes ...,tier,tier-raw) the same Checkpointer with tier=
                     a local moto S3 server: each checkpoint also uploaded in the
                     background, compressed (the default; tier-raw: as it is);
                     every 10 steps only (uploads of every step would only queue
                     up). Between measurements the uploads are drained, untimed.
                     moto shares the machine's cores with the trainer, which a
                     remote store would not: it runs at nice 19, and its CPU
                     time is printed.
    fastpersist memory (--modes ...,memory) Checkpointer(memory_every=1) through
                     a local fastpersistd (--memory-tier-count 2): every step
                     a memory-only checkpoint, kept in the daemon's memory tier
                     and never written to disk; every step only. The daemon
                     shares the machine's cores with the trainer. Its peak RSS
                     (VmHWM) and the tier's bytes are printed, with each
                     round's throughput loss next to the copy floor's (goal:
                     at most 1.1x the floor's loss, issue 35).

For each mode, in the same run and alternating over repeats: the median stall
(time the training loop spends inside the checkpoint call) and steps/s, with
the time to finish the last checkpoint counted. Targets: fastpersist stall
<= 1.3x the copy floor; throughput loss <= 3% checkpointing every 10 steps and
<= 10% every step; staging memory <= 1x the checkpointed bytes.

    python benchmarks/train_overhead.py [--steps 20] [--repeats 2] [--dir DIR]
"""

from __future__ import annotations

import argparse
import errno
import mmap
import os
import shutil
import socket
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from gpt import GPT, GPTConfig, tensors_of, train_step, unique_bytes

import fastpersist
from fastpersist.background import lower_this_thread


def state_of(model: GPT, opt: torch.optim.Optimizer, step: int) -> dict[str, Any]:
    return {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step}


def fsync_tree(path: Path) -> None:
    for p in [path, *path.rglob("*")] if path.is_dir() else [path]:
        fd = os.open(p, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)
    fd = os.open(path.parent, os.O_RDONLY)
    os.fsync(fd)
    os.close(fd)


class Mode:
    """A way to checkpoint: `checkpoint` is the trainer-visible call, `finish`
    waits for whatever is still in the background."""

    name = ""
    first_stall: float | None = None  # the process's first checkpoint (cold staging)
    cadences = (1, 10)  # checkpoint every N steps: the measurements this mode takes part in

    def setup(self, root: Path) -> None:
        self.root = root

    def checkpoint(self, state: dict[str, Any], step: int) -> None:
        raise NotImplementedError

    def finish(self) -> None:
        pass

    def settle(self) -> None:
        """After a measurement, untimed: let background work end before the next."""

    def staging_bytes(self) -> int | None:
        return None


class NoCheckpoint(Mode):
    name = "no checkpoint"

    def checkpoint(self, state: dict[str, Any], step: int) -> None:
        pass


class Fastpersist(Mode):
    name = "fastpersist async"

    def setup(self, root: Path) -> None:
        super().setup(root)
        self.ckpt = fastpersist.Checkpointer(root, keep_last=2)

    def checkpoint(self, state: dict[str, Any], step: int) -> None:
        self.ckpt.save(step, state)

    def finish(self) -> None:
        self.ckpt.wait()

    def staging_bytes(self) -> int | None:
        return self.ckpt.staging_bytes


class FastpersistTier(Fastpersist):
    name = "fastpersist+tier"
    cadences = (10,)
    endpoint = ""  # the local moto server (main)
    compression = "zstd"

    def setup(self, root: Path) -> None:
        Mode.setup(self, root)
        self.ckpt = fastpersist.Checkpointer(
            root, keep_last=2, tier=f"s3://fp-train/{root.name}", tier_endpoint=self.endpoint,
            tier_keep_last=2, tier_compression=self.compression)
        self.drained: list[float] = []

    def settle(self) -> None:
        start = time.perf_counter()
        if not self.ckpt.wait_for_tier(timeout=600):
            raise SystemExit(f"uploads did not finish: {self.ckpt.tier_status()}")
        self.drained.append(time.perf_counter() - start)


class FastpersistMemory(Fastpersist):
    name = "fastpersist memory"
    cadences = (1,)
    address = ""  # the local fastpersistd (start_daemon)
    daemon_root = Path()

    def setup(self, root: Path) -> None:
        Mode.setup(self, root)
        # Every step memory-only: disk_every names no step the loop reaches.
        self.ckpt = fastpersist.Checkpointer(self.daemon_root / root.name, daemon=self.address,
                                             memory_every=1, disk_every=1 << 62)


def start_daemon(base: Path, nbytes: int, shm: Path, mode: type[FastpersistMemory]) -> Any:
    """fastpersistd with its memory tier on (2 copies, 3x the checkpoint's
    bytes), its segments in `shm` (a fresh directory of /dev/shm)."""
    import subprocess

    os.environ["FASTPERSIST_SHM_DIR"] = str(shm)
    root = base / f"fpd-root-{mode.__name__}"
    sock = Path(tempfile.mkdtemp(prefix="fpd-")) / "fpd.sock"
    root.mkdir(parents=True)
    proc = subprocess.Popen(
        [sys.executable, "-m", "fastpersist.daemon", "--root", str(root), "--socket", str(sock),
         "--shm-dir", str(shm), "--memory-tier-count", "2", "--memory-tier-bytes",
         str(3 * nbytes + (64 << 20)), "--log-level", "warning"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while not sock.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit("fastpersistd did not start")
        time.sleep(0.05)
    mode.address, mode.daemon_root = f"unix://{sock}", root
    return proc


def daemon_memory(proc: Any, mode: type[FastpersistMemory], saves: int) -> str:
    """The daemon's peak RSS and where its memory is now (/proc), the tier's
    bytes, and its CPU time per save (`saves` of them)."""
    with open(f"/proc/{proc.pid}/stat") as f:
        ticks = f.read().rpartition(")")[2].split()
    cpu = (int(ticks[11]) + int(ticks[12])) / os.sysconf("SC_CLK_TCK")
    fields = {}
    with open(f"/proc/{proc.pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmHWM", "VmRSS", "RssAnon", "RssFile", "RssShmem"):
                fields[key] = int(value.split()[0]) / 1024
    from fastpersist.protocol.client import DaemonClient

    client = DaemonClient(mode.address)
    try:
        info = client.info()
    finally:
        client.close()
    return (f"fastpersistd ({mode.name}): peak RSS (VmHWM) {fields['VmHWM']:.0f} MiB; now RSS "
            f"{fields['VmRSS']:.0f} MiB (anon {fields['RssAnon']:.0f}, file "
            f"{fields['RssFile']:.0f}, shmem {fields['RssShmem']:.0f}: the trainer's segments "
            f"it maps); memory tier {info.memory_tier_bytes / 2**20:.0f} MiB in "
            f"{info.memory_tier_copies} copies (budget {info.memory_tier_budget / 2**20:.0f} "
            f"MiB, tmpfs pages, not RSS); CPU {cpu:.1f} s over {saves} saves, "
            f"{cpu / max(saves, 1) * 1000:.0f} ms a save")


class FastpersistTierRaw(FastpersistTier):
    name = "fastpersist+tier raw"
    compression = "none"


def start_store(base: Path) -> Any:
    """A moto S3 server with the bucket the tier mode uploads to."""
    import boto3
    from tier import start_moto

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = start_moto(port, base / "moto.log")
    # At the lowest priority: it stands in for a remote store, whose CPU is not
    # the trainer's (its CPU time is printed at the end).
    os.setpriority(os.PRIO_PROCESS, proc.pid, 19)
    FastpersistTier.endpoint = f"http://127.0.0.1:{port}"
    boto3.client("s3", endpoint_url=FastpersistTier.endpoint, region_name="us-east-1",
                 aws_access_key_id="x", aws_secret_access_key="x").create_bucket(Bucket="fp-train")
    return proc


def keep_last_two(written: list[Path], path: Path) -> None:
    """Retention as the other modes have it (keep_last=2), whatever the cadence."""
    written.append(path)
    while len(written) > 2:
        written.pop(0).unlink(missing_ok=True)


class TorchSave(Mode):
    name = "torch.save+fsync"

    def setup(self, root: Path) -> None:
        super().setup(root)
        self.written: list[Path] = []

    def checkpoint(self, state: dict[str, Any], step: int) -> None:
        path = self.root / f"step-{step}.pt"
        torch.save(state, path)
        fsync_tree(path)
        keep_last_two(self.written, path)


class DcpAsync(Mode):
    name = "dcp.async_save"

    def setup(self, root: Path) -> None:
        super().setup(root)
        import torch.distributed as dist
        import torch.distributed.checkpoint as dcp

        self.dcp = dcp
        if not dist.is_initialized():
            dist.init_process_group("gloo", init_method=f"file://{root}/.pg", rank=0,
                                    world_size=1)
        self.future: Any = None

    def checkpoint(self, state: dict[str, Any], step: int) -> None:
        if self.future is not None:
            self.future.result()  # DCP's documented pattern: one in flight
        self.future = self.dcp.async_save(state, checkpoint_id=str(self.root / f"step-{step}"))

    def finish(self) -> None:
        if self.future is not None:
            self.future.result()
            self.future = None


class CopyFloor(Mode):
    name = "copy floor"

    def checkpoint(self, state: dict[str, Any], step: int) -> None:
        tensors = tensors_of(state)
        if not hasattr(self, "buffers"):
            self.buffers = [torch.empty_like(t) for t in tensors]  # allocated once
        for buf, t in zip(self.buffers, tensors, strict=True):
            buf.copy_(t)


class WriteFloor(Mode):
    name = "write floor"
    BLOCK = 8 << 20

    def setup(self, root: Path) -> None:
        super().setup(root)
        self.writing: threading.Thread | None = None
        self.failure: BaseException | None = None
        self.written: list[Path] = []

    def checkpoint(self, state: dict[str, Any], step: int) -> None:
        self.finish()  # one buffer: the previous write must have read it
        tensors = tensors_of(state)
        if not hasattr(self, "views"):  # allocated and touched once
            size = sum(t.nbytes for t in tensors)
            self.size = -(-size // 4096) * 4096  # O_DIRECT writes whole blocks
            self.memory = mmap.mmap(-1, self.size)  # page-aligned, as O_DIRECT needs
            flat = torch.frombuffer(self.memory, dtype=torch.uint8)
            flat.fill_(0)
            self.views, offset = [], 0
            for t in tensors:
                self.views.append(flat[offset:offset + t.nbytes].view(t.dtype).view(t.shape))
                offset += t.nbytes
        for view, t in zip(self.views, tensors, strict=True):
            view.copy_(t)
        self.writing = threading.Thread(target=self._write, args=(step,))
        self.writing.start()

    def _write(self, step: int) -> None:
        try:
            lower_this_thread()  # as fastpersist's background threads
            path = self.root / f"step-{step}.bin"
            flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
            try:
                fd = os.open(path, flags | os.O_DIRECT, 0o644)
            except OSError as exc:  # a filesystem without O_DIRECT (tmpfs): as fastpersist does
                if exc.errno != errno.EINVAL:
                    raise
                fd = os.open(path, flags, 0o644)
            try:
                whole = memoryview(self.memory)
                offset = 0
                while offset < self.size:  # (a short write is resumed, not ignored)
                    offset += os.pwrite(fd, whole[offset:offset + self.BLOCK], offset)
                os.fsync(fd)
            finally:
                os.close(fd)
            keep_last_two(self.written, path)
        except BaseException as exc:  # raised in the training thread by finish()
            self.failure = exc

    def finish(self) -> None:
        if self.writing is not None:
            self.writing.join()
            self.writing = None
        if self.failure is not None:
            raise self.failure


MODES: dict[str, Callable[[], Mode]] = {
    "none": NoCheckpoint, "fastpersist": Fastpersist, "torch": TorchSave, "dcp": DcpAsync,
    "copy": CopyFloor, "write": WriteFloor, "tier": FastpersistTier,
    "tier-raw": FastpersistTierRaw, "memory": FastpersistMemory,
}


def run(mode: Mode, model: GPT, opt: torch.optim.Optimizer, first_step: int, steps: int,
        every: int, batch: int) -> tuple[float, list[float]]:
    stalls = []
    start = time.perf_counter()
    for step in range(first_step, first_step + steps):
        train_step(model, opt, step, batch)
        if (step + 1) % every == 0:
            t0 = time.perf_counter()
            mode.checkpoint(state_of(model, opt, step), step)
            stall = time.perf_counter() - t0
            if mode.first_stall is None:
                mode.first_stall = stall  # reported on its own: not a warm save
            else:
                stalls.append(stall)
    mode.finish()
    return steps / (time.perf_counter() - start), stalls


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--steps", type=int, default=20, help="training steps per measurement")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--modes", default="none,fastpersist,torch,dcp,copy,write")
    p.add_argument("--every", default="1,10",
                   help="checkpoint cadences to measure, comma-separated (of 1 and 10)")
    p.add_argument("--dir", default=None, help="checkpoint directory (default: under /var/tmp)")
    p.add_argument("--dim", type=int, default=512)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--vocab", type=int, default=16384)
    p.add_argument("--ctx", type=int, default=128)
    p.add_argument("--batch", type=int, default=4)
    args = p.parse_args()
    torch.manual_seed(0)
    base = Path(args.dir or tempfile.mkdtemp(prefix="fp-train-", dir="/var/tmp"))
    cfg = GPTConfig(vocab=args.vocab, ctx=args.ctx, dim=args.dim, layers=args.layers,
                    heads=args.dim // 64)
    model = GPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    train_step(model, opt, 0, args.batch)  # optimizer state exists from here on
    nbytes = unique_bytes(state_of(model, opt, 0))
    print(f"command: {' '.join(sys.argv)}")
    print(f"model: {sum(t.numel() for t in model.parameters()) / 1e6:.1f}M params, "
          f"checkpoint {nbytes / 2**20:.0f} MiB; torch threads {torch.get_num_threads()}; "
          f"dir {base}")
    modes = {name: MODES[name]() for name in args.modes.split(",")}
    cadences = [int(every) for every in args.every.split(",")]
    if not set(cadences) <= {1, 10}:
        raise SystemExit("--every: 1, 10 or both")
    store = start_store(base) if any(isinstance(m, FastpersistTier)
                                     for m in modes.values()) else None
    if store is not None:  # the credentials boto3 finds for the tier (moto takes any)
        os.environ.setdefault("AWS_ACCESS_KEY_ID", "x")
        os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "x")
        os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
    shm = Path(tempfile.mkdtemp(prefix="fp-train-", dir="/dev/shm"))
    daemons = {name: (start_daemon(base, nbytes, shm, type(mode)), type(mode))
               for name, mode in modes.items() if isinstance(mode, FastpersistMemory)}
    for name, mode in modes.items():
        (base / name).mkdir(parents=True, exist_ok=True)
        mode.setup(base / name)
    results: dict[tuple[str, int], list[tuple[float, list[float]]]] = {}
    step = 1
    for rep in range(args.repeats):
        names = list(modes)
        names = names[rep % len(names):] + names[: rep % len(names)]  # rotate the order
        for every in cadences:
            for name in names:
                if every not in modes[name].cadences:
                    continue
                steps = args.steps if every == 1 else max(args.steps, 30)
                rate, stalls = run(modes[name], model, opt, step, steps, every, args.batch)
                modes[name].settle()
                step += steps
                results.setdefault((name, every), []).append((rate, stalls))
                med = statistics.median(stalls) if stalls else 0.0
                print(f"  [{rep + 1}/{args.repeats}] every {every:2d}: {name:18s} "
                      f"{rate:.3f} steps/s  stall median {med * 1000:8.1f} ms", flush=True)
    print_report(results, modes, nbytes)
    print_memory_rounds(results, modes)
    for name, (daemon, kind) in daemons.items():
        saves = sum(len(stalls) for _, stalls in results.get((name, 1), [])) + 1
        print(daemon_memory(daemon, kind, saves))
        modes[name].ckpt.close()  # type: ignore[attr-defined]
        daemon.terminate()
        daemon.wait()
    shutil.rmtree(shm, ignore_errors=True)
    for mode in modes.values():
        if isinstance(mode, FastpersistTier):
            mode.ckpt.close()
            print(f"{mode.name}: uploads drained {statistics.median(mode.drained):.2f} s "
                  "(median) after each measurement's last checkpoint")
    if store is not None:
        with open(f"/proc/{store.pid}/stat") as f:
            fields = f.read().rpartition(")")[2].split()
        ticks = os.sysconf("SC_CLK_TCK")
        print(f"moto server CPU over the run: {(int(fields[11]) + int(fields[12])) / ticks:.1f} s")
        store.kill()
    shutil.rmtree(base, ignore_errors=True)
    return 0


def print_report(results: dict[tuple[str, int], list[tuple[float, list[float]]]],
                 modes: dict[str, Mode], nbytes: int) -> None:
    def rate(name: str, every: int) -> float:
        return statistics.median(r for r, _ in results[(name, every)])

    def stall(name: str, every: int) -> float:
        all_stalls = [s for _, stalls in results[(name, every)] for s in stalls]
        return statistics.median(all_stalls) if all_stalls else 0.0

    print("\n== steps/s (median) and loss against no checkpointing; stall per checkpoint"
          " (median, from each mode's second checkpoint on: warm)")
    print(f"  {'mode':18s} {'every':>5s} {'steps/s':>8s} {'loss':>7s} {'+ms/step':>9s} "
          f"{'stall ms':>9s} {'x floor':>8s}")
    for every in (1, 10):
        base_rate = rate("none", every) if ("none", every) in results else None
        floor = stall("copy", every) if ("copy", every) in results else None
        for name in modes:
            if name == "none" or (name, every) not in results:
                continue
            r, s = rate(name, every), stall(name, every)
            loss = f"{(1 - r / base_rate) * 100:6.1f}%" if base_rate else "     -"
            # What a step costs beyond no checkpointing: stall plus the background's share.
            extra = f"{(1 / r - 1 / base_rate) * 1000:9.1f}" if base_rate else "        -"
            ratio = f"{s / floor:7.2f}x" if floor else "       -"
            print(f"  {modes[name].name:18s} {every:5d} {r:8.3f} {loss:>7s} {extra:>9s} "
                  f"{s * 1000:9.1f} {ratio:>8s}")
    firsts = [f"{m.name} {m.first_stall * 1000:.0f} ms" for m in modes.values()
              if m.first_stall is not None and not isinstance(m, NoCheckpoint)]
    if firsts:
        print("first checkpoint of the process (cold): " + ", ".join(firsts))
    if "fastpersist" in modes:
        staging = modes["fastpersist"].staging_bytes() or 0
        print(f"\nfastpersist staging memory: {staging / 2**20:.0f} MiB "
              f"({staging / nbytes:.2f}x the checkpointed bytes)")
    print("targets: stall <= 1.3x copy floor (<= 1.1x from the second save on, issue 14); "
          "loss <= 3% every 10 steps, <= 10% every step; staging <= 1x")


def print_memory_rounds(results: dict[tuple[str, int], list[tuple[float, list[float]]]],
                        modes: dict[str, Mode]) -> None:
    """Every step: each round's throughput loss against that round's no
    checkpointing (and the time it adds to a step), for the memory-only modes
    and the copy floor; medians [min-max] over the rounds."""
    if ("none", 1) not in results or ("copy", 1) not in results:
        return
    base = [r for r, _ in results[("none", 1)]]

    def losses(name: str) -> list[float]:
        return [1 - r / b for (r, _), b in zip(results[(name, 1)], base, strict=True)]

    def added_ms(name: str) -> list[float]:
        return [(1 / r - 1 / b) * 1000 for (r, _), b in zip(results[(name, 1)], base,
                                                               strict=True)]

    def shown(values: list[float], unit: str, scale: float = 1.0) -> str:
        return (f"{statistics.median(values) * scale:6.1f}{unit} "
                f"[{min(values) * scale:.1f} to {max(values) * scale:.1f}]")

    print(f"\n== every step, against no checkpointing, {len(base)} interleaved rounds: "
          "median [min to max]")
    floor = losses("copy")
    names = ["copy"] + [n for n, m in modes.items() if isinstance(m, FastpersistMemory)]
    for name in names:
        print(f"  {modes[name].name:22s} loss {shown(losses(name), '%', 100)}   "
              f"+ms/step {shown(added_ms(name), '')}")
    for name in names[1:]:
        mem = losses(name)
        if statistics.median(floor) > 0:
            print(f"  {modes[name].name}: loss / copy floor's loss "
                  f"{statistics.median(mem) / statistics.median(floor):.2f}x (of the medians; "
                  "goal <= 1.1x)")


if __name__ == "__main__":
    raise SystemExit(main())
