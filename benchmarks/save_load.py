"""Durable save and cold load throughput of fastpersist against its peers and the disk's ceiling.

    python benchmarks/save_load.py                       # 4 GiB state, 3 repeats, everything
    python benchmarks/save_load.py --size-gib 0.5 --repeats 1
    python benchmarks/save_load.py --methods fastpersist,torch,fio --json out.json
    python benchmarks/save_load.py --tensors 100000 --repeats 5   # many small tensors
    python benchmarks/save_load.py --sizes 64M,256M,1G --repeats 5  # time vs bytes

Every method saves the same seeded GPT+AdamW state; every save is durable (data, then the
directory entry, fsynced); every load starts from a cold page cache. Methods alternate
within a repeat (rotated each repeat) so slow drift on a shared disk hits them all alike,
and tables report medians. Each measurement runs in its own process, which also gives the
peak RSS increase of the call alone. See benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import compileall
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import _fio
from _report import Record, Summary, Target, ceiling, memory_target, ratio_lines, summarize, table
from _scaling import parse_size, scaling_table
from _state import SMALL_TENSOR_BYTES, spec_from
from _system import GIB, drop_page_cache, machine_facts, mount_of, tool_version

HERE = Path(__file__).resolve().parent
REPO_ROOT = HERE.parent
WORKER = HERE / "_worker.py"
# "baseline" (another fastpersist, --baseline DIR) is measured only when asked for;
# "baseline_into" (its load(into=)) when listed in --methods with --baseline.
BASELINES = ("baseline", "baseline_into")
ALL_METHODS = ("fastpersist", "into", "loadcopy", *BASELINES, "torch", "safetensors", "dcp",
               "torchckpt", "deepspeed", "fio")
LOADERS = ("fastpersist", "into", "loadcopy", *BASELINES, "torch", "safetensors", "dcp",
           "torchckpt")
SAVE_GOALS = {"fio write ceiling": 0.85, "torch": 8.0, "deepspeed": 1.5, "torchckpt": 1.0}
LOAD_GOALS = {"fio read ceiling": 0.8, "torch": 1.0, "safetensors": 1.0, "dcp": 1.0,
              "torchckpt": 1.0}
# Many small tensors (issue 14): ahead of both peers, saving and loading.
SMALL_GOALS = {"torch": 1.0, "safetensors": 1.0}
SMALL_METHODS = "fastpersist,torch,safetensors"
MEMORY_FILESYSTEMS = {"tmpfs", "ramfs", "devtmpfs"}


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--size-gib", type=float, default=4.0, help="state size in GiB (default 4)")
    parser.add_argument(
        "--repeats", type=int, default=3, help="measurements per method and phase (default 3)"
    )
    parser.add_argument(
        "--methods",
        help=f"comma-separated subset of {','.join(ALL_METHODS)} (default: all; with --tensors"
        f" or --sizes: {SMALL_METHODS})",
    )
    parser.add_argument(
        "--tensors", type=int, help="a state of this many small tensors instead of the GPT state"
    )
    parser.add_argument(
        "--tensor-bytes",
        type=int,
        help=f"average bytes of each small tensor (default {SMALL_TENSOR_BYTES}); with --sizes,"
        " each size is made of small tensors of this size instead of the GPT state",
    )
    parser.add_argument(
        "--sizes", help="time vs bytes: measure at each of these state sizes (e.g. 64M,256M,1G)"
    )
    parser.add_argument(
        "--baseline",
        type=Path,
        help="also measure the fastpersist package in this directory (DIR/fastpersist, e.g. an"
        " export of main with its built _engine) as method 'baseline', interleaved with the rest",
    )
    parser.add_argument(
        "--dir", type=Path, help="target directory on the disk under test (default: /var/tmp)"
    )
    parser.add_argument("--json", type=Path, help="write raw results and summaries to this file")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--skip-load", action="store_true", help="measure saves only")
    parser.add_argument(
        "--keep", action="store_true", help="leave the written checkpoints in place"
    )
    parser.add_argument(
        "--timeout", type=float, default=3600.0, help="seconds allowed per measured process"
    )
    args = parser.parse_args(argv)
    if args.tensors is not None and args.sizes:
        parser.error("--tensors and --sizes do not go together (--sizes with --tensor-bytes)")
    if args.methods is None:
        small = args.tensors is not None or args.sizes
        args.methods = SMALL_METHODS if small else ",".join(
            m for m in ALL_METHODS if m not in BASELINES)
    if args.baseline is not None:
        if not (args.baseline / "fastpersist" / "__init__.py").is_file():
            parser.error(f"--baseline {args.baseline}: no fastpersist package there")
        args.baseline = args.baseline.resolve()
        if "baseline" not in args.methods.split(","):
            args.methods += ",baseline"
    elif "baseline_into" in args.methods.split(","):
        parser.error("method baseline_into needs --baseline DIR")
    try:
        args.sizes = [parse_size(s) for s in args.sizes.split(",")] if args.sizes else None
    except ValueError as exc:
        parser.error(str(exc))
    if (args.tensors is not None and args.tensors < 1) or (
        args.tensor_bytes is not None and args.tensor_bytes < 1
    ):
        parser.error("--tensors and --tensor-bytes must be positive")
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = sorted(set(methods) - set(ALL_METHODS))
    if unknown:
        parser.error(f"unknown methods {unknown}; choose from {', '.join(ALL_METHODS)}")
    if args.repeats < 1 or args.size_gib <= 0:
        parser.error("--repeats and --size-gib must be positive")
    args.methods = [m for m in ALL_METHODS if m in methods]
    return args


class Bench:
    """One run: a scratch directory, the selected methods, and the records they produce."""

    def __init__(self, args: argparse.Namespace, workdir: Path, state: dict[str, Any]) -> None:
        self.args = args
        self.workdir = workdir
        self.state = state  # what _state.spec_from builds, in every worker
        self.spec = spec_from(state, args.seed)
        self.state_bytes = self.spec.nbytes
        self.records: list[Record] = []
        self.skipped: dict[str, str] = {}
        self.fio_file = workdir / "fio.data"
        self.fio_size = _fio.fio_size(self.state_bytes)

    # ---- processes -------------------------------------------------------------------

    def worker(self, op: str, method: str, path: Path | None = None) -> dict[str, Any]:
        """Run one job in a fresh interpreter; its output goes to a log shown only on failure."""
        job_file, result_file, log_file = (
            self.workdir / n for n in ("job.json", "result.json", "worker.log")
        )
        result_file.unlink(missing_ok=True)
        job = {"op": op, "method": method, "path": str(path), "state": self.state}
        if method in BASELINES:
            job["baseline"] = str(self.args.baseline)
        job |= {"seed": self.args.seed, "result": str(result_file)}
        job_file.write_text(json.dumps(job))
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        try:
            with open(log_file, "w") as log:
                subprocess.run(
                    [sys.executable, str(WORKER), str(job_file)],
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env=env,
                    timeout=self.args.timeout,
                    check=False,
                )
        except subprocess.TimeoutExpired:
            return {"error": f"timed out after {self.args.timeout:.0f} s"}
        if not result_file.exists():
            tail = log_file.read_text(errors="replace").strip().splitlines()[-15:]
            return {"error": "worker died without a result:\n      " + "\n      ".join(tail)}
        result: dict[str, Any] = json.loads(result_file.read_text())
        if "error" in result:
            tail = log_file.read_text(errors="replace").strip().splitlines()[-15:]
            result["error"] += "\n      " + "\n      ".join(tail)
        return result

    def output_path(self, method: str) -> Path:
        from _peers import METHODS  # imports torch: only needed here, not for --help

        return self.workdir / f"{method}.ckpt{METHODS[method].suffix}"

    # ---- phases ----------------------------------------------------------------------

    def probe(self) -> list[str]:
        """Methods usable here; the others are reported as skipped with the reason."""
        usable: list[str] = []
        for method in self.args.methods:
            if method == "fio":
                reason = _fio.available()
            else:
                # DeepSpeed's first probe on a machine JIT-compiles its ops: minutes, once.
                print(f"  probing {method} ...", flush=True)
                result = self.worker("probe", method)
                reason = result.get("skip") or result.get("error")
            if reason:
                self.skipped[method] = reason
                print(f"  {method}: skipped: {reason}", flush=True)
            else:
                usable.append(method)
        return usable

    def schedule(
        self, methods: list[str], shapes: tuple[_fio.FioShape, ...], repeat: int
    ) -> list[str | _fio.FioShape]:
        """Methods and fio shapes of one repeat, rotated so no one always runs first."""
        items: list[str | _fio.FioShape] = [m for m in methods if m != "fio"]
        if "fio" in methods:
            items.extend(shapes)
        shift = repeat % len(items) if items else 0
        return items[shift:] + items[:shift]

    def run_fio(self, phase: str, shape: _fio.FioShape, repeat: int) -> Record:
        record = Record(phase, "fio", shape.label, repeat, self.fio_size)
        if shape.rw == "write":
            self.fio_file.unlink(missing_ok=True)  # fresh allocation, like every method's save
        drop_page_cache([self.fio_file])
        try:
            result = _fio.run(shape, self.fio_file, self.fio_size)
            record.nbytes, record.seconds = result.nbytes, result.seconds
        except Exception as exc:
            record.error = f"{type(exc).__name__}: {exc}"
        return record

    def run_method(self, phase: str, method: str, repeat: int) -> Record:
        from _peers import METHODS

        path = self.output_path(method)
        record = Record(phase, method, METHODS[method].label, repeat, self.state_bytes)
        if phase == "save":
            remove(path)  # each save creates its files, as a new checkpoint would
            drop_page_cache([])  # start from a clean cache: no dirty pages of the last method
        result = self.worker(phase, method, path)
        record.error = result.pop("error", None)
        record.seconds = result.pop("seconds", None)
        record.peak_increase = result.pop("peak_increase", None)
        record.extra = result
        if result.get("verified", "ok") != "ok":
            record.error = f"load verification failed: {result['verified']}"
        return record

    def run_phase(self, phase: str, methods: list[str]) -> None:
        shapes = _fio.WRITE_SHAPES if phase == "save" else _fio.READ_SHAPES
        for repeat in range(self.args.repeats):
            for item in self.schedule(methods, shapes, repeat):
                if isinstance(item, _fio.FioShape):
                    record = self.run_fio(phase, item, repeat)
                else:
                    record = self.run_method(phase, item, repeat)
                self.records.append(record)
                print(progress_line(record, self.args.repeats, self.state_bytes), flush=True)

    # ---- report ----------------------------------------------------------------------

    def summaries(self, phase: str) -> tuple[Summary | None, dict[str, Summary | None]]:
        mine = [r for r in self.records if r.phase == phase]
        ceil = ceiling([r for r in mine if r.method == "fio"])
        methods = {
            m: summarize([r for r in mine if r.method == m]) for m in ALL_METHODS if m != "fio"
        }
        return ceil, {m: s for m, s in methods.items() if any(r.method == m for r in mine)}

    def report_phase(self, phase: str) -> tuple[list[str], list[Target]]:
        ceil, methods = self.summaries(phase)
        title = {
            "save": "SAVE (durable: data and directory entry fsynced; state already in memory)",
            "load": "LOAD (cold page cache; every page of the result touched; result verified)",
        }[phase]
        rows = [s for s in methods.values() if s is not None]
        lines = table(f"\n== {title}", rows, ceil, self.state_bytes)
        lines += self.note_lines(phase)
        lines += self.fio_shape_lines(phase)
        fp = methods.get("fastpersist")
        kind = "write" if phase == "save" else "read"
        peers: dict[str, Summary | None] = {f"fio {kind} ceiling": ceil}
        peers |= {m: s for m, s in methods.items() if m != "fastpersist"}
        goals = SAVE_GOALS if phase == "save" else LOAD_GOALS
        if self.state["kind"] == "many":
            goals = SMALL_GOALS
        lines.append(f"-- fastpersist ratios ({phase}; informational, exit status unaffected)")
        if fp is None:
            reason = self.skipped.get("fastpersist", "not selected or failed")
            lines.append(f"  fastpersist not measured: {reason}")
        ratio_text, targets = ratio_lines(phase, fp, peers, goals)
        targets.append(memory_target(phase, fp, self.state_bytes))
        return lines + ratio_text + [targets[-1].line()], targets

    def note_lines(self, phase: str) -> list[str]:
        """What a method's processes reported about how they ran it (e.g. a fallback)."""
        notes: dict[str, set[str]] = {}
        for r in self.records:
            if r.phase == phase and r.extra.get("note"):
                notes.setdefault(r.label, set()).add(str(r.extra["note"]))
        return [f"  note: {label}: {note}" for label, found in notes.items()
                for note in sorted(found)]

    def fio_shape_lines(self, phase: str) -> list[str]:
        fio_records = [r for r in self.records if r.phase == phase and r.method == "fio"]
        labels = sorted({r.label for r in fio_records})
        lines = ["  fio shapes (median GB/s):"] if labels else []
        for label in labels:
            summary = summarize([r for r in fio_records if r.label == label])
            shown = f"{summary.median:.2f}" if summary else "failed"
            lines.append(f"    {label:<50} {shown}")
        return lines


def remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path)
    elif path.exists():
        path.unlink()


def progress_line(record: Record, repeats: int, state_bytes: int) -> str:
    head = f"  [{record.phase} {record.repeat + 1}/{repeats}] {record.label:<44}"
    if record.error:
        return f"{head} ERROR {record.error}"
    text = f"{head} {record.gbps:6.2f} GB/s  {record.seconds:7.2f} s"
    if record.peak_increase is not None:
        peak = record.peak_increase
        text += f"  peak +{peak / 2**20:.0f} MiB ({peak / state_bytes:.2f}x state)"
    if "cpu_seconds" in record.extra:
        text += f"  cpu {record.extra['cpu_seconds']:.2f} s"
    if "cache" in record.extra:
        text += f"  cold via {record.extra['cache']}"
    return text


def make_workdir(requested: Path | None) -> Path:
    """A fresh directory for this run, on a real disk: tmpfs would measure memory, not storage."""
    if requested is None:
        base = Path("/var/tmp")
        if mount_of(base)[1] in MEMORY_FILESYSTEMS:
            base = HERE.parent / ".bench"
    else:
        base = requested
    base.mkdir(parents=True, exist_ok=True)
    fstype = mount_of(base)[1]
    if fstype in MEMORY_FILESYSTEMS:
        print(
            f"WARNING: {base} is on {fstype}: this measures memory, and O_DIRECT methods may fail",
            flush=True,
        )
    return Path(tempfile.mkdtemp(prefix="fastpersist-bench-", dir=base))


