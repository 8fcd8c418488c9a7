"""A real S3 server for the tier's tests: moto's, as a subprocess on localhost.

Imported as `tier_support` (tests/ is on sys.path); the `s3` fixture in
conftest.py gives each test a bucket of its own on one server per session,
and tests that kill the server start their own (MotoServer).
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class MotoServer:
    def __init__(self, workdir: Path, port: int | None = None) -> None:
        self.port = port or free_port()
        self.log_path = workdir / f"moto-{self.port}.log"
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 30.0) -> MotoServer:
        log = open(self.log_path, "ab")  # noqa: SIM115 (the process owns it)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
            stdout=log, stderr=log, start_new_session=True)
        log.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"moto_server exited:\n{self.log_path.read_text()}")
            with contextlib.suppress(OSError):
                urllib.request.urlopen(self.endpoint + "/moto-api/", timeout=1).close()
                return self
            time.sleep(0.1)
        raise RuntimeError("moto_server did not start")

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def restart(self) -> MotoServer:
        self.kill()
        return self.start()


def environment(endpoint: str, home: Path) -> dict[str, str]:
    """What points boto3 (here and in subprocesses) at the server, and nowhere else."""
    return {
        "AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_CONFIG_FILE": str(home / "aws-config"),
        "AWS_SHARED_CREDENTIALS_FILE": str(home / "aws-credentials"),
        # Connection errors fail fast: the tests kill the server on purpose.
        "FASTPERSIST_TIER_ATTEMPTS": "2",
    }


def make_bucket(endpoint: str, name: str) -> Any:
    import boto3

    client = boto3.client("s3", endpoint_url=endpoint, aws_access_key_id="testing",
                          aws_secret_access_key="testing", region_name="us-east-1")
    with contextlib.suppress(client.exceptions.BucketAlreadyOwnedByYou):
        client.create_bucket(Bucket=name)
    return client


def keys(client: Any, bucket: str, prefix: str = "") -> dict[str, int]:
    out = {}
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        for obj in page.get("Contents", []):
            out[obj["Key"]] = obj["Size"]
    return out
