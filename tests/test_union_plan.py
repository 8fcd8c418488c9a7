"""Plans for ranks that hold different tensors (union=True: pipeline stages,
experts), in one process with simulated ranks."""

from __future__ import annotations

import math
import pickle
import random

import pytest
from mesh_support import as_sent, ranks_of

from fastpersist.distributed.plan import Share, bitmap
from fastpersist.distributed.planner import Item, PlanError, make_plan


def elements_written(plan, key: str) -> int:  # type: ignore[no-untyped-def]
    return sum(math.prod(p.shape) for p in plan.pieces if p.key == key)


def chunk(n: int, parts: int, i: int) -> tuple[int, int]:
    size = math.ceil(n / parts)
    start = min(i * size, n)
    return start, max(0, min(n, start + size) - start)


@pytest.mark.parametrize("seed", range(12))
def test_pipeline_stages_are_covered_once_by_their_holders(seed: int) -> None:
    # PP x TP x FSDP x DP jobs: each stage holds its own keys, listed in an
    # order of its own; in two jobs of three a few keys (a tied embedding, a
    # step counter) are held by several stages. Every byte of the union is
    # written once, by a rank that holds it; the shared boxes and the job's
    # bytes are what a box at a time finds; replicas end level; each rank's
    # share gives its part of the coordinator's plan.
    rng = random.Random(seed)
    pp, tp, fsdp, dp = (rng.choice([2, 3, 4]), rng.choice([1, 2]), rng.choice([1, 2]),
                        rng.choice([1, 2, 3]))
    shapes = []
    tied = seed % 3 != 0  # a third of the jobs hold no key in several stages
    for n in range(rng.randint(6, 30)):
        shape = (rng.randint(1, 200), rng.randint(1, 64)) if rng.random() > 0.1 else ()
        stages = (set(range(pp)) if tied and rng.random() < 0.1 else {0, pp - 1}
                  if tied and rng.random() < 0.1 else {rng.randrange(pp)})
        shapes.append((f"k{n}", rng.choice(["F32", "BF16"]), shape, stages))

    def items(stage: int, t: int, f: int) -> tuple[Item, ...]:
        out = []
        for key, dtype, shape, stages in shapes:
            if stage not in stages:
                continue
            if not shape:
                out.append(Item.whole(key, dtype, shape))
                continue
            (o0, n0), (o1, n1) = chunk(shape[0], fsdp, f), chunk(shape[1], tp, t)
            out.append(Item(key, dtype, shape, (o0, o1), (n0, n1)))
        if stage % 2:
            out.reverse()  # a stage may list its keys in any order
        return tuple(out)

    world = pp * tp * fsdp * dp
    ranks = ranks_of([items(r // (tp * fsdp * dp), r % tp, (r // tp) % fsdp)
                      for r in range(world)], rng.choice([1, 2, 4]))
    min_piece = rng.choice([256, 4096])
    plan = make_plan(ranks, min_piece_bytes=min_piece, union=True)
    held_keys = {i.key for r in ranks for i in r.items}
    assert set(plan.keys) == held_keys
    for key, _, shape, _ in shapes:
        assert elements_written(plan, key) == math.prod(shape), key
    held = {(r.rank, i.key): i for r in ranks for i in r.items}
    for p in plan.pieces:
        box = held[p.writer, p.key]  # KeyError: written by a rank that does not hold it
        assert all(bo <= po and po + ps <= bo + bs for bo, bs, po, ps in zip(
            box.offsets, box.shape, p.offsets, p.shape, strict=True)), (p, box)
    assert plan == make_plan(list(reversed(ranks)), min_piece_bytes=min_piece, union=True)
    # Box at a time: which boxes several layouts hold, and the job's bytes.
    holders: dict[Item, set[str]] = {}
    for r in ranks:
        for i in r.items:
            holders.setdefault(i, set()).add(r.layout)
    assert plan.unique_bytes == sum(i.nbytes for i in holders)
    for planned in plan.layouts.values():
        assert planned.shared == bitmap([len(holders[Item._make(b)]) > 1 for b in planned.items])
    for r, share in zip(ranks, plan.shares(), strict=True):
        got = Share.of(pickle.loads(pickle.dumps(share)))
        assert got.pieces(r.items) == plan.for_rank(r.rank)
        assert got == plan.share(r.rank)
    # Planned from what the ranks send (plain tuples, unpickled): the same plan.
    sent = make_plan(as_sent(ranks), min_piece_bytes=min_piece, union=True)
    assert sent == plan and sent.pieces == plan.pieces


def test_stages_split_their_own_bytes_between_their_replicas() -> None:
    # 2 stages x 4 data-parallel replicas: each stage's bytes go to its 4 ranks, level.
    stage0 = tuple(Item.whole(f"layers.{n}.w", "F32", (512, 256)) for n in range(8))
    stage1 = tuple(Item.whole(f"layers.{n}.w", "F32", (512, 256)) for n in range(8, 12))
    plan = make_plan(ranks_of([stage0] * 4 + [stage1] * 4, per_node=8), union=True,
                     min_piece_bytes=4096)
    per_rank = plan.bytes_per_rank()
    assert [per_rank[r] for r in range(4)] == [8 * 512 * 256 * 4 // 4] * 4
    assert [per_rank[r] for r in range(4, 8)] == [4 * 512 * 256 * 4 // 4] * 4
    assert plan.keys == tuple(i.key for i in stage0 + stage1)


def test_a_key_two_stages_describe_differently_is_refused_by_name() -> None:
    # Two stages' optimizer states under the same index-based key, of different shapes.
    a = (Item.whole("optim.state.0.exp_avg", "F32", (16, 8)),)
    b = (Item.whole("optim.state.0.exp_avg", "F32", (32, 8)),)
    with pytest.raises(PlanError, match=r"'optim.state.0.exp_avg' is F32 \[32, 8\] on rank 1 "
                       r"but F32 \[16, 8\] on rank 0.*get_state_dict"):
        make_plan(ranks_of([a, b], per_node=2), union=True)


def test_without_union_ranks_with_other_keys_are_refused_with_a_hint() -> None:
    a = (Item.whole("layers.0.w", "F32", (4, 4)),)
    b = (Item.whole("layers.1.w", "F32", (4, 4)),)
    with pytest.raises(PlanError, match=r"rank 1 and rank 0 disagree.*union=True"):
        make_plan(ranks_of([a, b], per_node=2))
    # The same keys with another shape is not a pipeline: no hint.
    c = (Item.whole("layers.0.w", "F32", (8, 4)),)
    with pytest.raises(PlanError, match=r"disagree") as info:
        make_plan(ranks_of([a, c], per_node=2))
    assert "union" not in str(info.value)
    plan = make_plan(ranks_of([a, b], per_node=2), union=True)
    assert plan.keys == ("layers.0.w", "layers.1.w")
    assert {p.key: p.writer for p in plan.pieces} == {"layers.0.w": 0, "layers.1.w": 1}


def test_a_stages_gap_is_refused_by_its_first_key() -> None:
    # Two stages, each with a damaged key (a gap between its shards): the
    # error names the first of them in the job's order of keys.
    def stage(keys: list[str], rows: int) -> list[tuple[Item, ...]]:
        return [tuple(Item(k, "F32", (8, 4), (4 * f, 0), (rows if k.endswith("bad") else 4, 4))
                      for k in keys) for f in range(2)]

    first, second = stage(["a", "b.bad"], 3), stage(["c.bad", "d"], 3)
    ranks = ranks_of([*first, *second], per_node=2)
    with pytest.raises(PlanError, match=r"^b.bad: the ranks' shards hold 24 elements"):
        make_plan(ranks, union=True)
    with pytest.raises(PlanError, match=r"^c.bad: "):
        make_plan(ranks_of([*second, *first], per_node=2), union=True)


def test_a_key_held_twice_by_one_rank_is_refused() -> None:
    a = (Item.whole("w", "F32", (4,)), Item.whole("w", "F32", (4,)))
    with pytest.raises(PlanError, match="rank 0 describes a key twice"):
        make_plan(ranks_of([a], per_node=1), union=True)
