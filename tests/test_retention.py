"""fastpersist/storage/retention.py: the rules a Checkpointer's root follows after each
commit, whoever applies them (the in-process writer thread, or fastpersistd).

test_checkpointer.py runs them through a Checkpointer; these pin the cases a
training loop rarely meets: a rollback that leaves newer steps behind, saves of
one root that commit out of order, broken checkpoints, and symbolic links.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch

import fastpersist
from fastpersist import Checkpointer
from fastpersist.format.manifest import MANIFEST_NAME
from fastpersist.storage.retention import AfterCommit, apply_at, to_delete


def small(step: int) -> dict[str, object]:
    return {"step": step, "w": torch.full((64,), float(step))}


def names(root: Path) -> list[str]:
    return sorted(os.listdir(root))


@pytest.mark.parametrize(("entries", "newest", "keep_last", "keep_every", "broken", "deleted"), [
    # the newest keep_last, counting the one just committed
    ([1, 2, 3, 4], 4, 2, None, set(), [2, 1]),
    ([1, 2, 3, 4], 4, 1, None, set(), [3, 2, 1]),
    ([1, 2, 3, 4], 4, None, None, set(), []),
    # multiples of keep_every stay
    ([2, 3, 4, 5, 6, 7], 7, 2, 3, set(), [5, 4, 2]),
    # steps above the one just committed are neither deleted nor counted
    ([10, 20, 21, 30], 21, 2, None, set(), [10]),
    # a broken checkpoint does not count among the newest, and goes when old
    ([1, 2, 3, 4], 4, 2, None, {3}, [3, 1]),
])
def test_what_retention_deletes(entries: list[int], newest: int, keep_last: int | None,
                                keep_every: int | None, broken: set[int],
                                deleted: list[int]) -> None:
    asked: list[str] = []

    def committed(name: str) -> bool:
        asked.append(name)
        return int(name.removeprefix("step-")) not in broken

    listed = [(s, f"step-{s}") for s in entries]
    got = to_delete(listed, f"step-{newest}", AfterCommit(True, keep_last, keep_every), committed)
    assert got == [f"step-{s}" for s in deleted]
    # Manifests are read only as far as needed: newest first, up to keep_last found.
    assert len(asked) <= (keep_last or 0) + len(broken)


def test_a_rollback_never_deletes_the_newer_steps(tmp_path: Path) -> None:
    """Resuming from an older step (the operator moved `latest` back) leaves the
    abandoned newer checkpoints alone: retention only looks below the step it
    just committed, so the only copy of anything newer is never deleted."""
    root = tmp_path / "ckpts"
    with Checkpointer(root, keep_last=2) as ckpt:
        for step in (10, 20, 30):
            ckpt.save(step, small(step)).result()
    assert Checkpointer(root).steps() == [20, 30]
    (root / "latest").write_text("step-00000020\n")
    with Checkpointer(root, keep_last=2) as ckpt:
        assert ckpt.latest() == root / "step-00000020"
        ckpt.save(21, small(21)).result()
        assert ckpt.steps() == [20, 21, 30]
        assert ckpt.latest() == root / "step-00000021"
        ckpt.save(22, small(22)).result()
        assert ckpt.steps() == [21, 22, 30]


def test_latest_is_not_moved_back_by_an_older_save_that_finished_last(tmp_path: Path) -> None:
    """Through a daemon, two saves of one root may commit out of order (two write
    workers): the older one's pointer update must not hide the newer step."""
    root = tmp_path / "ckpts"
    policy = AfterCommit(True, 2, None)
    began = time.time()  # step 4's save began, then step 5's committed first
    fastpersist.save(small(5), root / "step-00000005")
    apply_at(root, "step-00000005", policy, since=time.time())
    fastpersist.save(small(4), root / "step-00000004")
    done = apply_at(root, "step-00000004", policy, since=began)
    assert not done.pointed and done.deleted == ()
    assert (root / "latest").read_text() == "step-00000005\n"
    # A higher step committed long before this save began is another story: an
    # operator's rollback. The pointer moves.
    fastpersist.save(small(3), root / "step-00000003")
    assert apply_at(root, "step-00000003", policy, since=time.time() + 60).pointed
    assert (root / "latest").read_text() == "step-00000003\n"


@pytest.fixture
def parsed(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The `where` of every manifest parsed from here on."""
    from fastpersist.format.manifest import Manifest

    seen: list[str] = []
    real = Manifest.from_json

    def counting(data: bytes, where: str) -> Manifest:
        seen.append(where)
        return real(data, where)

    monkeypatch.setattr(Manifest, "from_json", staticmethod(counting))
    return seen


def test_a_validated_manifest_is_not_parsed_again_until_it_changes(
        tmp_path: Path, parsed: list[str]) -> None:
    """Retention asks about the previous checkpoint at every commit: its manifest
    is parsed once, and again only once the file changed (a broken rewrite is
    then seen as not committed)."""
    from fastpersist.storage import retention

    fastpersist.save(small(1), tmp_path / "step-1")
    fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for _ in range(3):
            assert retention.is_committed("step-1", fd)
        assert parsed == ["step-1"]
        manifest = tmp_path / "step-1" / MANIFEST_NAME
        text = manifest.read_bytes()
        time.sleep(0.05)  # file times move by the kernel's clock tick (a few ms)
        manifest.write_bytes(text[: len(text) // 2])  # in place: same inode, new ctime
        assert not retention.is_committed("step-1", fd)
        time.sleep(0.05)
        manifest.write_bytes(text)
        assert retention.is_committed("step-1", fd)
        assert parsed == ["step-1"] * 3
    finally:
        os.close(fd)


def test_retention_does_not_parse_what_this_process_committed(
        tmp_path: Path, parsed: list[str]) -> None:
    """Each commit's retention asks whether the one before is committed; the
    process that committed it knows (a manifest of 100,000 tensors takes a
    second to parse)."""
    with Checkpointer(tmp_path / "ckpts", keep_last=2) as ckpt:
        for step in range(1, 6):
            ckpt.save(step, small(step)).result()
    assert parsed == []
    assert Checkpointer(tmp_path / "ckpts").steps() == [4, 5]


def test_symbolic_links_in_a_root_are_never_followed(tmp_path: Path) -> None:
    """What retention lists, deletes and replaces is the root's own entries: a
    step-N link to a checkpoint elsewhere is not a checkpoint here, and a
    `latest` link is replaced, not written through."""
    root = tmp_path / "ckpts"
    outside = tmp_path / "outside"
    fastpersist.save(small(1), outside / "step-00000001")
    (outside / "victim").write_text("keep me")
    root.mkdir()
    (root / "step-00000001").symlink_to(outside / "step-00000001")
    (root / "latest").symlink_to(outside / "victim")
    policy = AfterCommit(True, 1, None)
    for step in (2, 3):
        fastpersist.save(small(step), root / f"step-{step:08d}")
        apply_at(root, f"step-{step:08d}", policy)
    assert names(root) == ["latest", "step-00000001", "step-00000003"]
    assert (root / "step-00000001").is_symlink()
    assert not (root / "latest").is_symlink()
    assert (root / "latest").read_text() == "step-00000003\n"
    assert (outside / "victim").read_text() == "keep me"
    assert (outside / "step-00000001" / MANIFEST_NAME).is_file()
