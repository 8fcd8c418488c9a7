"""Coordination cost of a distributed save at thousands of simulated ranks, vs DCP's global plan.

    python benchmarks/scale_sim.py                              # 1,024 / 4,096 / 16,384 ranks
    python benchmarks/scale_sim.py --ranks 1024 --models llama-70b --repeats 3
    python benchmarks/scale_sim.py --json out.json --dcp-timeout 120
    python benchmarks/scale_sim.py --models llama-70b --pp 4    # pipeline stages (union=True)

No tensor byte moves and no process is started: the ranks' descriptions are
simulated (_scale_model.py: a Llama 70B and 405B, params + Adam states, TP x
FSDP with data-parallel replicas; with --pp N, N pipeline stages each holding
its layers, saved with union=True) and the REAL code of the job's coordinator
runs on them, as rank 0 runs it (coordinator.Save's steps 2-5):

- plan: rank 0 reads the tables of boxes that the first rank of each layout
  sent (table.BoxTable.received, as Save._plan does with what
  Coordinator.gather_bytes_from gives it), then
  planner.make_plan over every rank's RankInfo (deduplication and balance),
  then Plan.shares and the pickling scatter_object_list does;
- with --pp, at every save: the join of the stages' trees (trees.renumbered,
  trees.joined, as Save._join_trees), counted in the commit;
- commit: rank 0 reads (Written.received) what every rank sent (its file and tensor records
  as storage.write returns them, one data file per rank, rendered by
  written.rendered on that rank, which first works out its pieces from its
  share (Share.pieces): untimed, as the ranks do it in parallel; the slowest
  rank's is reported), then written.job_manifest, then
  commit_point.CommitPoint.commit (the commit exchange, the ballot in the
  store, the phase agreement), over a coordinator whose collectives return
  what the other ranks would send and a storage whose publish does nothing;
- the store: every rank's store calls of one save (outcome.check_in, forget,
  rank 0's Ballot) against CountingStore, an in-memory fake of the c10d
  Store interface that counts round trips and bytes per rank;
- the load's first step, not timed in plan + commit: Manifest.from_json on the
  job manifest (parse, and check that the chunks tile every tensor), which
  every load and a daemon's CommitJob run;
- messages: the bytes each rank sends and receives in the save's collectives,
  from the pickled sizes of what it exchanges and the way torch's *_object
  collectives pad every rank's message to the largest.

In the same run, DCP: DefaultSavePlanner.create_global_plan (dedup_save_plans,
then the global metadata and its validation) on SavePlans built from the same
boxes (WriteItems with ChunkStorageMetadata). Ranks with one layout share one
list of WriteItems (memory only: the planner still visits every rank's items).

Each size runs `--repeats` times, fastpersist and DCP interleaved; medians
and [min-max]. DCP runs that exceed --dcp-timeout are stopped and reported as
">T s". The coordinator's peak memory (tracemalloc) is measured in one extra,
untimed run (tracemalloc slows Python down).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import pickle
import signal
import statistics
import sys
import time
import tracemalloc
from dataclasses import replace
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _scale_model import MODELS, Model, coordinates, items_of, node_of  # noqa: E402
from _scale_sim_support import (  # noqa: E402
    CountingStore,
    SimCoordinator,
    SimStorage,
    collective_bytes,
    records_for,
    tree_for,
)

from fastpersist import gcpause  # noqa: E402
from fastpersist.distributed.commit_point import CommitPoint  # noqa: E402
from fastpersist.distributed.layout import RankView  # noqa: E402
from fastpersist.distributed.outcome import (  # noqa: E402
    Ballot,
    ProcessId,
    SaveStore,
    check_in,
    forget,
)
from fastpersist.distributed.phases import Phase  # noqa: E402
from fastpersist.distributed.plan import Share, described  # noqa: E402
from fastpersist.distributed.planner import RankInfo, layout_digest, make_plan  # noqa: E402
from fastpersist.distributed.table import BoxTable  # noqa: E402
from fastpersist.distributed.trees import joined, renumbered  # noqa: E402
from fastpersist.distributed.written import Written, job_manifest, rendered  # noqa: E402
from fastpersist.format.manifest import Manifest  # noqa: E402
from fastpersist.knobs import current as current_knobs  # noqa: E402

GOAL_SECONDS, GOAL_SPEEDUP, GOAL_BALANCE = 1.0, 10.0, 1.05


class Job:
    """One simulated job: every rank's description, built once per size."""

    def __init__(self, model: Model, world: int) -> None:
        self.model, self.world = model, world
        self.coords = coordinates(model, world)
        self.layouts: dict[tuple[int, int, int], Any] = {}
        for c in sorted(set(self.coords)):
            items = items_of(model, world, *c)
            self.layouts[c] = (items, layout_digest(items))  # each rank computes its own
        self.views = [RankView(node_of(r), self.layouts[c][1], "/ckpt/step-1", "v" * 32,
                               ProcessId("m" * 40, 100000 + r, "1234567"), False)
                      for r, c in enumerate(self.coords)]
        # Each stage's tree, from its first rank (as Save._join_trees gathers
        # them): one, the job's, without pipeline stages.
        self.stages: dict[int, tuple[int, Any, list[str]]] = {}
        for r, c in enumerate(self.coords):
            if c[0] not in self.stages:
                keys = [i.key for i in self.layouts[c][0]]
                self.stages[c[0]] = (r, tree_for(keys), keys)
        self.tree = self.stages[0][1]
        self.unique_bytes = 0
        # What the first rank of each layout sends rank 0 (its table of
        # boxes, made in parallel with the others: not timed).
        self.first: dict[str, int] = {}
        for r, v in enumerate(self.views):
            self.first.setdefault(v.layout, r)
        self.described = [described(self.layouts[self.coords[r]][0])
                          for r in self.first.values()]

    def job_tree(self, keys: tuple[str, ...]) -> Any:
        """The tree rank 0 commits: with pipeline stages, the stages' joined."""
        if len(self.stages) == 1:
            return self.tree
        order = {k: n for n, k in enumerate(keys)}
        return joined([(r, renumbered(tree, entries, order))
                       for r, tree, entries in self.stages.values()])


