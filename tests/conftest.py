"""Shared fixtures. Hypothesis profiles: `ci` (default, quick) and `thorough`
(`HYPOTHESIS_PROFILE=thorough pytest`) for a long run on demand."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

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
