"""What ranks send the coordinator after writing (rendered manifest JSON) and
the job manifest it makes of them (schema 3, chunks implied by the records'
names): the same files, records and tensors, chunk for chunk, as the
schema-2 manifest global_manifest writes of the same records (chunks listed),
whatever order a rank's files hold its pieces in, and a clear error when a
rank's records are not its pieces."""

from __future__ import annotations

import gc
import pickle
import sys
from collections.abc import Callable
from typing import Any

import pytest
import torch

from fastpersist.distributed import layout, phases, written
from fastpersist.distributed.planner import Item, Plan, RankInfo, layout_digest, make_plan
from fastpersist.errors import DistributedCheckpointError
from fastpersist.format.frames import Frame
from fastpersist.format.manifest import IMPLIED_CHUNKS_SCHEMA_VERSION, Manifest
from fastpersist.format.names import part_file_name
from fastpersist.format.records import FileRecord, TensorRecord
from fastpersist.tensors import state

NOW = 1_764_400_000.25


@pytest.fixture(autouse=True)
def fixed_time(monkeypatch: pytest.MonkeyPatch) -> None:
    # Both manifests carry time.time(); pin it so the bytes can be compared.
    monkeypatch.setattr(written.time, "time", lambda: NOW)
    monkeypatch.setattr(layout.time, "time", lambda: NOW)


def job(world: int = 8) -> Plan:
    """TP 2 x FSDP 2 with 2 data-parallel replicas, and a scalar on every rank."""
    return make_plan(job_ranks(world), min_piece_bytes=1024)


