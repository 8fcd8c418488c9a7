"""The distributed save planner, in one process with simulated ranks."""

from __future__ import annotations

import dataclasses
import gc
import itertools
import math
import pickle
import random

import pytest
from mesh_support import Tensor, as_sent, mesh_items, ranks_of

from fastpersist.distributed.plan import Share
from fastpersist.distributed.planner import (
    Item,
    PlanCache,
    PlanError,
    RankInfo,
    layout_digest,
    make_plan,
)
from fastpersist.distributed.table import BoxTable
from fastpersist.errors import DistributedCheckpointError

MIB = 1 << 20


def dp(world: int, items: tuple[Item, ...], per_node: int = 2) -> list[RankInfo]:
    return ranks_of([items] * world, per_node)


def model(n: int, seed: int = 0) -> tuple[Item, ...]:
    rng = random.Random(seed)
    return tuple(Item.whole(f"layer{i}.weight", rng.choice(["F32", "BF16", "F16"]),
                            (rng.randint(1, 2048), rng.randint(1, 512))) for i in range(n))


def covered(plan, key: str, shape: tuple[int, ...]) -> int:  # type: ignore[no-untyped-def]
    """Elements of `key` covered by the plan's pieces, checking they do not overlap."""
    cells: set[tuple[int, ...]] = set()
    total = 0
    for p in plan.pieces:
        if p.key != key:
            continue
        total += math.prod(p.shape)
        if math.prod(shape) <= 10_000:  # small enough to check cell by cell
            for idx in itertools.product(*(range(o, o + n)
                                           for o, n in zip(p.offsets, p.shape, strict=True))):
                assert idx not in cells, f"{key}: {idx} written twice"
                cells.add(idx)
    return total


def test_every_unique_byte_has_exactly_one_writer_among_its_holders() -> None:
    items = model(50)
    plan = make_plan(dp(8, items), min_piece_bytes=64 << 10)
    for item in items:
        assert covered(plan, item.key, item.global_shape) == math.prod(item.global_shape)
    assert plan.unique_bytes == sum(i.nbytes for i in items)
    assert set(plan.bytes_per_rank()) == set(range(8))


def test_balanced_per_node_then_per_rank() -> None:
    items = model(200, seed=3)
    # Uneven nodes: 3 ranks on node0, 1 on node1. Nodes get equal bytes (one set
    # of drives each), so node1's single rank writes as much as node0's three.
    ranks = ranks_of([items] * 4, per_node=1)
    ranks = [RankInfo(r.rank, "node0" if r.rank < 3 else "node1", r.items, r.layout)
             for r in ranks]
    plan = make_plan(ranks, min_piece_bytes=256 << 10)
    per_node = plan.bytes_per_node()
    assert abs(per_node["node0"] - per_node["node1"]) / plan.unique_bytes < 0.02, per_node
    per_rank = plan.bytes_per_rank()
    node0 = [per_rank[r] for r in (0, 1, 2)]
    assert max(node0) / min(node0) < 1.1, per_rank


def test_hsdp_balances_ranks_as_well_as_nodes() -> None:
    # TP=4 within a node x DP=4 over nodes (HSDP): each box has one holder per
    # node. Choosing the least-loaded node first and its one holder second
    # kept nodes even but left ranks up to 2x apart (a simulated 70B job at
    # 256 ranks: max/mean 2.0).
    tp, replicas = 4, 4
    rng = random.Random(5)
    shapes = [(rng.randint(64, 4096), rng.choice([256, 512, 1024])) for _ in range(60)]

    def items(t: int) -> tuple[Item, ...]:
        out = []
        for n, (rows, cols) in enumerate(shapes):
            per = rows // tp
            out.append(Item(f"w{n}", "BF16", (per * tp, cols), (t * per, 0), (per, cols)))
        return tuple(out)

    ranks = ranks_of([items(r % tp) for r in range(tp * replicas)], per_node=tp)
    plan = make_plan(ranks, min_piece_bytes=64 << 10)
    per_rank = plan.bytes_per_rank()
    mean = sum(per_rank.values()) / len(per_rank)
    assert max(per_rank.values()) / mean <= 1.05, per_rank
    per_node = plan.bytes_per_node()
    assert max(per_node.values()) / (plan.unique_bytes / replicas) <= 1.05, per_node
    for item in items(0):
        assert covered(plan, item.key, item.global_shape) == math.prod(item.global_shape)


