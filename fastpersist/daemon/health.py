"""The health the daemon reports: SERVING only while it can serve.

The standard gRPC health service answers from its own table, without the
daemon's lock: left alone it would say SERVING while every request waits on
a stuck lock or the root has gone. A watchdog thread asks the service what
would stop it (unable(): the root removed, the lock held for
seconds, a worker dead) every second and sets the table from the answer.

Torch-free: this runs in the daemon.
"""

from __future__ import annotations

import threading

from grpc_health.v1 import health, health_pb2

from . import logs
from .service import Service

SERVICE_NAME = "fastpersist.v1.FastPersist"
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def health_servicer() -> health.HealthServicer:
    h = health.HealthServicer()
    set_status(h, SERVING)
    return h


def set_status(h: health.HealthServicer, status: int) -> None:
    for name in ("", SERVICE_NAME):
        h.set(name, status)


class Watchdog:
    def __init__(self, service: Service, servicer: health.HealthServicer,
                 interval: float = 1.0, lock_timeout: float = 5.0) -> None:
        self.service = service
        self.servicer = servicer
        self.interval = interval
        self.lock_timeout = lock_timeout
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="fpd-watchdog", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        reason = ""
        while not self._stop.wait(self.interval):
            try:
                now = unable(self.service, self.lock_timeout)
            except Exception as exc:  # the check itself failed: report, do not die
                now = f"the health check failed: {exc!r}"
            if now == reason or self._stop.is_set():
                continue
            if now:
                logs.error("not-serving", reason=now)
            else:
                logs.info("serving-again", was=reason)
            set_status(self.servicer, NOT_SERVING if now else SERVING)
            reason = now

    def stop(self) -> None:
        """Stop watching (before the daemon drains and says NOT_SERVING for good)."""
        self._stop.set()
        self._thread.join()


def unable(service: Service, timeout: float) -> str:
    """Why the daemon cannot serve ("" when it can): the health check's
    view (health.py). Takes the lock with a timeout: a request that held it
    this long would stall every other."""
    if not service.root.alive():
        return f"its root {service.root.path} is gone"
    r = service.registry
    if not r.cond.acquire(timeout=timeout):
        return f"its lock has been held for over {timeout:.0f} s"
    try:
        stopping = r.stopping
    finally:
        r.cond.release()
    if not stopping and not all(t.is_alive() for t in service.writers.threads):
        return "a write worker stopped"
    if not stopping and not r.janitor.alive():
        return "the janitor stopped"
    return ""
