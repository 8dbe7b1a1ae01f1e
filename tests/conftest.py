"""Shared fixtures: a real one-node SLURM cluster, started once per test session when installed."""
from __future__ import annotations

import os

import pytest
from slurm_cluster import missing_tools, start_cluster, stop_cluster


@pytest.fixture(scope="session")
def slurm(tmp_path_factory):
    missing = missing_tools()
    if missing:
        reason = f"SLURM is not installed (missing: {', '.join(missing)}); .ci/run installs it"
        if os.environ.get("CI") == "true":
            pytest.fail(reason + " - in CI a missing SLURM is a failure, not a skip")
        pytest.skip(reason)
    cluster, pids = start_cluster(tmp_path_factory.mktemp("slurm"))
    try:
        yield cluster
    finally:
        stop_cluster(pids)