def test_a_few_huge_tensors_are_split_so_they_still_balance() -> None:
    items = (Item.whole("huge", "F32", (10_000, 1000)), Item.whole("tiny", "F32", (3,)))
    plan = make_plan(dp(4, items), min_piece_bytes=1 * MIB)
    per_rank = plan.bytes_per_rank()
    share = plan.unique_bytes / 4
    assert all(abs(n - share) / share < 0.05 for n in per_rank.values()), per_rank
    assert len([p for p in plan.pieces if p.key == "huge"]) >= 4


def test_sharded_tensors_replicated_over_dp_split_among_their_replicas() -> None:
    # DP=2 x TP=2: rank = dp * 2 + tp holds rows tp*50..tp*50+50 of "w"; "b" everywhere.
    def items(tp: int) -> tuple[Item, ...]:
        return (Item("w", "F32", (100, 64), (tp * 50, 0), (50, 64)),
                Item.whole("b", "F32", (64,)))
    ranks = ranks_of([items(r % 2) for r in range(4)], per_node=2)
    plan = make_plan(ranks, min_piece_bytes=1 << 10)
    assert covered(plan, "w", (100, 64)) == 100 * 64
    for p in plan.pieces:
        if p.key == "w":
            tp = p.offsets[0] // 50
            assert p.writer % 2 == tp, f"{p} written by a rank that does not hold it"
            assert p.offsets[0] + p.shape[0] <= (tp + 1) * 50


def test_the_plan_is_a_deterministic_function_of_the_descriptions() -> None:
    items = model(300, seed=5)
    a = make_plan(dp(16, items, per_node=4), min_piece_bytes=128 << 10)
    shuffled = dp(16, items, per_node=4)
    random.Random(1).shuffle(shuffled)
    b = make_plan(shuffled, min_piece_bytes=128 << 10)
    assert a.pieces == b.pieces


def test_disagreeing_ranks_are_refused_by_name() -> None:
    items = model(5)
    other = (*items[:4], Item.whole("layer4.weight", "F32", (1, 1)))
    with pytest.raises(PlanError, match=r"rank 3 and rank 0 disagree.*layer4.weight"):
        make_plan(ranks_of([items, items, items, other], per_node=2))
    missing = items[:4]
    with pytest.raises(PlanError, match=r"4 tensors vs 5"):
        make_plan(ranks_of([items, missing], per_node=2))


def test_fingerprints_spare_the_comparison_but_not_the_refusal() -> None:
    # As sent, each layout's table carries the fingerprint of its tensors
    # (table.tensors_digest_of): a rank whose differ is refused by name.
    items = model(5)
    other = (*items[:4], Item.whole("layer4.weight", "F32", (1, 1)))
    with pytest.raises(PlanError, match=r"rank 3 and rank 0 disagree.*layer4.weight"):
        make_plan(as_sent(ranks_of([items, items, items, other], per_node=2)))
    with pytest.raises(PlanError, match=r"4 tensors vs 5"):
        make_plan(as_sent(ranks_of([items, items[:4]], per_node=2)))
    sharded = [tuple(Item(f"w{n}", "F32", (8 * n, 16), (r * 2 * n, 0), (2 * n, 16))
                     for n in range(1, 6)) for r in range(4)]
    sent = as_sent(ranks_of(sharded, per_node=2))
    tables = [r.items for r in sent]
    assert all(isinstance(t, BoxTable) for t in tables)
    digest = tables[0].digest
    assert {t.digest for t in tables} == {digest} and digest

    def forged(r: RankInfo, digest: str, pickled: bytes | None = None) -> RankInfo:
        t = r.items
        assert isinstance(t, BoxTable)
        return dataclasses.replace(r, items=BoxTable(digest, pickled or t.pickled, t.places,
                                                     t.place_numbers))

    # Fingerprints that are missing or differ, on equal tensors: read and
    # compared by value, the same plan.
    mixed = [forged(r, {1: "", 2: "another"}.get(r.rank, digest)) for r in sent]
    assert make_plan(mixed) == make_plan(sent) == make_plan(ranks_of(sharded, per_node=2))
    # The first's fingerprint: the tensors are neither read nor compared (not
    # even unpickled, so these bytes that are no pickle go unnoticed).
    trusted = [forged(r, digest, b"not a pickle") if r.rank else r for r in sent]
    assert make_plan(trusted) == make_plan(sent)
    with pytest.raises(pickle.UnpicklingError):
        make_plan([forged(r, "", b"not a pickle") if r.rank else r for r in sent])


