"""Runs whose processes are all on this machine listen on loopback alone: the rollout engine's process and the
weight-sync group's rendezvous here; a local Ray cluster (its GCS, raylet and workers) with engine replicas or trainer
ranks in `test_ray_backend`, torchrun's ranks on one node in `test_data_parallel` (each watched in a run those tests
make anyway)."""

import sys

from listeners import on_loopback_alone, run_and_watch
from trainer_fixtures import tiny_overrides


def test_a_run_with_its_engine_in_a_process_of_its_own_listens_on_loopback_alone(tiny_setup, tmp_path):
    command = [sys.executable, "-m", "lorarl.trainer.cli",
               *tiny_overrides(tiny_setup, tmp_path / "out", trainer__steps=3, rollout__worker="process")]  # fmt: skip
    seen, _ = run_and_watch(command)
    assert on_loopback_alone(seen, {"python"}), seen