def run_fastpersist(job: Job, memory: bool = False) -> dict[str, Any]:
    """Rank 0's steps 2-5 (timed), and every rank's messages and store calls."""
    piece_bytes = current_knobs().piece_bytes
    if memory:
        tracemalloc.start()
    gc.collect()
    began = time.perf_counter()
    gc.collect()  # a full pass over the simulation's own objects, for comparison
    collect_before = time.perf_counter() - began
    start = time.perf_counter()
    with gcpause.paused():  # as Save._plan
        got = dict(zip(job.first.values(), job.described, strict=True))
        tables = {layout: BoxTable.received(got[r], r) for layout, r in job.first.items()}
        infos = [RankInfo(r, v.node, tables[v.layout], v.layout) for r, v in enumerate(job.views)]
        plan = make_plan(infos, min_piece_bytes=piece_bytes, union=job.model.pp > 1)
        planned = time.perf_counter()
        shares = [pickle.dumps(s) for s in plan.shares()]  # scatter_object_list pickles each
    shared = time.perf_counter()
    # Each rank's records (storage.write's), rendered for the gather: the
    # ranks' work, in parallel; untimed, but the slowest is kept.
    sent, render_max = [], 0.0
    for r, s in enumerate(shares):
        began = time.perf_counter()
        pieces = Share.of(pickle.loads(s)).pieces(job.layouts[job.coords[r]][0])
        expanded = time.perf_counter() - began
        records = records_for(r, pieces)  # storage.write's: not timed
        began = time.perf_counter()
        sent.append(rendered(pieces, records).sent())
        render_max = max(render_max, expanded + time.perf_counter() - began)
    store = CountingStore()
    co = SimCoordinator(0, job.world)
    commit = CommitPoint()
    commit.co, commit.storage = co, SimStorage()  # type: ignore[assignment]
    commit.phase, commit.node_local, commit.target = Phase(co, lambda: None), False, Path("/c")
    commit.nodes = [v.node for v in job.views]
    commit.store = SaveStore(store, "fastpersist/sim/2")
    commit.ballot, commit.staged = Ballot(commit.store), "/c.staging"
    store.rank = 0
    record_start = time.perf_counter()
    tree = job.job_tree(plan.keys)  # (in the save's prepare, on rank 0)
    with gcpause.paused():  # as Save._finish, from the gather to the commit
        # As Coordinator.gather_bytes gives them on rank 0, read as Save._finish does.
        gathered = [Written.received(w, r) for r, w in enumerate(sent)]
        manifest = job_manifest(plan, tree, gathered)
        commit.commit(manifest)
    done = time.perf_counter()
    # What the collector's passes, paused through the commit, then find: a
    # full pass now, less one over the simulation's own objects before.
    began = time.perf_counter()
    gc.collect()
    collect_after = time.perf_counter() - began
    # The next save, with the layout unchanged: the plan is cached (no plan,
    # no scatter), rank 0 reads and joins the ranks' records again.
    again = time.perf_counter()
    tree = job.job_tree(plan.keys)
    with gcpause.paused():  # as Save._finish (it was not paused here until 2026-12-06)
        job_manifest(plan, tree, [Written.received(w, r) for r, w in enumerate(sent)])
    steady = time.perf_counter() - again
    peak = None
    if memory:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    # Not the coordinator's: what every load of the checkpoint, and a daemon's
    # CommitJob, does with the manifest first (parse and check its chunks).
    checked = time.perf_counter()
    Manifest.from_json(manifest, "simulated job manifest")
    manifest_check = time.perf_counter() - checked
    # The store calls of one save, every rank (the previous save's keys are forgotten).
    for r in range(job.world):
        store.rank = r
        s = SaveStore(store, "fastpersist/sim/2")
        forget(SaveStore(store, "fastpersist/sim/1"), ["save", "after"], r, job.world)
        check_in(s, "save", r)
    per_rank = plan.bytes_per_rank()
    job.unique_bytes = plan.unique_bytes
    mean = sum(per_rank.values()) / len(per_rank)
    msgs = collective_bytes(job.views, infos, shares, sent, manifest)
    return {
        "plan_s": planned - start,
        "plan_commit_s": (shared - start) + (done - record_start),
        "rank_render_max_s": render_max,
        "cached_commit_s": steady,
        "collector_after_s": collect_after - collect_before,
        "manifest_check_s": manifest_check,
        "pieces": len(plan.pieces),
        "balance_max_over_mean": max(per_rank.values()) / mean,
        "bytes_per_rank_max": max(per_rank.values()),
        "bytes_per_rank_mean": mean,
        "store": store.summary(job.world),
        "messages": msgs,
        "plan_broadcast_bytes_before": len(pickle.dumps(plan)),
        "manifest_bytes": len(manifest),
        "coordinator_peak_bytes": peak,
    }


