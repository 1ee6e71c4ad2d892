"""`trainer.backend=ray` on CPU: two HF rollout replicas as Ray actors, the merged weights broadcast to both over one
gloo group, prompts spread across them; a short run learns as the local backend does; the local cluster listens on
loopback alone."""

import json

import pytest
from listeners import on_loopback_alone, watching
from trainer_fixtures import tiny_overrides

from lorarl.lora_merge import iter_merged_weights
from lorarl.trainer.cli import main
from lorarl.trainer.config import load_config
from lorarl.trainer.engines import SamplingParams
from lorarl.trainer.engines.hf import checksum
from lorarl.trainer.engines.ray_actors import RayEngines  # before Ray itself: it settles how Ray starts workers
from lorarl.trainer.loop import Trainer
from lorarl.trainer.presets import PRESETS

pytest.importorskip("ray")


def test_two_replicas_receive_the_merged_weights_and_share_the_prompts(tiny_setup, tmp_path):
    import ray

    overrides = tiny_overrides(tiny_setup, tmp_path / "out", trainer__backend="ray", rollout__replicas=2)
    trainer = Trainer(load_config(None, overrides, presets=PRESETS))
    trainer.start_engine()
    assert isinstance(trainer.engine, RayEngines)
    try:
        pids = ray.get([actor.__ray_call__.remote(lambda self: __import__("os").getpid()) for actor in
                        trainer.engine.actors])  # fmt: skip
        assert len(set(pids)) == 2
        trainer.weights.sync()
        metrics = trainer.train_step(1)
        assert trainer.engine.version == 1
        assert metrics["sync/bytes"] > 0

        merged = iter_merged_weights(trainer.model, dtype=trainer.rollout_dtype)
        assert trainer.engine.checksum() == checksum(merged)  # both replicas hold exactly the trainer's merged weights
        prompts = [[3, 4, 5], [6, 7], [8], [9, 10, 11], [12]]
        completions = trainer.engine.generate(prompts, SamplingParams(n=2, max_tokens=3))
        assert [c.prompt_index for c in completions] == [0, 0, 1, 1, 2, 2, 3, 3, 4, 4]
        assert {c.version for c in completions} == {1}
    finally:
        trainer.engine.close()
    assert not ray.is_initialized()


def test_a_ray_run_learns_and_its_local_cluster_listens_on_loopback_alone(tiny_setup, tmp_path):
    out = tmp_path / "out"
    with watching() as seen:  # Ray's GCS, raylet and workers, the replicas' sync group (Ray authenticates no one)
        assert main(tiny_overrides(tiny_setup, out, trainer__backend="ray", rollout__replicas=2)) == 0
    assert on_loopback_alone(seen, {"gcs_server", "raylet"}), seen
    rewards = [json.loads(line)["reward/mean"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(rewards) == 12
    assert sum(rewards[-3:]) / 3 > sum(rewards[:3]) / 3 + 0.1


def test_replicas_need_the_ray_backend(tiny_setup, tmp_path):
    assert main(tiny_overrides(tiny_setup, tmp_path / "out", rollout__replicas=2)) == 2


def test_trainer_ranks_as_ray_actors_learn(tiny_setup, tmp_path, capsys):
    """Two data-parallel trainer ranks (FSDP2 over gloo) as Ray actors, with a rollout replica as a third actor; the
    local cluster and the ranks' group listen on loopback alone."""
    out = tmp_path / "out"
    overrides = tiny_overrides(tiny_setup, out, trainer__backend="ray", trainer__n_gpus_per_node=2)
    with watching() as seen:  # the ranks' own group too
        assert main(overrides) == 0
    assert on_loopback_alone(seen, {"gcs_server", "raylet"}), seen
    rewards = [json.loads(line)["reward/mean"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(rewards) == 12  # written once, by rank 0
    assert sum(rewards[-3:]) / 3 > sum(rewards[:3]) / 3 + 0.1
    assert (out / "checkpoints" / "step_12" / "adapter" / "adapter_model.safetensors").is_file()
    assert "done: 12 steps" in capsys.readouterr().out