def test_a_malformed_table_is_refused_by_its_rank() -> None:
    sent = as_sent(ranks_of([model(3)] * 2, per_node=2))
    t = sent[1].items
    assert isinstance(t, BoxTable)
    short = BoxTable(t.digest, t.pickled, t.places, t.place_numbers[:-4])
    with pytest.raises(PlanError, match=r"rank 1.s description is malformed: it sent 2 boxes "
                                        "for 3 tensors"):
        make_plan([sent[0], dataclasses.replace(sent[1], items=short, layout="x")])
    far = BoxTable(t.digest, t.pickled, t.places, t.place_numbers[:-4] + (9).to_bytes(4, "little"))
    with pytest.raises(PlanError, match=r"rank 1.s .* names place 9 of [1-8]$"):
        make_plan([sent[0], dataclasses.replace(sent[1], items=far, layout="x")])
    # What a rank of an older fastpersist sends (its digest and boxes), as
    # it is or pickled, and what is not even a whole length.
    for old in (("d" * 32, tuple(model(3))), pickle.dumps(("d" * 32, tuple(model(3)))),
                b"\x01\x02"):
        with pytest.raises(DistributedCheckpointError,
                           match=r"rank 3 described .* same fastpersist"):
            BoxTable.received(old, 3)
    # A table's wire form, and pickled (a plan is): the same boxes.
    again = BoxTable.received(t.sent(), 1)
    assert again == t == pickle.loads(pickle.dumps(t)) and again.digest == t.digest


def test_shards_that_overlap_or_leave_gaps_are_refused() -> None:
    def ranks(boxes: list[tuple[int, int]]) -> list[RankInfo]:
        return ranks_of([(Item("w", "F32", (10, 4), (o, 0), (n, 4)),) for o, n in boxes], 2)

    with pytest.raises(PlanError, match="overlap or leave gaps"):
        make_plan(ranks([(0, 5), (4, 5)]))  # rows 4 twice, row 9 never
    with pytest.raises(PlanError, match="lies outside"):
        make_plan(ranks([(0, 5), (5, 6)]))
    make_plan(ranks([(0, 5), (5, 5)]))  # exactly tiled: fine


def test_an_empty_shard_inside_another_shards_rows_is_no_overlap() -> None:
    # Uneven sharding leaves empty shards; where their offsets point is up to
    # the sharding, and an empty box overlaps nothing.
    boxes = [(0, 6), (6, 4), (3, 0)]
    ranks = ranks_of([(Item("w", "F32", (10, 4), (o, 0), (n, 4)),) for o, n in boxes], 3)
    plan = make_plan(ranks)
    assert covered(plan, "w", (10, 4)) == 40


def test_zero_size_and_scalar_tensors() -> None:
    items = (Item.whole("s", "F32", ()), Item.whole("e", "F32", (0, 7)),
             Item.whole("x", "I64", (5,)))
    plan = make_plan(dp(3, items))
    assert sorted(p.key for p in plan.pieces) == ["e", "s", "x"]


def test_cache_returns_the_plan_only_for_the_same_descriptions() -> None:
    cache = PlanCache()
    items = model(10)
    ranks = dp(4, items)
    digests = [r.layout for r in ranks]
    assert cache.get(digests) is None
    plan = make_plan(ranks)
    cache.put(digests, plan)
    assert cache.get(digests) is plan
    assert cache.get([*digests[:3], layout_digest(model(10, seed=9))]) is None


