"""fastpersist.adapters, the integrations' contract (issue 34, item 3): the
adapters call the core's logic instead of keeping copies of it."""

from __future__ import annotations

import gc

from fastpersist import gcpause
from fastpersist.integrations.dcp.memory import no_gc


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
