"""A rollout worker that fails to start (here: a model directory that does not exist) makes the trainer raise at once
with the worker's own error — not after the sync group's timeout (10 minutes by default), waiting for a dead peer."""

import time

import pytest

from lorarl.trainer.engines import EngineError
from lorarl.trainer.engines.hf import HFSettings, HFWorker
from lorarl.trainer.engines.process import ProcessEngine

SETTINGS = HFSettings("/no/such/model", None, "cpu", 1, 0, 8, timeout=300.0)


def test_a_worker_process_that_cannot_start_is_reported_at_once():
    started = time.monotonic()
    with pytest.raises(EngineError, match="/no/such/model"):
        ProcessEngine(HFWorker, SETTINGS, bucket_bytes=1 << 20)
    assert time.monotonic() - started < 60


def test_a_ray_replica_that_cannot_start_is_reported_at_once():
    ray = pytest.importorskip("ray")
    from lorarl.trainer.engines.ray_actors import RayEngines

    started = time.monotonic()
    with pytest.raises(EngineError, match="/no/such/model"):
        RayEngines(HFWorker, SETTINGS, replicas=1, bucket_bytes=1 << 20)
    assert time.monotonic() - started < 90
    assert not ray.is_initialized()  # the Ray it started is shut down again