def check_space(workdir: Path, state_bytes: int, methods: list[str], fio_size: int) -> None:
    """Every method's checkpoint stays on disk until the load phase, plus fio's file."""
    writers = [m for m in methods if m != "fio"]
    need = int(len(writers) * state_bytes * 1.1) + (fio_size if "fio" in methods else 0) + GIB
    free = shutil.disk_usage(workdir).free
    if free < need:
        raise SystemExit(
            f"not enough space in {workdir}: need {need / GIB:.1f} GiB, have {free / GIB:.1f} GiB"
        )


def versions() -> dict[str, str | None]:
    from importlib import metadata

    found: dict[str, str | None] = {}
    for dist in ("torch", "safetensors", "torch-checkpointing", "deepspeed", "fastpersist",
                 "numpy"):
        try:
            found[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            found[dist] = None
    found["fio"] = tool_version(["fio", "--version"])
    return found


def header(args: argparse.Namespace, bench: Bench) -> dict[str, Any]:
    facts = machine_facts(bench.workdir)
    vers = versions()
    print("command:", shlex.join([sys.executable, *sys.argv]))
    print("machine:", ", ".join(f"{k}={v}" for k, v in facts.items()))
    print("versions:", ", ".join(f"{k}={v}" for k, v in vers.items()))
    return {"machine": facts, "versions": vers}


def states(args: argparse.Namespace) -> list[dict[str, Any]]:
    """The states to measure, as _state.spec_from takes them: one, or one per --sizes."""
    if args.tensors is not None:
        return [{"kind": "many", "tensors": args.tensors,
                 "tensor_bytes": args.tensor_bytes or SMALL_TENSOR_BYTES}]
    if args.sizes is None:
        return [{"kind": "gpt", "bytes": int(args.size_gib * GIB)}]
    if args.tensor_bytes:
        return [{"kind": "many", "tensors": max(1, size // args.tensor_bytes),
                 "tensor_bytes": args.tensor_bytes} for size in args.sizes]
    return [{"kind": "gpt", "bytes": size} for size in args.sizes]


def measure(args: argparse.Namespace, bench: Bench) -> tuple[list[str], list[Target]]:
    """Every phase of one state, interleaved over repeats; the report's lines and targets."""
    print(
        f"state: {bench.spec.describe()}; {bench.state_bytes / 1e9:.3f} GB"
        " (GB/s below: 1e9 bytes of state per second)"
    )
    print(f"repeats: {args.repeats}; methods: {','.join(args.methods)}", flush=True)
    check_space(bench.workdir, bench.state_bytes, args.methods, bench.fio_size)
    usable = bench.probe()
    bench.run_phase("save", usable)
    if not args.skip_load:
        saved = {r.method for r in bench.records if r.phase == "save" and r.error is None}
        loaders = [m for m in usable if (m in LOADERS and m in saved) or m == "fio"]
        bench.run_phase("load", loaders)
    lines: list[str] = []
    targets: list[Target] = []
    for phase in ("save",) if args.skip_load else ("save", "load"):
        phase_lines, phase_targets = bench.report_phase(phase)
        lines += phase_lines
        targets += phase_targets
    print("\n".join(lines))
    for method, reason in bench.skipped.items():
        print(f"skipped: {method}: {reason}")
    return lines, targets


def compile_packages(args: argparse.Namespace) -> None:
    """Byte-compile the fastpersist packages measured. An installed wheel comes
    compiled; an editable checkout compiles each module on every import where
    PYTHONDONTWRITEBYTECODE is set (this project's machines set it), which
    put ~0.1 s of compiling into each fresh process's first save or load."""
    for root in [REPO_ROOT, args.baseline] if args.baseline else [REPO_ROOT]:
        compileall.compile_dir(str(root / "fastpersist"), quiet=1)


def run(args: argparse.Namespace) -> int:
    compile_packages(args)
    workdir = make_workdir(args.dir)
    try:
        benches: list[Bench] = []
        targets: list[Target] = []
        meta: dict[str, Any] = {}
        for i, state in enumerate(states(args)):
            sub = workdir / f"state-{i}"
            sub.mkdir()
            bench = Bench(args, sub, state)
            if not meta:
                meta = header(args, bench)
            benches.append(bench)
            targets += measure(args, bench)[1]
            if not args.keep:
                shutil.rmtree(sub, ignore_errors=True)  # room for the next size
        if args.sizes:
            print("\n".join(scaling_table(
                [(b.state_bytes, b.records) for b in benches], args.methods)))
        records = [r for b in benches for r in b.records]
        errors = [r for r in records if r.error]
        if args.json:
            dump = {"argv": sys.argv, **meta}
            dump["states"] = [
                {"state": b.state, "state_bytes": b.state_bytes, "describe": b.spec.describe(),
                 "skipped": b.skipped, "records": [r.as_json() for r in b.records]}
                for b in benches
            ]
            dump["targets"] = [t.__dict__ for t in targets]
            args.json.write_text(json.dumps(dump, indent=2, default=str))
            print(f"raw results: {args.json}")
        if errors:
            print(f"{len(errors)} measurement(s) failed; see ERROR lines above")
        return 1 if errors else 0
    finally:
        if args.keep:
            print(f"kept: {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(run(parse_args(sys.argv[1:])))