class _Timeout(Exception):
    pass


def run_dcp(job: Job, timeout: float) -> float | None:
    """DefaultSavePlanner.create_global_plan's seconds, or None past `timeout`."""
    import torch
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        MetadataIndex,
        TensorProperties,
    )
    from torch.distributed.checkpoint.planner import (
        SavePlan,
        TensorWriteData,
        WriteItem,
        WriteItemType,
    )

    dt = {"BF16": torch.bfloat16, "F32": torch.float32}
    per_layout: dict[str, list[Any]] = {}
    for items, digest in job.layouts.values():
        per_layout[digest] = [WriteItem(
            index=MetadataIndex(i.key, torch.Size(i.offsets)), type=WriteItemType.SHARD,
            tensor_data=TensorWriteData(
                chunk=ChunkStorageMetadata(torch.Size(i.offsets), torch.Size(i.shape)),
                properties=TensorProperties(dtype=dt[i.dtype]), size=torch.Size(i.global_shape)))
            for i in items]
    plans = [SavePlan(per_layout[v.layout], planner_data={}) for v in job.views]
    planner = DefaultSavePlanner()

    def expire(*_: Any) -> None:
        raise _Timeout

    old = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, timeout)
    start = time.perf_counter()
    try:
        planner.create_global_plan(plans)
        return time.perf_counter() - start
    except _Timeout:
        return None
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def _spread(xs: list[float]) -> dict[str, float]:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "runs": len(xs)}


