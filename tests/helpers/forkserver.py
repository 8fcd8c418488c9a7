"""The loop shared by the fork servers in this directory (kill_saver.py,
checkpointer_child.py); tests/support.py's ForkServer is the test's side.

A server is started once per test module: it imports torch and fastpersist,
then forks one child per job it reads on stdin, so a kill costs a fork
instead of a fresh interpreter. It never runs a torch operation itself, so
the forks start clean. One child runs at a time.

stdin:  one JSON job per line, run in the child by the server's run_job
stdout: "<pid> <event> [args]" lines, each written with one os.write (emit) so
        that lines from the server and its children never interleave:
          server: "zygote-ready", "forked PID", "exited PID STATUS"
          child:  what run_job emits, and "error JSON-TRACEBACK" if it raises
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import sys
import traceback
from collections.abc import Callable
from typing import Any


def emit(msg: str) -> None:
    os.write(1, f"{os.getpid()} {msg}\n".encode())


def serve(run_job: Callable[[dict[str, Any]], None]) -> None:
    """Fork a child for each job on stdin and have it run run_job(job), with the
    job's "env" in its environment."""
    emit("zygote-ready")
    for line in sys.stdin:
        if not line.strip():
            continue
        job = json.loads(line)
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                os.close(0)
                # Die with the server, so a crashed test leaves no child behind
                # (hanging in a hook, say).
                ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
                os.environ.update(job.get("env", {}))
                run_job(job)
            except BaseException:
                emit("error " + json.dumps(traceback.format_exc()))
                code = 1
            os._exit(code)
        emit(f"forked {pid}")
        _, status = os.waitpid(pid, 0)
        emit(f"exited {pid} {status}")
