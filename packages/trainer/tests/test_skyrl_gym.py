"""SkyRL-gym's registered environments (`env=skyrl_gym`), the real package: `gsm8k_multi_turn`'s feedback is rendered
after each action as the template renders it, each turn's reward is SkyRL's own `compute_score`, a data row's
`env_class` and `reward_spec` are SkyRL's, `env.max_turns` reaches the environment as SkyRL's generator passes its
`max_turns`, `env.skyrl_gym.<id>.*` is its `env_config`, an action cut at a length is stepped as SkyRL steps it — and a
run trains on it."""

import pytest
from chat_fixtures import chat_model_dir, qwen2_style_tokenizer, train_two_steps
from skyrl_gym.envs.gsm8k.utils import compute_score
from test_multiturn import Script, pieces

from lorarl.trainer import default_task
from lorarl.trainer.config import load_config
from lorarl.trainer.data import Example
from lorarl.trainer.engines import SamplingParams
from lorarl.trainer.envs.episodes import EnvError, EpisodeRunner

ROW = Example("What is 3+4?", "7", (), {"env_class": "gsm8k_multi_turn", "extra_info": {"max_turns": 9}}, "line 1")


def test_a_skyrl_gym_environment_plays_its_turns_with_its_rewards():
    config = load_config(None, ["env=skyrl_gym", "env.max_turns=3"])  # the row's env_class: gsm8k_multi_turn
    tok = qwen2_style_tokenizer()
    run = EpisodeRunner(config.env, tok, eos=tok.eos_token_id)
    (episode,) = run.start([ROW], 1)
    wrong, right = [*pieces("#### 5", tok), "<|im_end|>"], [*pieces("so #### 7", tok), "<|im_end|>"]
    run.play(Script(tok, [[wrong, right]]), [episode], SamplingParams(max_tokens=64))
    assert episode.stop_reason == "done"
    # SkyRL's generator hands the environment its max_turns, over the row's extra_info (gsm8k_multi_turn's format
    # score is 0.2 / max_turns)
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


def test_an_action_cut_at_a_length_is_stepped_as_skyrl_steps_it():
    config = load_config(None, ["env=skyrl_gym", "env.max_turns=3"])
    tok = qwen2_style_tokenizer()
    run = EpisodeRunner(config.env, tok, eos=tok.eos_token_id)
    (episode,) = run.start([ROW], 1)
    cut, right = pieces("#### 5", tok), [*pieces("so #### 7", tok), "<|im_end|>"]  # the first never ended
    run.play(Script(tok, [[cut, right]]), [episode], SamplingParams(max_tokens=64))
    assert episode.stop_reason == "done"
    assert episode.rewards == [compute_score(a, "7", format_score=0.2 / 3) for a in ("#### 5", "so #### 7")]


# SkyRL's rows as its gsm8k script (examples/train/gsm8k/gsm8k_dataset.py) writes them: data_source, prompt,
# env_class, reward_spec, extra_info — the ground truth in reward_spec, no other answer field
def skyrl_gsm8k_rows() -> list[dict]:
    instruction = 'Let\'s think step by step and output the final answer after "####".'
    return [{"data_source": "openai/gsm8k",
             "prompt": [{"role": "user", "content": f"What is {a} plus {a}? {instruction}"}], "env_class": "gsm8k",
             "reward_spec": {"method": "rule", "ground_truth": str(2 * a)},
             "extra_info": {"split": "train", "index": a, "answer": f"{a} + {a} = {2 * a}\n#### {2 * a}",
                            "question": f"What is {a} plus {a}?"}} for a in range(8)]  # fmt: skip


def train_on_skyrl_rows(tmp_path, model, *extra: str) -> list[dict]:
    """Two steps on SkyRL's gsm8k rows with no key set but the environment (and no reward function beside it)."""
    return train_two_steps(tmp_path, model, skyrl_gsm8k_rows(), "env=skyrl_gym", "reward.fn=none",
                           "rollout.max_tokens=12", *extra)  # fmt: skip


def test_skyrl_rows_as_skyrl_writes_them_train_with_no_key_set(tmp_path):
    steps = train_on_skyrl_rows(tmp_path, chat_model_dir(tmp_path / "model"))
    assert [s["step"] for s in steps] == [1, 2]
    assert all(s["env/turns"] == 1 for s in steps)  # gsm8k: one turn


