"""fastpersist.adapters, the integrations' contract (issue 34, item 3): the
adapters call the core's logic instead of keeping copies of it."""

from __future__ import annotations

import errno
import gc
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from fastpersist import gcpause
from fastpersist.integrations.dcp import FastPersistWriter
from fastpersist.integrations.dcp.memory import no_gc
from fastpersist.storage.commit import Staging

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def test_the_dcp_adapter_pauses_the_gc_with_fastpersists_pause() -> None:
    """The DCP adapter's pause around its metadata (dumps, reads) is
    fastpersist's: it nests with a save's or load's pause on another thread.
    Its own copy re-enabled the collector when it ended, under a save's block
    that had begun after it and was still running."""
    assert gc.isenabled()
    dcp_block, save_block = no_gc(), gcpause.paused()
    dcp_block.__enter__()
    save_block.__enter__()
    try:
        dcp_block.__exit__(None, None, None)
        assert not gc.isenabled(), "the DCP adapter's pause ended the save's"
    finally:
        save_block.__exit__(None, None, None)
    resumed = gc.isenabled()
    gc.enable()
    assert resumed, "the collector stayed paused after both blocks"


def test_a_dcp_commit_on_a_full_disk_names_the_checkpoint_and_leaves_nothing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The commit, now the core's (distributed/external.py), still turns an
    OSError into the CheckpointError for it, naming the checkpoint, and the
    writer aborts the staging directory."""
    real = Staging.write_file

    def full(self: Staging, name: str, data: bytes) -> None:
        if name == "dcp_metadata.json":
            raise OSError(errno.ENOSPC, "No space left on device", str(self.path / name))
        real(self, name, data)

    monkeypatch.setattr(Staging, "write_file", full)
    target = tmp_path / "ckpt"
    with pytest.raises(CheckpointException) as caught:
        dcp.save({"w": torch.ones(4)}, storage_writer=FastPersistWriter(target))
    assert f"DiskFullError: [Errno 28] cannot commit checkpoint {target}: no space left" \
        in str(caught.value)
    assert list(tmp_path.iterdir()) == []