def run_size(model: Model, world: int, repeats: int, dcp_repeats: int, dcp_timeout: float
             ) -> dict[str, Any]:
    built = time.perf_counter()
    job = Job(model, world)
    build_s = time.perf_counter() - built
    fp: list[dict[str, Any]] = []
    dcp: list[float | None] = []
    for n in range(repeats):  # interleaved: fastpersist, then DCP, in each repeat
        fp.append(run_fastpersist(job))
        if n < dcp_repeats and (not dcp or dcp[-1] is not None):
            dcp.append(run_dcp(job, dcp_timeout))
        print(f"  {model.name} {world}: repeat {n + 1}: plan+commit "
              f"{fp[-1]['plan_commit_s']:.2f} s, DCP "
              f"{'-' if len(dcp) <= n else _fmt_dcp(dcp[n], dcp_timeout)}", flush=True)
    mem = run_fastpersist(job, memory=True)
    tp, pp, fsdp, dp = model.mesh(world)
    last = fp[-1]
    out = {
        "model": model.name, "ranks": world, "mesh": {"tp": tp, "pp": pp, "fsdp": fsdp, "dp": dp},
        "union": pp > 1,
        "layouts": len(job.layouts), "items_per_rank": len(next(iter(job.layouts.values()))[0]),
        "unique_bytes": job.unique_bytes, "build_s": build_s,
        "plan_s": _spread([r["plan_s"] for r in fp]),
        "plan_commit_s": _spread([r["plan_commit_s"] for r in fp]),
        "cached_commit_s": _spread([r["cached_commit_s"] for r in fp]),
        "collector_after_s": _spread([r["collector_after_s"] for r in fp]),
        "manifest_check_s": _spread([r["manifest_check_s"] for r in fp]),
        "rank_render_max_s": _spread([r["rank_render_max_s"] for r in fp]),
        "dcp_s": [d for d in dcp], "dcp_timeout_s": dcp_timeout,
        "coordinator_peak_bytes": mem["coordinator_peak_bytes"],
        **{k: last[k] for k in ("pieces", "balance_max_over_mean", "bytes_per_rank_max",
                                "bytes_per_rank_mean", "store", "messages",
                                "plan_broadcast_bytes_before", "manifest_bytes")},
    }
    done = [d for d in dcp if d is not None]
    out["dcp_median_s"] = statistics.median(done) if done else None
    out["speedup_vs_dcp"] = (out["dcp_median_s"] / out["plan_s"]["median"]
                             if done else None)
    out["speedup_vs_dcp_at_least"] = (dcp_timeout / out["plan_s"]["median"]
                                      if dcp and dcp[0] is None else None)
    return out


def _cell(x: dict[str, float]) -> str:
    return f"{x['median']:.2f} [{x['min']:.2f}-{x['max']:.2f}]"


def _fmt_dcp(d: float | None, timeout: float) -> str:
    return f">{timeout:.0f} s (stopped)" if d is None else f"{d:.2f} s"