def sql_database(root) -> None:
    """A database where SkyRL's text2sql finds a Spider row's (`<db_path>/spider/database/<db_id>/<db_id>.sqlite`)."""
    import sqlite3

    folder = root / "spider" / "database" / "staff"
    folder.mkdir(parents=True)
    with sqlite3.connect(folder / "staff.sqlite") as db:
        db.execute("CREATE TABLE employees (id INTEGER, name TEXT)")
        db.executemany("INSERT INTO employees VALUES (?, ?)", [(1, "Ada Lovelace"), (2, "Alan Turing")])


GOLD = "SELECT name FROM employees WHERE id = 1;"
SQL_ROW = {"data_source": "spider", "prompt": [{"role": "user", "content": "Who is employee 1? Answer in SQL."}],
           "env_class": "text2sql", "reward_spec": {"method": "rule", "ground_truth": GOLD}, "db_id": "staff",
           "data": "spider", "extra_info": {}}  # fmt: skip


def test_text2sql_runs_its_queries_on_the_database_its_env_config_names(tmp_path):
    sql_database(tmp_path / "sql")
    config = load_config(None, ["env=skyrl_gym", f"env.skyrl_gym.text2sql.db_path={tmp_path / 'sql'}",
                                "env.max_turns=3"])  # fmt: skip
    tok = qwen2_style_tokenizer()
    run = EpisodeRunner(config.env, tok, eos=tok.eos_token_id)
    row = Example(SQL_ROW["prompt"], None, (), {k: v for k, v in SQL_ROW.items() if k != "prompt"}, "sql row 1")
    (episode,) = run.start([row], 1)
    query = [*pieces(f"<think>look</think><sql>{GOLD}</sql>", tok), "<|im_end|>"]
    answer = [*pieces(f"<think>found</think><solution>{GOLD}</solution>", tok), "<|im_end|>"]
    run.play(Script(tok, [[query, answer]]), [episode], SamplingParams(max_tokens=256))
    assert "Ada Lovelace" in episode.env.messages[2]["content"]  # the query ran on the database
    assert episode.rewards == [0.0, 1.0]  # the solution's rows are the gold query's
    assert episode.stop_reason == "done"


def train_on_text2sql(tmp_path, model, *extra: str) -> list[dict]:
    sql_database(tmp_path / "sql")
    return train_two_steps(tmp_path, model, [SQL_ROW] * 4, "env=skyrl_gym",
                           f"env.skyrl_gym.text2sql.db_path={tmp_path / 'sql'}", "reward.fn=none", "env.max_turns=2",
                           "rollout.max_tokens=12", "env.max_tokens=320", *extra)  # fmt: skip


def test_a_run_trains_on_text2sql(tmp_path):
    steps = train_on_text2sql(tmp_path, chat_model_dir(tmp_path / "model"))
    assert [s["step"] for s in steps] == [1, 2]
    assert all(s["env/turns"] == 2 for s in steps)  # its "invalid action" observation, then the last turn
    assert all(s["reward/mean"] == -1.0 for s in steps)  # a random model writes no <solution>: SkyRL's -1


def test_a_search_url_that_nothing_answers_is_one_line_naming_the_key():
    """SkyRL's search environment would retry each call for ~45 s, then give the model the error text: refused when
    the episode starts instead; a URL where a server listens passes."""
    import socket

    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    row = Example("Who wrote Hamlet?", "Shakespeare", (), {"env_class": "search"}, "line 1")
    search = f"env.skyrl_gym.search={{search_url: http://127.0.0.1:{port}/retrieve}}"
    config = load_config(None, ["env=skyrl_gym", search])
    tok = qwen2_style_tokenizer()
    with pytest.raises(EnvError, match=rf"^the environment \(skyrl_gym\) raised in reset on the episode of line 1: "
                                       rf"TrainerError: env\.skyrl_gym\.search\.search_url=http://127\.0\.0\.1:{port}/"
                                       r"retrieve: nothing answers there \(ConnectionRefusedError: .*\); SkyRL's "
                                       r"search environment calls it every turn: start it, or point the key at "
                                       r"it"):  # fmt: skip
        EpisodeRunner(config.env, tok, eos=tok.eos_token_id).start([row], 1)
    with socket.create_server(("127.0.0.1", 0)) as listening:
        url = f"http://127.0.0.1:{listening.getsockname()[1]}/retrieve"
        config = load_config(None, ["env=skyrl_gym", f"env.skyrl_gym.search={{search_url: {url}}}"])
        (episode,) = EpisodeRunner(config.env, tok, eos=tok.eos_token_id).start([row], 1)
        assert episode.stop_reason == ""  # started: its first observation is the prompt
