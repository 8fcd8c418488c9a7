"""Shared fixtures. Hypothesis profiles: `ci` (default, quick) and `thorough`
(`HYPOTHESIS_PROFILE=thorough pytest`) for a long run on demand."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, settings

settings.register_profile(
    "ci", max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile(
    "thorough", max_examples=2000, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture(params=["native", "python"])
def engine_name(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """Run the test once with the C engine and once with the reference engine."""
    monkeypatch.setenv("FASTPERSIST_ENGINE", request.param)
    yield request.param


@pytest.fixture
def big_tmp(tmp_path: Path) -> Iterator[Path]:
    """tmp_path, emptied afterwards: pytest keeps old tmp dirs, and these are large."""
    yield tmp_path
    shutil.rmtree(tmp_path, ignore_errors=True)


@pytest.fixture
def daemon(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """A running fastpersistd (tests/daemon_support.py) on a temporary root, socket
    and shared-memory directory; this process's clients use that directory."""
    from daemon_support import Daemon

    d = Daemon(tmp_path).start()
    monkeypatch.setenv("FASTPERSIST_SHM_DIR", str(d.shm_dir))
    try:
        yield d
    finally:
        _close_remote_savers()
        d.cleanup()


def _close_remote_savers() -> None:
    """Drop the process-wide save pipelines, so their segments go with the test."""
    from fastpersist.saving.registry import close_shared

    close_shared(abort=True)


@pytest.fixture(scope="session")
def moto_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """One moto S3 server (a subprocess on localhost) for the session."""
    from tier_support import MotoServer

    server = MotoServer(tmp_path_factory.mktemp("moto")).start()
    try:
        yield server
    finally:
        server.kill()


@pytest.fixture
def s3(moto_server: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
       request: pytest.FixtureRequest) -> Any:
    """A bucket of this test's own on the session's moto server, with the
    environment (here and for subprocesses) pointing boto3 at it. Returns a
    namespace: .endpoint, .bucket, .url (s3://bucket/ckpts), .client (boto3)."""
    import hashlib
    import re
    import types

    from tier_support import environment, make_bucket

    for name, value in environment(moto_server.endpoint, tmp_path).items():
        monkeypatch.setenv(name, value)
    digest = hashlib.sha1(request.node.nodeid.encode()).hexdigest()[:8]
    bucket = re.sub(r"[^a-z0-9]+", "-", request.node.name.lower())[:40].strip("-") + "-" + digest
    client = make_bucket(moto_server.endpoint, bucket)
    return types.SimpleNamespace(endpoint=moto_server.endpoint, bucket=bucket,
                                 url=f"s3://{bucket}/ckpts", client=client, server=moto_server)