def report(results: list[dict[str, Any]]) -> list[str]:
    lines = ["| model | ranks | TP x PP x FSDP x DP | pieces | plan s | plan+commit s | "
             "next save's commit s (plan cached) | DCP global plan s | DCP / plan | "
             "max/mean bytes | store calls/rank (max) | msg bytes/rank (rank!=0, max) | "
             "rank 0 msg bytes | coordinator peak MiB | manifest MB | load's manifest check s |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        m = r["mesh"]
        dcp = r["dcp_s"]
        done = [d for d in dcp if d is not None]
        dcp_cell = (f"{statistics.median(done):.2f} [{min(done):.2f}-{max(done):.2f}] "
                    f"({len(done)} runs)" if done else f">{r['dcp_timeout_s']:.0f}")
        ratio = (f"{r['speedup_vs_dcp']:.1f}x" if r["speedup_vs_dcp"] else
                 f">{r['speedup_vs_dcp_at_least']:.1f}x" if r["speedup_vs_dcp_at_least"]
                 else "-")
        p, pc, cc = r["plan_s"], r["plan_commit_s"], r["cached_commit_s"]
        lines.append(
            f"| {r['model']} | {r['ranks']} | {m['tp']}x{m['pp']}x{m['fsdp']}x{m['dp']} | "
            f"{r['pieces']} | "
            f"{p['median']:.2f} [{p['min']:.2f}-{p['max']:.2f}] | "
            f"{pc['median']:.2f} [{pc['min']:.2f}-{pc['max']:.2f}] | "
            f"{cc['median']:.2f} [{cc['min']:.2f}-{cc['max']:.2f}] | {dcp_cell} | {ratio} | "
            f"{r['balance_max_over_mean']:.3f} | {r['store']['calls_per_rank_max']} "
            f"(rank 0: {r['store']['calls_rank0']}) | "
            f"{r['messages']['other_rank_max']:,} | {r['messages']['rank0']:,} | "
            f"{(r['coordinator_peak_bytes'] or 0) / 2**20:.0f} | {r['manifest_bytes'] / 1e6:.1f} | "
            f"{_cell(r['manifest_check_s'])} |")
    lines.append("")
    for r in results:
        pc = r["plan_commit_s"]["median"]
        sp = r["speedup_vs_dcp"] or r["speedup_vs_dcp_at_least"]
        lines.append(
            f"{r['model']} {r['ranks']}: plan+commit {pc:.2f} s "
            f"({'PASS' if pc <= GOAL_SECONDS else 'MISS'} <= {GOAL_SECONDS} s); vs DCP "
            f"{'-' if sp is None else f'{sp:.1f}x'} "
            f"({'PASS' if sp and sp >= GOAL_SPEEDUP else 'MISS'} >= {GOAL_SPEEDUP}x); balance "
            f"{r['balance_max_over_mean']:.3f} "
            f"({'PASS' if r['balance_max_over_mean'] <= GOAL_BALANCE else 'MISS'} <= "
            f"{GOAL_BALANCE}); store calls per rank {r['store']['calls_per_rank_max']} "
            f"(O(1): the same at every size)")
    return lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", default="1024,4096,16384")
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--dcp-repeats", type=int, default=5)
    ap.add_argument("--dcp-timeout", type=float, default=120.0)
    ap.add_argument("--pp", type=int, default=None,
                    help="pipeline stages (default: the model's, 1); over 1 plans with union=True")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    results = []
    for name in args.models.split(","):
        for world in (int(w) for w in args.ranks.split(",")):
            model = MODELS[name] if args.pp is None else replace(MODELS[name], pp=args.pp)
            results.append(run_size(model, world, args.repeats, args.dcp_repeats,
                                    args.dcp_timeout))
    lines = report(results)
    print("\n".join(lines))
    if args.json:
        args.json.write_text(json.dumps({
            "when": datetime.datetime.now(datetime.UTC).isoformat(), "argv": sys.argv,
            "results": results, "report": lines}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
