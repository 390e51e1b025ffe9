"""tierstore.cli.metrics: the Prometheus families, the per-step log line, migration lag from a real index."""

from __future__ import annotations

import logging
import urllib.request

import pytest
import torch

from tierstore.cli import metrics
from tierstore.keys import ShardKey

pytest.importorskip("prometheus_client", reason="prometheus_client is not installed (tierstore[metrics])")


def test_record_step_exports_and_logs(caplog):
    m = metrics.Metrics()
    fig = metrics.StepFigures("gpt", 7, rank=1, stall_s=0.004, bytes_by_tier={"host": 1000, "durable": 1000},
                              bytes_by_kind={"full": 1000}, commit_latency_s=0.02, state="committed")
    with caplog.at_level(logging.INFO, logger="tierstore.cli.metrics"):
        m.record_step(fig)
        m.record_restore("gpt", "host", 0.5, step=7)
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0] == ("checkpoint model=gpt step=7 rank=1 state=committed stall_ms=4.00 commit_ms=20.0 "
                        "bytes[durable=1000 host=1000] kinds[full=1000]")
    assert "restore model=gpt step=7 tier=host" in lines[1]
    text = m.exposition().decode()
    assert 'tierstore_bytes_written_total{kind="full",model="gpt",tier="host"} 1000.0' in text
    assert 'tierstore_save_stall_seconds_count{model="gpt"} 1.0' in text
    assert 'tierstore_commit_latency_seconds_sum{model="gpt"} 0.02' in text
    assert 'tierstore_restore_seconds_count{model="gpt",tier="host"} 1.0' in text
    assert 'tierstore_last_step{model="gpt"} 7.0' in text
    # a second instance has its own registry: no duplicate-registration error
    assert b"tierstore_last_step{" not in metrics.Metrics().exposition()


def test_migration_lag(store):
    m = metrics.Metrics()
    assert m.update_migration_lag(store.steps, "gpt") == (0, 0.0)
    for step in (1, 2):
        store.begin_step("gpt", step, 1)
        store.vote("gpt", step, 0, [store.put(ShardKey("gpt", "a", step, 0), {"w": torch.ones(4)})])
    store.flush()
    assert store.wait_step("gpt", 2, timeout=10) == "durable"
    assert m.update_migration_lag(store.steps, "gpt") == (0, 0.0)
    # a committed step whose migration has not finished: the durable tier lags one step
    store.steps.begin("gpt", 3, 1)
    store.steps.vote("gpt", 3, 0, [])
    steps, seconds = m.update_migration_lag(store.steps, "gpt")
    assert steps == 1 and seconds >= 0
    assert 'tierstore_migration_lag_steps{model="gpt"} 1.0' in m.exposition().decode()


def test_serve_exposes_the_global_registry():
    port = metrics.serve(0)
    assert port
    metrics.default().record_step(metrics.StepFigures("served", 3, bytes_by_tier={"host": 5}))
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        body = r.read().decode()
    assert 'tierstore_last_step{model="served"} 3.0' in body
