"""One way each to ask fastpersistd for a copy in memory (tensors/memory_read.ask_copy)
and for its Info about a path (loading/copies.ask_daemon), however many callers."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from fastpersist.loading import copies
from fastpersist.loading.chain import NoCopy
from fastpersist.tensors import memory_only, memory_read


def _spy(monkeypatch: pytest.MonkeyPatch, module: Any, name: str) -> list[tuple[Any, ...]]:
    calls: list[tuple[Any, ...]] = []
    real = getattr(module, name)

    def spy(*args: Any) -> Any:
        calls.append(args)
        return real(*args)

    monkeypatch.setattr(module, name, spy)  # raises where there is no such helper
    return calls


def test_both_memory_finds_ask_the_daemon_one_way(daemon: Any,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _spy(monkeypatch, memory_read, "ask_copy")
    path = daemon.root / "nothing-here"
    found, why = memory_read.find(daemon.address, path)
    found_only, why_only = memory_only.find(daemon.address, path)
    assert found is None and found_only is None
    assert why == why_only and why  # the daemon's one reason, as asked one way
    assert [c[:2] for c in calls] == [(daemon.address, path)] * 2
    # A daemon that is not there: both say so the same way.
    gone = "unix:///nonexistent/fastpersistd.sock"
    assert memory_read.find(gone, path, 0.5)[1] == memory_only.find(gone, path, 0.5)[1] != ""


def test_the_peers_and_the_tier_are_asked_one_way(daemon: Any,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _spy(monkeypatch, copies, "ask_daemon")
    path = daemon.root / "run" / "step-1"
    with pytest.raises(NoCopy, match="has no --tier"):
        copies.daemon_tier(daemon.address, path)
    with pytest.raises(NoCopy, match="has no peers"):
        copies.peers_copy(daemon.address, path)
    assert [(c[0], c[1], c[2]) for c in calls] == [(daemon.address, path, "tier"),
                                                   (daemon.address, path, "peers")]
    for what, call in (("tier", copies.daemon_tier), ("peers", copies.peers_copy)):
        with pytest.raises(NoCopy, match=f"cannot ask fastpersistd for its {what}"):
            call("unix:///nonexistent/fastpersistd.sock", Path("/x"))
