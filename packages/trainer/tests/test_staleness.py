"""`rollout.max_staleness=k`: the batch of step i comes from exactly the weights of step i-k (each batch on an engine
of its own, playing while the trainer trains), a batch from any other version is refused, and a resumed run repeats
an uninterrupted one."""

import json
import shutil

import pytest
import torch

from lorarl.trainer import data, default_task
from lorarl.trainer.cli import main
from lorarl.trainer.config import load_config
from lorarl.trainer.context import fit_context
from lorarl.trainer.engines import EngineError, SamplingParams
from lorarl.trainer.engines.hf import HFSettings, HFWorker
from lorarl.trainer.engines.inline import InlineEngine
from lorarl.trainer.envs.episodes import episode_runner
from lorarl.trainer.models import load_tokenizer
from lorarl.trainer.rollout import play_episodes

STALE = ["task=calculator", "rollout.worker=process", "algorithm.rollout_correction=token", "data.batch_size=4",
         "rollout.n=4", "trainer.eval_every=0", "trainer.steps=5"]  # fmt: skip


def steps_of(out) -> dict[int, dict]:
    """Each step's metrics, timings and thread counts aside (they differ run to run)."""
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: {k: v for k, v in r.items() if not k.startswith("timing/") and k != "threads"} for r in rows}


def test_batches_come_from_the_weights_k_steps_before_and_a_resumed_run_repeats_an_uninterrupted_one(tmp_path):
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    assert main([*STALE, "rollout.max_staleness=2", "trainer.save_every=2", f"trainer.output_dir={whole}"]) == 0
    steps = steps_of(whole)
    assert [steps[i]["rollout/version_lag"] for i in range(1, 6)] == [0, 1, 2, 2, 2]  # the first k: the run's start
    (resumed / "checkpoints").mkdir(parents=True)
    shutil.copytree(whole / "checkpoints" / "step_2", resumed / "checkpoints" / "step_2")  # stopped after step 2
    assert main([*STALE, "rollout.max_staleness=2", "trainer.resume=auto", f"trainer.output_dir={resumed}"]) == 0
    again = steps_of(resumed)
    assert sorted(again) == [3, 4, 5]
    assert all(again[i] == steps[i] for i in (3, 4, 5))  # its batches in flight started again from their weights


def test_a_batch_from_another_weight_version_is_refused():
    config = load_config(None, ["task=calculator"])
    model = default_task.EMBEDDED["calculator"]
    tok = load_tokenizer(model)
    runner = episode_runner(config, tok)
    fit_context(config, model, runner)
    examples, _ = data.load_examples("train", tok, config.data)
    engine = InlineEngine(HFWorker(HFSettings(str(model), torch.float32, "cpu", tok.eos_token_id, tok.pad_token_id,
                                              16)))  # fmt: skip
    assert len(play_episodes(engine, runner, examples[:2], 2, SamplingParams(max_tokens=8), version=0)) == 4
    with pytest.raises(EngineError, match=r"^the engine generated with weights version \[0\], expected 1$"):
        play_episodes(engine, runner, examples[:2], 2, SamplingParams(max_tokens=8), version=1)


@pytest.mark.parametrize(("extra", "message"), [
    (["rollout.overlap=true"], "rollout.max_staleness=1 and rollout.overlap: set one"),
    (["algorithm.rollout_correction=none"], "rollout.max_staleness=1 trains on rollouts of earlier weights: set "
                                            "algorithm.rollout_correction=token"),
    (["rollout.engine=vllm", "rollout.worker=inline"], "rollout.max_staleness=1 generates beside the training: it "
                                                       "needs rollout.worker=process"),
    (["algorithm=dapo"], "rollout.max_staleness=1 draws each step's batch ahead of it"),
    (["rollout.sync=auto"], "rollout.max_staleness=1 starts k + 1 engines: name the sync kind"),
    (["rollout.max_staleness=0", "rollout.in_flight_updates=true"], "rollout.in_flight_updates moves an episode to "
                                                                    "newer weights at its next turn: it needs"),
])  # fmt: skip
def test_settings_that_cannot_run_stale_are_refused_in_one_line(tmp_path, capsys, extra, message):
    assert main([*STALE, "rollout.max_staleness=1", *extra, f"trainer.output_dir={tmp_path / 'out'}"]) == 2
    assert not (tmp_path / "out").exists()
    assert capsys.readouterr().out.strip().splitlines()[-1].startswith(f"error: {message}")


SLOW_TURNS = '''
import time

from lorarl.trainer.envs.base import Environment, Observation, Step


class SlowTurns(Environment):
    """Three turns (an action cut at its length is stepped too), each step answering after 0.3 s: a batch's turns
    span the trainer's updates."""

    steps_truncated = True

    def reset(self, example):
        self.context, self.turn = tuple(example.prompt_ids), 0
        return Observation(self.context)

    def step(self, action):
        time.sleep(0.3)
        self.context, self.turn = self.context + action.tokens, self.turn + 1
        if self.turn == 3:
            return Step(reward=float(action.eos), done=True)
        return Step(observation=Observation(self.context))
'''


def test_in_flight_updates_move_an_episode_to_newer_weights_at_its_next_turn(tmp_path):
    """Plain, every action of a batch comes from its version, k behind; with in-flight updates, the turns after an
    update come from the newer weights: the actions' mean lag falls below the batch's."""
    (tmp_path / "slow.py").write_text(SLOW_TURNS)
    common = ["rollout.worker=process", "algorithm.rollout_correction=token", "rollout.max_staleness=1",
              f"env={tmp_path / 'slow.py'}:SlowTurns", "env.max_turns=3", "env.max_tokens=24", "rollout.max_tokens=4",
              "data.batch_size=4", "rollout.n=2", "trainer.steps=4", "trainer.eval_every=0"]  # fmt: skip
    plain, moving = tmp_path / "plain", tmp_path / "moving"
    assert main([*common, f"trainer.output_dir={plain}"]) == 0
    assert main([*common, "rollout.in_flight_updates=true", f"trainer.output_dir={moving}"]) == 0
    for step in steps_of(plain).values():
        assert step["rollout/action_version_lag"] == step["rollout/version_lag"]
    later = [s for i, s in steps_of(moving).items() if i >= 2]
    assert all(s["env/turns"] == 3 for s in later)
    assert all(s["rollout/version_lag"] == 1 for s in later)  # an episode's first action: its batch's weights
    assert all(s["rollout/action_version_lag"] <= 1 for s in later)
    assert min(s["rollout/action_version_lag"] for s in later) < 1  # a batch whose turns met an update took it
