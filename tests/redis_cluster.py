"""Fixtures for a real Redis Cluster (see :mod:`tierstore.testing.rediscluster`)."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from tierstore.testing.rediscluster import LocalCluster

__all__ = ["LocalCluster", "cluster_url", "make_cluster", "redis_cluster"]


def make_cluster(workdir: Path, **kw) -> Iterator[LocalCluster]:
    cl = LocalCluster(workdir, **kw)
    try:
        cl.start()
        yield cl
    finally:
        cl.stop()
        shutil.rmtree(workdir, ignore_errors=True)


@pytest.fixture(scope="session")
def redis_cluster(tmp_path_factory) -> Iterator[LocalCluster]:
    """One 3+3 cluster for the session (tests that break its topology make their own). Its node timeout is
    long: nothing fails it over on purpose, and a loaded CI machine must not do so by accident."""
    yield from make_cluster(tmp_path_factory.mktemp("cluster"), node_timeout_ms=10000)


@pytest.fixture
def cluster_url(redis_cluster: LocalCluster) -> str:
    """The session cluster's seed URL, flushed."""
    redis_cluster.wait_ok()
    redis_cluster.flushall()
    return redis_cluster.url
