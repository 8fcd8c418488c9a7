"""How long fpctl's read-only commands take as an operator runs them: each a
fresh `fpctl` process, timed from exec to exit.

    python benchmarks/fpctl_commands.py                          # 1 GiB, 7 rounds
    python benchmarks/fpctl_commands.py --baseline DIR --json out.json

A checkpoint of `--size-gib` (the benchmarks' GPT-style state) is saved under a
root; each round runs `fpctl ls ROOT`, `fpctl inspect CKPT` and `fpctl verify
CKPT` with this tree's fastpersist and, with --baseline DIR (another checkout
with its built extensions), with that one, interleaved. Before each verify
the checkpoint's files are evicted from the page cache (POSIX_FADV_DONTNEED),
so that it reads from the disk; Python's and torch's own files stay cached, as
they are for an operator's second command. Both packages are byte-compiled
first (this machine sets PYTHONDONTWRITEBYTECODE). Medians [min-max], seconds.
"""

from __future__ import annotations

import argparse
import compileall
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _system import evict, machine_facts

HERE = Path(__file__).resolve().parent
REPO_ROOT = HERE.parent

COMMANDS = ("ls", "inspect", "verify")


# The `fpctl` script's work, with `tree` first on sys.path (ahead of the
# current directory and an editable install), and a check that it was used.
FPCTL = """
import sys
sys.path.insert(0, sys.argv.pop(1))
import fastpersist.cli
assert fastpersist.cli.__file__.startswith(sys.path[0]), fastpersist.cli.__file__
sys.exit(fastpersist.cli.main())
"""


def run_fpctl(tree: Path, argv: list[str]) -> float:
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", FPCTL, str(tree), *argv],
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"fpctl {' '.join(argv)} ({tree}) failed: {done.stderr.strip()}")
    return seconds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-gib", type=float, default=1.0)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--baseline", type=Path, help="another fastpersist checkout to compare")
    parser.add_argument("--dir", type=Path, help="where to save (default: a temporary "
                        "directory under the current one, on its disk)")
    parser.add_argument("--json", type=Path, help="write the raw times here")
    args = parser.parse_args()
    trees = {"fastpersist": REPO_ROOT}
    if args.baseline:
        if not (args.baseline / "fastpersist" / "__init__.py").is_file():
            parser.error(f"--baseline {args.baseline}: no fastpersist package there")
        trees["baseline"] = args.baseline.resolve()
    for tree in trees.values():
        compileall.compile_dir(str(tree / "fastpersist"), quiet=1)

    from _state import build_state, make_spec  # imports torch: not needed for --help

    import fastpersist

    work = Path(tempfile.mkdtemp(prefix="fpctl-bench-", dir=args.dir or Path.cwd()))
    try:
        root = work / "root"
        ckpt = root / "step-1"
        fastpersist.save(build_state(make_spec(int(args.size_gib * (1 << 30)))), ckpt)
        nbytes = sum(f.stat().st_size for f in ckpt.iterdir())
        argvs = {"ls": ["ls", str(root)], "inspect": ["inspect", str(ckpt)],
                 "verify": ["verify", str(ckpt)]}
        times: dict[str, dict[str, list[float]]] = {
            name: {c: [] for c in COMMANDS} for name in trees}
        for _ in range(args.repeats):
            for command in COMMANDS:
                for name, tree in trees.items():
                    if command == "verify":
                        evict([ckpt])
                    times[name][command].append(run_fpctl(tree, argvs[command]))
        print(f"fpctl, {nbytes / (1 << 30):.2f} GiB checkpoint, {args.repeats} rounds "
              "(medians [min-max], seconds from exec to exit):")
        for command in COMMANDS:
            cells = []
            for name in trees:
                t = times[name][command]
                cells.append(f"{name} {statistics.median(t):.3f} [{min(t):.3f}-{max(t):.3f}]")
            print(f"  {command:8s} " + "   ".join(cells))
        if args.json:
            args.json.write_text(json.dumps({"machine": machine_facts(work),
                                             "bytes": nbytes, "repeats": args.repeats,
                                             "trees": {k: str(v) for k, v in trees.items()},
                                             "seconds": times}, indent=1))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
