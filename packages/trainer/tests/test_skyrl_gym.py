"""SkyRL-gym's registered environments (`env=skyrl_gym`), the real package: `gsm8k_multi_turn`'s feedback is rendered
after each action as the template renders it, each turn's reward is SkyRL's own `compute_score`, a data row's
`env_class` and `reward_spec` are SkyRL's — and a run trains on it."""

import pytest
from chat_fixtures import qwen2_style_tokenizer, train_two_steps
from skyrl_gym.envs.gsm8k.utils import compute_score
from test_multiturn import Script, pieces

from lorarl.trainer import default_task
from lorarl.trainer.config import load_config
from lorarl.trainer.data import Example
from lorarl.trainer.engines import SamplingParams
from lorarl.trainer.envs.episodes import EpisodeRunner

ROW = Example("What is 3+4?", "7", (), {"env_class": "gsm8k_multi_turn", "extra_info": {"max_turns": 3}}, "line 1")


def test_a_skyrl_gym_environment_plays_its_turns_with_its_rewards():
    config = load_config(None, ["env=skyrl_gym"])  # the row's env_class chooses gsm8k_multi_turn
    tok = qwen2_style_tokenizer()
    run = EpisodeRunner(config.env, tok, eos=tok.eos_token_id)
    (episode,) = run.start([ROW], 1)
    wrong, right = [*pieces("#### 5", tok), "<|im_end|>"], [*pieces("so #### 7", tok), "<|im_end|>"]
    run.play(Script(tok, [[wrong, right]]), [episode], SamplingParams(max_tokens=64))
    assert episode.stop_reason == "done"
    want = [compute_score(a, "7", format_score=0.2 / 3) for a in ("#### 5", "so #### 7")]
    assert episode.rewards == want
    assert want[1] == 1.0
    feedback = episode.env.messages[2]
    assert feedback["role"] == "user"
    assert "#### ANSWER" in feedback["content"]
    (segment,) = episode.segments
    sampled = [t for t, m in zip(segment.tokens, segment.mask, strict=True) if m]
    assert sampled == tok.convert_tokens_to_ids(wrong + right)  # the feedback's tokens are the environment's
    rendered = tok.apply_chat_template(episode.env.messages, tokenize=False)
    assert list(segment.prompt) + segment.tokens == tok.encode(rendered.removesuffix("\n"), add_special_tokens=False)


def train_on_gsm8k(tmp_path, model, *extra: str) -> list[dict]:
    """Two steps on SkyRL-gym's `gsm8k_multi_turn` with no reward function beside it: the steps' metrics."""
    rows = [{"prompt": f"What is {a}+{a}?", "answer": str(2 * a), "extra_info": {"max_turns": 2}} for a in range(8)]
    return train_two_steps(tmp_path, model, rows, "env=skyrl_gym", "env.skyrl_gym.id=gsm8k_multi_turn",
                           "reward.fn=none", "env.max_tokens=40", "rollout.max_tokens=12", *extra)  # fmt: skip


def test_a_run_trains_on_a_skyrl_gym_environment(tmp_path):
    """Two steps on the HF engine with the embedded calculator model (it ends its turns; it never writes "#### n"):
    episodes of SkyRL's two turns, the engine's log-probs of the action tokens as the trainer recomputes them."""
    steps = train_on_gsm8k(tmp_path, default_task.EMBEDDED["calculator"])
    assert len(steps) == 2
    assert all(s["env/turns"] > 1 for s in steps)
    assert all(s["rollout/abs_logp_diff"] < 0.02 for s in steps)


def test_without_the_extra_the_run_is_refused_in_one_line(monkeypatch):
    import importlib
    import sys

    from lorarl.trainer.errors import TrainerError

    monkeypatch.setitem(sys.modules, "skyrl_gym", None)  # what an environment without the package imports
    monkeypatch.delitem(sys.modules, "lorarl.trainer.envs.skyrl", raising=False)
    with pytest.raises(TrainerError, match=r"^env=skyrl_gym needs the skyrl-gym extra: uv sync --extra skyrl-gym"):
        importlib.import_module("lorarl.trainer.envs.skyrl")
