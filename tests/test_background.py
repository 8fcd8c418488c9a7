"""Background work runs at a lower priority (fastpersist/background.py).

In a fresh process (a thread's nice value cannot be raised back, and the
process-wide Saver's writer thread outlives a test): the priority of the thread
that writes each data file, and of the codec's threads, with
FASTPERSIST_BACKGROUND_NICE set and off.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

CHILD = r"""
import json, os, sys, threading
import torch
import fastpersist
from fastpersist.codec import frame
from fastpersist.tensors import datafile, packed

seen = {"write": [], "encode": []}

def priority():
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

def spying(module, name, key):
    real = getattr(module, name)
    def spy(*args, **kwargs):
        seen[key].append(priority())
        return real(*args, **kwargs)
    setattr(module, name, spy)

spying(datafile, "write", "write")
spying(packed, "write", "write")
spying(frame, "encode", "encode")
root = sys.argv[1]
state = {"w": torch.arange(1 << 16, dtype=torch.float32)}
fastpersist.save(state, root + "/sync")
sync = seen["write"][:]
seen["write"].clear()
fastpersist.async_save(state, root + "/async").result()
fastpersist.async_save(state, root + "/zstd", compression="zstd").result()
print(json.dumps({"caller": priority(), "sync": sync, "async": seen["write"],
                  "encode": sorted(set(seen["encode"]))}))
"""


@pytest.mark.skipif(not hasattr(os, "setpriority"), reason="no per-thread priorities here")
@pytest.mark.parametrize("nice", ["7", "0"])
def test_the_background_yields_the_cpu_and_the_caller_does_not(tmp_path: Path,
                                                                nice: str) -> None:
    env = dict(os.environ, FASTPERSIST_BACKGROUND_NICE=nice)
    done = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path)], env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    got = json.loads(done.stdout)
    base = got["caller"]  # (the test runner's own nice value, normally 0)
    assert got["sync"] == [base]  # a blocking save runs on the caller's thread, as it is
    assert got["async"] and set(got["async"]) == {max(base, int(nice))}
    assert got["encode"] == [max(base, int(nice))]