def job_ranks(world: int = 8) -> list[RankInfo]:
    infos = []
    for r in range(world):
        tp, fsdp = r % 2, (r // 2) % 2
        items = []
        for n, rows in enumerate((64, 96, 7)):
            shape = (rows, 32)
            half = rows // 2 if fsdp == 0 else rows - rows // 2
            items.append(Item(f"w{n}", "F32", shape, (fsdp * (rows // 2), tp * 16),
                              (half, 16)))
        items.append(Item.whole("step", "I64", ()))
        infos.append(RankInfo(r, f"node{r // 4}", tuple(items), layout_digest(items)))
    return infos


def records(rank: int, pieces: list[Any], compressed: bool = False
            ) -> list[tuple[FileRecord, list[TensorRecord]]]:
    """What storage.write might return for `pieces`: one data file of them."""
    name = part_file_name(rank, 0, packed=compressed)
    offset, out = 4096, []
    for n, p in enumerate(pieces):
        frames = (Frame(0, p.nbytes, 0, 10, 7),) if compressed and p.nbytes else None
        out.append(TensorRecord(p.name, name, offset, p.nbytes, p.dtype, p.shape, 1000 + n,
                                "zstd-bytegroup-v1" if frames else "raw",
                                10 if frames else None, frames))
        offset += 10 if frames else p.nbytes
    return [(FileRecord(name, offset, 4096, 12345, node=f"node{rank // 4}"), out)] if out else []


def expected(plan: Plan, per_rank: list[Any], tree: Any) -> bytes:
    """The manifest as global_manifest writes it of the same records (schema 2)."""
    files = [f for rank in per_rank for f, _ in rank]
    tensors = [t for rank in per_rank for _, ts in rank for t in ts]
    globals_: dict[str, Any] = {k: None for k in plan.keys}
    for p in plan.pieces:
        if globals_[p.key] is None:
            globals_[p.key] = (p.key, p.dtype, p.global_shape, [])
        globals_[p.key][3].append((p.name, p.offsets))
    return layout.global_manifest(files, tensors, list(globals_.values()), tree)


def same_checkpoint(implied: bytes, listed: bytes) -> None:
    """The two manifests describe the same checkpoint: files, records, tree,
    and each tensor's chunks (as records and offsets, in any order)."""
    a, b = Manifest.from_json(implied, "job"), Manifest.from_json(listed, "expected")
    assert (a.schema_version, b.schema_version) == (IMPLIED_CHUNKS_SCHEMA_VERSION, 2)
    assert (a.files, a.tensors, a.tree) == (b.files, b.tensors, b.tree)

    def chunks(m: Manifest) -> list[tuple[str, str, tuple[int, ...], set[Any]]]:
        return [(g.name, g.dtype, g.shape, {(m.tensors[c.tensor].name, c.offsets)
                                            for c in g.chunks}) for g in m.globals or ()]
    assert chunks(a) == chunks(b)


@pytest.mark.parametrize("shuffled", [False, True])
@pytest.mark.parametrize("compressed", [False, True])
def test_the_job_manifest_holds_what_global_manifest_lists(shuffled: bool,
                                                           compressed: bool) -> None:
    plan = job()
    per_rank, sent = [], []
    for rank in sorted(plan.nodes):
        mine = plan.for_rank(rank)
        files = records(rank, mine[::-1] if shuffled else mine, compressed)
        per_rank.append(files)
        # As rank 0 gets it: bytes (Coordinator.gather_bytes), read as views.
        got = pickle.loads(pickle.dumps(written.rendered(mine, files).sent()))
        sent.append(written.Written.received(got, rank))
    tree = plan_tree(plan)
    data = written.job_manifest(plan, tree, sent)
    same_checkpoint(data, expected(plan, per_rank, tree))
    assert b'"chunks"' not in data  # rank 0 lists no chunk
    # Again with the same plan (its tensors are then taken from the plan's memo).
    assert written.job_manifest(plan, tree, sent) == data


def plan_tree(plan: Plan) -> Any:
    """The tree a state of the plan's keys encodes to."""
    tree, leaves = state.encode({k: torch.empty(0) for k in plan.keys}, allow_pickle=False,
                                sharded=True)
    layout.unaliased(leaves)
    return tree


def test_a_rank_without_pieces_adds_nothing() -> None:
    # 4 ranks holding one scalar: three of them have no piece to write.
    infos = [RankInfo(r, "node0", (Item.whole("step", "I64", ()),),
                      layout_digest((Item.whole("step", "I64", ()),))) for r in range(4)]
    plan = make_plan(infos)
    per_rank = [records(r, plan.for_rank(r)) for r in range(4)]
    sent = [written.rendered(plan.for_rank(r), per_rank[r]) for r in range(4)]
    assert sum(bool(w.tensors) for w in sent) == 1
    tree = plan_tree(plan)
    same_checkpoint(written.job_manifest(plan, tree, sent), expected(plan, per_rank, tree))


def test_a_rank_whose_files_lack_a_piece_is_refused_by_name() -> None:
    plan = job()
    mine = plan.for_rank(0)
    with pytest.raises(DistributedCheckpointError, match=f"{mine[0].name!r} is missing"):
        written.rendered(mine, records(0, mine[1:]))
    other = plan.for_rank(1)[0]
    with pytest.raises(DistributedCheckpointError,
                       match=f"{other.name!r} is not one of them"):
        written.rendered(mine, records(0, [*mine[1:], other]))


def test_records_of_too_few_ranks_are_refused() -> None:
    plan = job()
    sent = [written.rendered(plan.for_rank(r), records(r, plan.for_rank(r)))
            for r in range(8)]
    with pytest.raises(DistributedCheckpointError, match="7 ranks reported for a plan of 8"):
        written.job_manifest(plan, plan_tree(plan), sent[:7])


def test_rank_0s_steps_pause_the_collector_and_resume_it() -> None:
    """The plan, the ranks' shares, the gathered messages, the job manifest
    and every manifest check make hundreds of thousands of objects and no cycles at scale: the
    collector's passes over them (a full one traverses a trainer's whole heap)
    wait until each ends, and it runs again after (gcpause)."""
    plan = job()
    sent = [written.rendered(plan.for_rank(r), records(r, plan.for_rank(r)))
            for r in sorted(plan.nodes)]
    tree = plan_tree(plan)
    data = written.job_manifest(plan, tree, sent)
    ranks = job_ranks()
    # Each step, and its body undecorated (so that the check can fail).
    steps: dict[str, tuple[Any, Callable[[Any], object]]] = {
        "make_plan": (make_plan, lambda f: f(ranks, min_piece_bytes=1024)),
        "shares": (Plan.shares, lambda f: f(plan)),
        "job_manifest": (written.job_manifest, lambda f: f(plan, tree, sent)),
        "from_json": (Manifest.from_json, lambda f: f(data, "job")),
        # Rank 0's gathers: what every rank sent, unpickled.
        "unpickled": (phases.unpickled, lambda f: f([pickle.dumps(w) for w in sent])),
    }
    body: list[Any] = []  # the code object whose passes are counted
    passes: list[int] = []

    def count(phase: str, info: dict[str, int]) -> None:
        frame = sys._getframe(1)
        while phase == "start" and body and frame is not None:
            if frame.f_code is body[0]:
                passes.append(info["generation"])
                return
            frame = frame.f_back

    def collections(fn: Any, call: Callable[[Any], object], paused: bool = True) -> int:
        body[:] = [fn.__wrapped__.__code__]
        passes.clear()
        call(fn if paused else fn.__wrapped__)
        return len(passes)

    threshold = gc.get_threshold()
    gc.callbacks.append(count)
    gc.set_threshold(1)  # a pass at every allocation the collector is not paused for
    try:
        assert gc.isenabled()
        during = {name: collections(fn, call) for name, (fn, call) in steps.items()}
        assert gc.isenabled()
        without = {name: collections(fn, call, paused=False)
                   for name, (fn, call) in steps.items()}
    finally:
        gc.set_threshold(*threshold)
        gc.callbacks.remove(count)
    assert during == dict.fromkeys(steps, 0)
    assert all(n > 0 for n in without.values()), without  # the check can fail


def test_records_in_another_form_are_refused_by_rank() -> None:
    ok = written.Written(b'{"a":1}', b"").sent()
    assert written.Written.received(ok, 2) == (b'{"a":1}', b"")
    for bad in (b"", b"\x01", ok[:-1], (99).to_bytes(8, "little") + b"xy"):
        with pytest.raises(DistributedCheckpointError, match="rank 2 sent its records"):
            written.Written.received(bad, 2)
