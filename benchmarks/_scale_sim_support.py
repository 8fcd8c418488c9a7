"""The fakes scale_sim.py drives the real coordinator code with: a counting
in-memory c10d Store, a coordinator whose collectives answer as the other
ranks would, a storage that writes nothing, and the message-size model of
torch's *_object collectives."""

from __future__ import annotations

import pickle
from collections import defaultdict
from typing import Any

import torch

from fastpersist.distributed.layout import RankView, unaliased
from fastpersist.distributed.plan import described
from fastpersist.distributed.planner import Piece, RankInfo
from fastpersist.distributed.table import BoxTable
from fastpersist.format.names import part_file_name
from fastpersist.format.records import FileRecord, TensorRecord
from fastpersist.tensors import state


class CountingStore:
    """torch.distributed.Store's interface in memory; every call is one round
    trip of the rank set in `rank`, and its keys and values are its bytes."""

    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}
        self.rank = 0
        self.calls: dict[int, int] = defaultdict(int)
        self.bytes: dict[int, int] = defaultdict(int)

    def _count(self, *parts: Any) -> None:
        self.calls[self.rank] += 1
        self.bytes[self.rank] += sum(len(p) if isinstance(p, bytes | str) else 8 for p in parts)

    @staticmethod
    def _b(v: str | bytes) -> bytes:
        return v.encode() if isinstance(v, str) else v

    def set(self, key: str, value: str | bytes) -> None:
        self._count(key, value)
        self.data[key] = self._b(value)

    def get(self, key: str) -> bytes:
        value = self.data[key]
        self._count(key, value)
        return value

    def add(self, key: str, n: int) -> int:
        self._count(key, 0, 0)
        value = int(self.data.get(key, b"0")) + n
        self.data[key] = str(value).encode()
        return value

    def check(self, keys: list[str]) -> bool:
        self._count(*keys)
        return all(k in self.data for k in keys)

    def compare_set(self, key: str, expected: str | bytes, desired: str | bytes) -> bytes:
        self._count(key, expected, desired)
        current = self.data.get(key)
        if (current is None and self._b(expected) == b"") or current == self._b(expected):
            self.data[key] = self._b(desired)
            return self._b(desired)
        return current if current is not None else self._b(expected)

    def delete_key(self, key: str) -> bool:
        self._count(key)
        return self.data.pop(key, None) is not None

    def wait(self, keys: list[str], timeout: Any = None) -> None:
        self._count(*keys)
        missing = [k for k in keys if k not in self.data]
        if missing:
            raise RuntimeError(f"wait: {missing} not set (a fake store cannot block)")

    def multi_get(self, keys: list[str]) -> list[bytes]:
        values = [self.data[k] for k in keys]
        self._count(*keys, *values)
        return values

    def multi_set(self, keys: list[str], values: list[str | bytes]) -> None:
        self._count(*keys, *values)
        for k, v in zip(keys, values, strict=True):
            self.data[k] = self._b(v)

    def num_keys(self) -> int:
        self._count()
        return len(self.data)

    def summary(self, world: int) -> dict[str, Any]:
        others = [self.calls[r] for r in range(1, world)] or [0]
        return {"calls_rank0": self.calls[0], "calls_per_rank_max": max(others),
                "bytes_rank0": self.bytes[0],
                "bytes_per_rank_max": max([self.bytes[r] for r in range(1, world)] or [0]),
                "keys_left": len(self.data)}


class SimCoordinator:
    """phases.Coordinator's collectives for one rank, answered in memory as the
    other ranks would answer them (their errors: none)."""

    def __init__(self, rank: int, size: int) -> None:
        self.rank, self.size = rank, size

    def all_gather(self, value: Any) -> list[Any]:
        return [value] * self.size

    def gather(self, value: Any) -> list[Any] | None:
        return [value] * self.size if self.rank == 0 else None

    def broadcast(self, value: Any) -> Any:
        return value

    def scatter(self, values: list[Any] | None) -> Any:
        assert values is not None
        return values[self.rank]


class SimStorage:
    """storage.Storage that keeps nothing: the simulation moves no bytes."""

    def publish(self, where: str, manifest: bytes, node: str | None, after: Any) -> str:
        return ""

    def abort(self, where: str) -> None:
        pass


def records_for(rank: int, pieces: list[Piece]) -> list[tuple[FileRecord, list[TensorRecord]]]:
    """What storage.write returns for a rank's pieces: one data file of them."""
    if not pieces:
        return []
    name = part_file_name(rank, 0)
    offset, records = 4096, []
    for p in pieces:
        records.append(TensorRecord(p.name, name, offset, p.nbytes, p.dtype, p.shape, 0))
        offset += p.nbytes
    return [(FileRecord(name, offset, 4096, 0), records)]


def tree_for(keys: list[str]) -> Any:
    """The tree state.encode makes of a state with these (flat) keys."""
    tree, leaves = state.encode({k: torch.empty(0) for k in keys}, allow_pickle=False,
                                sharded=True)
    unaliased(leaves)
    return tree


def _size(obj: Any) -> int:
    return len(pickle.dumps(obj))


def _gathered_size(obj: Any) -> int:
    """Bytes of obj in Coordinator's gathers: pickled, and the bytes pickled again."""
    return _size(pickle.dumps(obj))


def collective_bytes(views: list[RankView], infos: list[RankInfo], shares: list[bytes],
                     written: list[bytes], manifest: bytes) -> dict[str, Any]:
    """Bytes each rank sends plus receives in one save's collectives (coordinator.Save,
    shared storage), as torch's *_object collectives move them: an all_gather of
    the sizes (8 bytes a rank) first, then every rank's message padded to the
    largest. Every rank other than 0 moves the same (padded) amount."""
    n = len(views)
    item_size: dict[str, int] = {}
    for i in infos:
        if i.layout not in item_size:
            # plan.described: the table the layout's first rank sends, as it is
            # (Coordinator.gather_bytes_from; torch pickles it once).
            sent = i.items.sent() if isinstance(i.items, BoxTable) else described(i.items)
            item_size[i.layout] = _size(sent)
    none = _gathered_size(None)
    sizes = 8 * n
    view = max(_gathered_size(v) for v in views)
    items = max(item_size.values())
    share = max(len(s) for s in shares)
    records = max(_size(w) for w in written)  # Written.sent, as it is (gather_bytes)
    path = _gathered_size("/ckpt/.step-1.staging-0123456789abcdef")
    empty = _size(b"")
    # (name, a rank other than 0, rank 0)
    steps = [
        ("agree x4 (describe, stage, write, commit)", 4 * (sizes + n * none),
         4 * (sizes + n * none)),
        ("describe all_gather", sizes + n * view, sizes + n * view),
        # The first rank of each layout sends its items to rank 0, point to
        # point, each message its own size (Coordinator.gather_from).
        ("plan items (first rank of a layout)", items, sum(item_size.values())),
        ("plan scatter (share)", 8 + share, 8 + n * share),
        ("stage all_gather (path)", sizes + n * path, sizes + n * path),
        ("write gather (records)", sizes + records, sizes + n * records),
        ("commit broadcast", 8 + empty, 8 + n * empty),
    ]
    return {"other_rank_max": sum(s[1] for s in steps), "rank0": sum(s[2] for s in steps),
            "steps": {name: {"other_rank": a, "rank0": b} for name, a, b in steps},
            "manifest_bytes": len(manifest)}
