"""Running torch.distributed (gloo) jobs of real rank processes for tests.

Imported as `dist_support` (tests/ is on sys.path). Each rank runs
tests/helpers/dist_worker.py with a scenario and writes a JSON report; "nodes"
are simulated with FASTPERSIST_NODE, node-local storage with a directory per
node, and a node's daemon with per-node environment (env_by_node).
"""

from __future__ import annotations

import datetime
import importlib
import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

from fastpersist.distributed.coordinator import tensor_bytes_by_rank
from fastpersist.tensors.checkpoint import read_manifest

WORKER = Path(__file__).parent / "helpers" / "dist_worker.py"
# Small pieces, so that the test state's tensors are cut over the writers.
PIECES = str(64 << 10)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_job(tmp_path: Path, scenario: str, nodes: list[str], args: dict[str, Any],
            env: dict[str, str] | None = None, timeout: float = 120,
            env_by_node: dict[str, dict[str, str]] | None = None,
            agent_store: bool = False) -> list[dict[str, Any]]:
    """Run len(nodes) ranks (rank r on node nodes[r]); their reports, by rank.

    The job's c10d store lives in rank 0's process (init_process_group's
    default), or with agent_store in this process, as torchrun's agent hosts
    it: then it outlives every rank."""
    out = tmp_path / f"out-{scenario}-{len(os.listdir(tmp_path))}"
    out.mkdir()
    port = free_port()
    store = None
    if agent_store:
        from torch.distributed import TCPStore

        store = TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=60))
        env = {**(env or {}), "TORCHELASTIC_USE_AGENT_STORE": "True"}
    procs = []
    for rank, node in enumerate(nodes):
        e = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(len(nodes)),
                 MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), FASTPERSIST_NODE=node,
                 FASTPERSIST_PIECE_BYTES=PIECES, OMP_NUM_THREADS="1", **(env or {}),
                 **(env_by_node or {}).get(node, {}))
        procs.append(subprocess.Popen(
            [sys.executable, str(WORKER), scenario, str(out), json.dumps(args)], env=e,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    logs = outputs(procs, timeout)
    del store  # the job is over
    reports = []
    for rank in range(len(nodes)):
        f = out / f"rank-{rank}.json"
        reports.append({**json.loads(f.read_text()), "log": logs[rank][-3000:]}
                       if f.exists() else {
            "rank": rank, "missing": True, "returncode": procs[rank].returncode,
            "log": logs[rank][-3000:]})
    return reports


def outputs(procs: list[subprocess.Popen[str]], timeout: float) -> list[str]:
    """Each rank's output once it exits; all killed if one hangs."""
    logs = []
    for p in procs:
        try:
            logs.append(p.communicate(timeout=timeout)[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise AssertionError(f"a rank hung: {[q.args for q in procs]}") from None
    return logs


def run_ranks(worker: Path, scenario: str, out: Path, world: int, args: dict[str, Any],
              timeout: float = 180) -> list[dict[str, Any]]:
    """Run `world` gloo ranks of `worker SCENARIO OUT ARGS_JSON` (a script that
    writes OUT/rank-R.json); their reports by rank, a missing one as
    {"error": the rank's last output}."""
    out.mkdir()
    port = free_port()
    procs = [subprocess.Popen(
        [sys.executable, str(worker), scenario, str(out), json.dumps(args)],
        env=dict(os.environ, RANK=str(r), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                 MASTER_PORT=str(port), OMP_NUM_THREADS="1"),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(world)]
    logs = outputs(procs, timeout)
    reports = []
    for r in range(world):
        f = out / f"rank-{r}.json"
        reports.append(json.loads(f.read_text()) if f.exists() else {"error": logs[r][-3000:]})
    return reports


def run_example(name: str, argument: Path, ranks: int) -> str:
    """The output of examples/NAME ARGUMENT: one process, or `ranks` under torchrun."""
    example = Path(__file__).parent.parent / "examples" / name
    cmd = [sys.executable, str(example), str(argument)]
    if ranks > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={ranks}",
               f"--master-port={free_port()}", str(example), str(argument)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=True,
                          env=dict(os.environ, OMP_NUM_THREADS="1")).stdout


def ok(reports: list[dict[str, Any]]) -> None:
    bad = [r for r in reports if not r.get("ok")]
    assert not bad, json.dumps(bad, indent=1)[:6000]


def data_bytes_by_rank(ckpt: Path) -> dict[int, int]:
    return tensor_bytes_by_rank(read_manifest(ckpt))


def worker_module(name: str = "dist_worker") -> Any:
    """tests/helpers/<name>.py (a rank's script), imported here for its state and checks."""
    sys.path.insert(0, str(WORKER.parent))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.pop(0)


def full_tensors() -> Any:
    return worker_module().full_tensors()


def unique_bytes(tp: bool) -> int:
    dist_worker = worker_module()
    tensors = list(dist_worker.full_tensors().values())
    if tp:
        tensors += list(dist_worker.sharded_tensors().values())
    return sum(t.numel() * t.element_size() for t in tensors)


def check_loaded(report: dict[str, Any], tp: bool) -> None:
    assert report["ok"], report
    assert report["step"] == 7 and report["name"] == "test-run"
    bad = {k: v for k, v in report["tensors"].items() if not v["equal"]}
    assert not bad, bad
    assert len(report["tensors"]) == 8 + (2 if tp else 0)
    assert report["tied"], "tied weights came back as two tensors"


def describe_here(obj: Any) -> dict[str, Any]:
    """What a rank's report says of a loaded state, for a state loaded here."""
    return {**worker_module().describe_loaded(obj), "ok": True}
