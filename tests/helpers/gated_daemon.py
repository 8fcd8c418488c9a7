"""fastpersistd whose writes wait for the test: `python gated_daemon.py GATE ARGS...`.

Runs the real daemon (fastpersist.daemon.cli.main with ARGS) with an engine
that starts each data-file write only once the file GATE exists, and a codec
that starts encoding a compressed data file only then (Begin's compression
reads the segment there first), so that a test decides when the daemon reads
a client's shared-memory segments (e.g. only after the client started its
next save, or truncated a segment). tests/daemon_support.py starts it
(Daemon(..., gate=PATH)); the test opens the gate with Daemon.open_gate().
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Sequence
from typing import Any

import fastpersist.engine
from fastpersist.codec import packing


def gated(engine: Any, gate: str) -> Any:
    class Gated:
        name = f"gated-{engine.name}"

        def write_file(self, path: str, segments: Sequence[Any], size: int,
                       **kwargs: Any) -> Any:
            wait_for(gate)
            return engine.write_file(path, segments, size, **kwargs)

        def read_file(self, *args: Any, **kwargs: Any) -> Any:
            return engine.read_file(*args, **kwargs)

        def copy(self, dst: Any, src: Any) -> int:
            return int(engine.copy(dst, src))

    return Gated()


def wait_for(gate: str) -> None:
    while not os.path.exists(gate):
        time.sleep(0.01)


def main() -> int:
    gate, argv = sys.argv[1], sys.argv[2:]
    get_engine = fastpersist.engine.get_engine
    # Before the daemon's modules import it by name.
    fastpersist.engine.get_engine = lambda name=None: gated(get_engine(name), gate)  # type: ignore[assignment]
    plan = packing.plan

    def gated_plan(*args: Any, **kwargs: Any) -> Any:
        wait_for(gate)
        return plan(*args, **kwargs)

    packing.plan = gated_plan  # type: ignore[assignment]  # looked up at each call
    from fastpersist.daemon.cli import main as daemon_main

    return daemon_main(argv)


if __name__ == "__main__":
    sys.exit(main())