@pytest.mark.parametrize("seed", range(12))
def test_random_meshes_are_covered_once_by_holders_in_bounded_balanced_pieces(seed: int
                                                                            ) -> None:
    # TP x FSDP x DP jobs of random shapes (scalars, one-row, empty, huge),
    # some keys replicated over TP: every byte is written once, by a rank that
    # holds it, no piece is larger than the plan's target unless it cannot
    # be cut, and ranks and nodes end level.
    rng = random.Random(seed)
    tp, fsdp, dp_ = rng.choice([1, 2, 4]), rng.choice([1, 2, 3]), rng.choice([1, 2, 3, 5])
    per_node = rng.choice([1, 2, 3, 4])
    shapes: list[Tensor] = []
    for n in range(rng.randint(5, 40)):
        kind = rng.random()
        shape: tuple[int, ...] = (() if kind < 0.1 else (1, rng.randint(1, 64)) if kind < 0.2
                                  else (0, 3) if kind < 0.25
                                  else (rng.randint(1, 300) * (8 if kind > 0.9 else 1),
                                        rng.randint(1, 96)))
        shapes.append((f"k{n}", rng.choice(["F32", "BF16"]), shape, rng.random() < 0.3))

    world = tp * fsdp * dp_
    ranks = ranks_of([mesh_items(shapes, tp, fsdp, r % tp, (r // tp) % fsdp)
                      for r in range(world)], per_node)
    min_piece = rng.choice([256, 4096, 64 << 10])
    plan = make_plan(ranks, min_piece_bytes=min_piece)
    for key, _, shape, _ in shapes:
        assert covered(plan, key, shape) == math.prod(shape), key
    held = {(r.rank, i.key): i for r in ranks for i in r.items}
    for p in plan.pieces:
        box = held[p.writer, p.key]
        assert all(bo <= po and po + ps <= bo + bs for bo, bs, po, ps in zip(
            box.offsets, box.shape, p.offsets, p.shape, strict=True)), (p, box)
    target = max(min_piece, math.ceil(plan.unique_bytes / (world * 16)))
    for p in plan.pieces:  # pieces are cut at rows: about target, at most a row more
        row = p.nbytes // p.shape[0] if p.shape and p.shape[0] else p.nbytes
        assert p.nbytes <= target + row or p.shape[0] <= 1, (p, target)
    # The replicas of one layout can trade its boxes: their loads (weighted by
    # the ranks on their node) end level within about a piece.
    per_rank = plan.bytes_per_rank()
    weight = {r.rank: sum(1 for o in ranks if o.node == r.node) for r in ranks}
    biggest = max(p.nbytes for p in plan.pieces) * max(weight.values())
    for layout in {r.layout for r in ranks}:
        loads = [per_rank[r.rank] * weight[r.rank] for r in ranks if r.layout == layout]
        assert max(loads) - min(loads) <= 2 * biggest + 1, (per_rank, biggest)
    assert plan == make_plan(list(reversed(ranks)), min_piece_bytes=min_piece)
    # What each rank works out from its share (sent pickled) and its own
    # items is its part of the coordinator's plan, in the same order.
    for r, share in zip(ranks, plan.shares(), strict=True):
        got = Share.of(pickle.loads(pickle.dumps(share)))
        assert got.pieces(r.items) == plan.for_rank(r.rank)
        assert got == plan.share(r.rank)
    # Planned from what the ranks send (plain tuples, unpickled): the same plan.
    sent = make_plan(as_sent(ranks), min_piece_bytes=min_piece)
    assert sent == plan and sent.pieces == plan.pieces


def test_a_plan_of_what_ranks_send_leaves_the_collector_nothing_to_track() -> None:
    # Rank 0 keeps its plan save after save. It keeps each layout's table
    # (table.BoxTable: a few bytes objects and tuples of numbers), and the
    # boxes a table gives are plain tuples, which the collector stops
    # tracking (a tuple once the tuples in it are untracked: a box within two
    # passes), where it never stops tracking a named tuple (plan.Item).
    layouts = [tuple(Item(f"k{n}", "F32", (64, 8), (16 * f, 0), (16, 8)) for n in range(50))
               for f in range(4)]
    ranks = ranks_of([layouts[r % 4] for r in range(16)], per_node=4)
    kept = make_plan(as_sent(ranks))
    control = make_plan(ranks)  # the same plan, of Items
    assert control == kept
    boxes = [b for plan in (kept, control) for lay in plan.layouts.values() for b in lay.items]
    assert len(boxes) == 2 * 4 * 50 and all(type(b) is tuple for b in boxes)
    gc.collect()
    gc.collect()
    assert not any(gc.is_tracked(b) for b in boxes)
    assert all(gc.is_tracked(i) for i in layouts[0])


def test_a_share_is_small_however_many_pieces_its_rank_writes() -> None:
    # Pure data parallelism, 512 ranks, 600 tensors: a rank's share names its
    # run of the layout's bytes, not its pieces, and rank 0 makes none.
    items = tuple(Item.whole(f"w{n}", "F32", (256, 64)) for n in range(600))
    plan = make_plan(dp(512, items), min_piece_bytes=4096)
    assert "pieces" not in plan.memo  # nothing expanded the plan
    sizes = [len(pickle.dumps(s)) for s in plan.shares()]
    assert max(sizes) < 300, max(sizes)
    assert sum(len(plan.share(r).pieces(items)) for r in range(512)) == len(plan.pieces)


def test_pieces_of_a_byte_still_leave_scalars_whole() -> None:
    # The smallest target there is: a scalar is larger than it and cannot be cut.
    items = (Item.whole("s", "F64", ()), Item.whole("v", "F32", (6,)))
    plan = make_plan(dp(4, items), min_piece_bytes=1)
    assert [p.shape for p in plan.pieces if p.key == "s"] == [()]
    assert covered(plan, "v", (6,)) == 6
