"""A DCP saver that stops at one moment of a save, for the SIGKILL test in
tests/test_integration_dcp.py.

    python dcp_kill_saver.py TARGET HOOK [DAEMON]

Saves version 1 of a small state to TARGET through FastPersistWriter, prints
"saved 1", then saves version 2 over it, stopping at HOOK: it prints
"hook HOOK" and sleeps until it is killed. Tensor values are the version.

Hooks: before_write (the staging directory made, no data yet), after_write
(every data file written), before_manifest (dcp_metadata.json written),
before_publish (manifest.json written, not renamed), after_publish (renamed
into place: the new checkpoint).

Through fastpersistd at DAEMON: before_write and after_write as above (the
job begun; every part durable in the daemon), mid_part (this rank's files
handed over, its part not committed), before_commit_job (the manifest built,
CommitJob not sent), after_commit_job (the daemon committed the job).
"""

from __future__ import annotations

import sys
import time
import warnings
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

from fastpersist.distributed.storage import ThroughDaemon
from fastpersist.integrations.dcp import FastPersistWriter, writer
from fastpersist.saving import handover
from fastpersist.storage.commit import Staging


def state(version: int) -> dict[str, Any]:
    return {"w": torch.full((1 << 20,), float(version)),  # 4 MiB: one block
            "big": torch.full((3 << 20,), float(version)),  # 12 MiB: three blocks
            "meta": {"version": version}}


def hang(name: str) -> None:
    print(f"hook {name}", flush=True)
    while True:
        time.sleep(60)


def install(hook: str) -> None:
    if hook == "before_write":
        real_write = writer.FastPersistWriter.write_data

        def write_data(self: Any, *args: Any, **kwargs: Any) -> Any:
            hang(hook)
            return real_write(self, *args, **kwargs)

        writer.FastPersistWriter.write_data = write_data  # type: ignore[method-assign]
    elif hook == "after_write":
        real_finish = writer.FastPersistWriter.finish

        def finish(self: Any, *args: Any, **kwargs: Any) -> None:
            hang(hook)
            real_finish(self, *args, **kwargs)

        writer.FastPersistWriter.finish = finish  # type: ignore[method-assign]
    elif hook == "before_manifest":
        real_commit = Staging.commit

        def commit(self: Any, *args: Any, **kwargs: Any) -> Any:
            hang(hook)
            return real_commit(self, *args, **kwargs)

        Staging.commit = commit  # type: ignore[method-assign]
    elif hook in ("before_publish", "after_publish"):
        real_publish = Staging._publish

        def publish(self: Any) -> bool:
            if hook == "before_publish":
                hang(hook)
            replaced = real_publish(self)
            hang(hook)
            return replaced

        Staging._publish = publish  # type: ignore[method-assign]
    elif hook == "mid_part":
        real_handover_commit = handover.Handover.commit

        def handover_commit(self: Any, *args: Any, **kwargs: Any) -> None:
            hang(hook)
            real_handover_commit(self, *args, **kwargs)

        handover.Handover.commit = handover_commit  # type: ignore[method-assign]
    elif hook in ("before_commit_job", "after_commit_job"):
        real_commit_job = ThroughDaemon.publish

        def commit_job(self: Any, *args: Any, **kwargs: Any) -> str:
            if hook == "before_commit_job":
                hang(hook)
            error = real_commit_job(self, *args, **kwargs)
            hang(hook)
            return error

        ThroughDaemon.publish = commit_job  # type: ignore[method-assign]
    else:
        raise ValueError(hook)


def main() -> None:
    warnings.simplefilter("ignore")
    target, hook = sys.argv[1], sys.argv[2]
    daemon = sys.argv[3] if len(sys.argv) > 3 else ""
    dcp.save(state(1), storage_writer=FastPersistWriter(target, daemon=daemon))
    print("saved 1", flush=True)
    install(hook)
    dcp.save(state(2), storage_writer=FastPersistWriter(target, daemon=daemon))
    print("saved 2", flush=True)


if __name__ == "__main__":
    main()
