"""`env.processes=N`: each episode's environment lives in one of N worker processes (CPU-heavy environments run
beside the trainer, not in its interpreter) — the same episodes, rewards and trained steps as in the trainer's
process; calls of different workers at once; a worker that exits fails only its episodes' calls (scored or one
line), and the next episodes get a new one; a call past env.timeout_s ends its episode."""

import os

import pytest
from chat_fixtures import hermes_call, qwen2_style_tokenizer
from process_envs import EXIT_ENV, MEETING_ENV, TRAINER_PID_ENV, Exiting, MeetAcrossWorkers
from test_agentic_rollouts import EPISODES, Answers, Hanging, Turns
from test_environment_factory import ROW as COUNTER_ROW
from test_environment_factory import plugin
from test_multiturn import ROW, Script, pieces
from test_staleness import steps_of

from lorarl.trainer.cli import main
from lorarl.trainer.config import load_config
from lorarl.trainer.engines import SamplingParams
from lorarl.trainer.envs import ENVIRONMENTS
from lorarl.trainer.envs.episodes import EnvError, EpisodeRunner
from lorarl.trainer.errors import TrainerError
from lorarl.trainer.rollout import episode_returns, final_responses
from lorarl.trainer.schema import EnvSection
from lorarl.trainer.scoring import Rewards


class Concluding(Turns):
    @classmethod
    def conclude(cls, groups) -> None:
        pass


def played(name: str, env_class, runs: int = 1, **settings) -> list:
    """`runs` batches of the episodes of `env_class` in worker processes (env.processes=2 unless `settings` say)."""
    tok = qwen2_style_tokenizer()
    ENVIRONMENTS.register(name)(env_class)
    run = EpisodeRunner(EnvSection(name=name, **{"processes": 2, **settings}), tok, eos=tok.eos_token_id)
    try:
        batches = []
        for _ in range(runs):
            episodes = run.episodes([ROW], EPISODES)
            run.play(Answers(tok), episodes, SamplingParams(max_tokens=8))
            batches.append(episodes)
        return batches
    finally:
        run.close()
        ENVIRONMENTS.remove(name)


def test_the_workers_steps_run_in_parallel_outside_the_trainers_process(tmp_path, monkeypatch):
    monkeypatch.setenv(MEETING_ENV, str(tmp_path))
    monkeypatch.setenv(TRAINER_PID_ENV, str(os.getpid()))
    [episodes] = played("meet_across_workers", MeetAcrossWorkers)
    assert [e.stop_reason for e in episodes] == ["done"] * EPISODES
    assert [e.rewards for e in episodes] == [[0.0, 0.0, 1.0]] * EPISODES
    assert len(os.listdir(tmp_path)) == 2  # two worker processes, neither the trainer's


def test_a_worker_that_exits_fails_its_episodes_scored_and_the_next_batch_gets_a_new_one(monkeypatch):
    monkeypatch.setenv(EXIT_ENV, "1")
    tok = qwen2_style_tokenizer()
    ENVIRONMENTS.register("exiting")(Exiting)
    run = EpisodeRunner(EnvSection(name="exiting", processes=1, on_error="score", error_score=-1.0), tok,
                        eos=tok.eos_token_id)  # fmt: skip
    try:
        episodes = run.episodes([ROW], EPISODES)
        run.play(Answers(tok), episodes, SamplingParams(max_tokens=8))
        assert [(e.stop_reason, e.rewards) for e in episodes] == [("error", [-1.0])] * EPISODES
        monkeypatch.setenv(EXIT_ENV, "0")  # the next worker's environments do not exit
        episodes = run.episodes([ROW], EPISODES)
        run.play(Answers(tok), episodes, SamplingParams(max_tokens=8))
        assert [(e.stop_reason, e.rewards) for e in episodes] == [("done", [0.0, 0.0, 1.0])] * EPISODES
    finally:
        run.close()
        ENVIRONMENTS.remove("exiting")


def test_a_worker_that_exits_stops_the_run_in_one_line(monkeypatch):
    monkeypatch.setenv(EXIT_ENV, "1")
    with pytest.raises(EnvError, match=r"^the environment \(exiting\) raised in step on the episode of train.jsonl "
                                       r"line 3: WorkerDied: the env.processes worker holding this episode's "
                                       r"environment exited \(exit code 3\) \(env.on_error=score"):  # fmt: skip
        played("exiting", Exiting, processes=1)


def test_a_call_past_the_timeout_in_a_worker_ends_its_episode():
    [episodes] = played("hanging", Hanging, timeout_s=0.5, on_error="score", error_score=-1.0)
    assert [(e.stop_reason, e.rewards) for e in episodes] == [("timeout", [-1.0])] * EPISODES


def test_an_environment_that_concludes_its_batches_is_refused_in_one_line():
    with pytest.raises(TrainerError, match=r"^env.processes=2: env.name=concluding concludes its batches in the "
                                           r"trainer's process \(Environment.conclude\), which a worker cannot: "
                                           r"set env.processes=0$"):  # fmt: skip
        played("concluding", Concluding)


@pytest.mark.parametrize("processes", [0, 2])
def test_a_trl_environment_in_workers_gives_the_rewards_it_gives_in_the_trainers_process(tmp_path, processes):
    """TRL's `IncrementEnv` (its async tool included) in worker processes: its tools run on each episode's own
    instance there; `get_reward()` and the `environments` TRL's reward functions read come back with the episode."""
    spec = f"{plugin(tmp_path)}:AsyncIncrementEnv"
    config = load_config(None, [f"env={spec}", "env.tool_format=hermes", f"env.processes={processes}"])
    tok = qwen2_style_tokenizer()
    run = EpisodeRunner(config.env, tok, eos=tok.eos_token_id)
    try:
        episodes = run.start([COUNTER_ROW, COUNTER_ROW], 1)
        right = [pieces(hermes_call("increment", {"step": 3}), tok), [*pieces("done", tok), "<|im_end|>"]]
        short = [pieces(hermes_call("increment", {"step": 1}), tok), pieces(hermes_call("double", {}), tok),
                 [*pieces("done", tok), "<|im_end|>"]]  # fmt: skip
        run.play(Script(tok, [right, short]), episodes, SamplingParams(max_tokens=64))
    finally:
        run.close()
    assert [e.stop_reason for e in episodes] == ["answer", "answer"]
    assert [e.env.reward_columns()["environments"].counter for e in episodes] == [3, 2]
    reward = Rewards(load_config(None, [f"reward.fns=[{plugin(tmp_path)}:counter_reward]"]).reward)
    scores = reward.score(final_responses(episodes, tok))
    assert episode_returns(episodes, scores) == [1.0, -0.1]  # get_reward() + the reward function
    prompt, after = episodes[1].env.conversation(episodes[1].actions)
    assert prompt[0]["content"] == "Start. Increment the counter by 3."
    assert [m["role"] for m in after] == ["assistant", "tool", "assistant", "tool", "assistant"]


def test_a_run_with_its_environments_in_workers_trains_the_steps_it_trains_without(tmp_path):
    """The calculator task (its tool called in the workers): each step's metrics those of the same run with its
    environments in the trainer's process."""
    keys = ["task=calculator", "data.batch_size=4", "rollout.n=4", "trainer.eval_every=0", "trainer.steps=2"]
    assert main([*keys, f"trainer.output_dir={tmp_path / 'here'}"]) == 0
    assert main([*keys, "env.processes=2", f"trainer.output_dir={tmp_path / 'workers'}"]) == 0
    assert steps_of(tmp_path / "workers") == steps_of(tmp_path / "here")
