"""Multi-turn episodes on the real vLLM CPU engine: a stop string ends a turn where the HF engine's decode ends it,
each request samples with its own seed, stop strings and length, and the embedded calculator task (inline and in a
process of its own), a TRL environment_factory class, a SkyRL-gym environment and verifiers environments train on
vLLM, with the engine's log-probs of the action tokens as close to the trainer's as single-turn runs keep them."""

import dataclasses
import json

import pytest
import torch
from chat_fixtures import chat_model_dir
from test_environment_factory import train_on_increment_env, train_on_trl_style
from test_skyrl_gym import train_on_gsm8k, train_on_skyrl_rows, train_on_text2sql
from test_trainer_vllm import LOGP_DIFF_LIMIT
from test_verifiers_env import train_on_verifiers

from lorarl.trainer import default_task
from lorarl.trainer.cli import main
from lorarl.trainer.engines import SamplingParams
from lorarl.trainer.engines.hf import HFSettings, HFWorker
from lorarl.trainer.engines.vllm_worker import VllmSettings, VllmWorker
from lorarl.trainer.models import load_tokenizer

MODEL = default_task.EMBEDDED["calculator"]


def test_stop_strings_end_the_turn_where_the_hf_engine_ends_it():
    tokenizer = load_tokenizer(MODEL)
    prompts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": f"{a}*{b}"}], add_generation_prompt=True, tokenize=True
        )["input_ids"]
        for a, b in ((123, 45), (907, 11), (350, 99))
    ]
    prompts = [p + tokenizer.encode("<call>", add_special_tokens=False) for p in prompts]  # the turn that calls
    greedy = SamplingParams(max_tokens=12, temperature=0.0, stop=("</call>",))
    vllm = VllmWorker(VllmSettings(str(MODEL), torch.float32, 1, 0.5, None, seed=0, max_lora_rank=None, devices=None,
                                   device="cpu", kv_cache_gb=0.1, inline=True))  # fmt: skip
    hf = HFWorker(HFSettings(str(MODEL), torch.float32, "cpu", tokenizer.eos_token_id, tokenizer.pad_token_id, 64))
    try:
        from_vllm, from_hf = vllm.generate(prompts, greedy), hf.generate(prompts, greedy)
        assert [c.token_ids for c in from_vllm] == [c.token_ids for c in from_hf]
        for completion in from_vllm:
            text = tokenizer.decode(list(completion.token_ids))
            assert completion.finished
            assert text.endswith("</call>")
            assert text.count("</call>") == 1
        repeated = [prompts[0]] * 6
        each = [SamplingParams(max_tokens=12, temperature=1.5, seed=3 + i) for i in range(6)]
        sampled = vllm.generate(repeated, each)
        assert len({c.token_ids for c in sampled}) > 1  # the same context, each episode its own seed
        assert [c.token_ids for c in vllm.generate(repeated, each)] == [c.token_ids for c in sampled]
        assert vllm.generate([repeated[4]], [each[4]])[0].token_ids == sampled[4].token_ids  # whatever is beside it
        # each request its own stop strings and length, as on the HF engine
        mixed = [greedy, dataclasses.replace(greedy, stop=(), max_tokens=3)]
        assert [c.token_ids for c in vllm.generate(prompts[:2], mixed)] == [
            c.token_ids for c in hf.generate(prompts[:2], mixed)]  # fmt: skip
    finally:
        vllm.close()


def test_seeded_requests_beyond_one_prefill_budget_sample_as_in_small_groups(tmp_path):
    """300 seeded requests of 60 tokens (18000 prefill tokens, more than one step's budget): vLLM's CPU build crashed
    where it split a seeded prefill into chunks ("CPU Generator does not use offset"); lorarl runs whole prefills.
    Each request's samples are its seed's, in a big batch as in groups of 10."""
    from vllm_cpu_helpers import engine_settings, make_model_dir

    model = make_model_dir(tmp_path / "model", tie=True)
    vllm = VllmWorker(dataclasses.replace(engine_settings(model), inline=True))
    try:
        prompts = [[(7 * i + j) % 90 + 3 for j in range(60)] for i in range(300)]
        each = [SamplingParams(max_tokens=4, temperature=1.0, seed=i) for i in range(300)]
        together = vllm.generate(prompts, each)
        apart = [c for i in range(0, 300, 10) for c in vllm.generate(prompts[i : i + 10], each[i : i + 10])]
        assert [c.token_ids for c in together] == [c.token_ids for c in apart]
    finally:
        vllm.close()


@pytest.mark.parametrize("worker", ["inline", "process"])
def test_the_calculator_task_trains_on_vllm(tmp_path, worker):
    out = tmp_path / "out"
    code = main(["task=calculator", "rollout.engine=vllm", "rollout.dtype=float32", f"rollout.worker={worker}",
                 "rollout.vllm.kv_cache_gb=0.25", "data.batch_size=8", "data.val_size=16", "trainer.steps=3",
                 "trainer.eval_every=3", f"trainer.output_dir={out}"])  # fmt: skip
    assert code == 0
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if r["step"] > 0]
    assert len(steps) == 3
    assert all(r["env/turns"] >= 1 for r in steps)
    assert any(r.get("env/tool_calls", 0) > 0 for r in steps)  # episodes of more than one turn were played
    assert max(r["rollout/abs_logp_diff"] for r in steps) < LOGP_DIFF_LIMIT  # over action tokens only
    assert "val/accuracy" in records[-1]


def test_episodes_that_outgrow_a_vllm_engine_capped_lower_end_with_stop_reason_context(tmp_path):
    """vLLM capped at 20 tokens (rollout.vllm.max_model_len), below the calculator's room of 24 prompt tokens and 40
    more: where vLLM refused the request mid-run, the episodes it cannot hold end as they end on the HF engine."""
    out = tmp_path / "out"
    code = main(["task=calculator", "rollout.engine=vllm", "rollout.dtype=float32", "rollout.vllm.max_model_len=20",
                 "rollout.vllm.kv_cache_gb=0.1", "data.batch_size=8", "trainer.steps=2", "trainer.eval_every=0",
                 "rollout.temperature=1.5", f"trainer.output_dir={out}"])  # fmt: skip
    assert code == 0
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert all(s["env/stop/context"] > 0 for s in steps)
    assert max(s["rollout/abs_logp_diff"] for s in steps) < LOGP_DIFF_LIMIT


def test_a_trl_environment_trains_on_vllm(tmp_path):
    """TRL's documented `IncrementEnv` (`env=module:Class`, unchanged) on the real engine: the engine's log-probs of
    the action tokens as close to the trainer's as single-turn runs keep them."""
    steps = train_on_increment_env(tmp_path, chat_model_dir(tmp_path / "model", head_dim=32), "rollout.engine=vllm",
                                   "rollout.dtype=float32", "rollout.vllm.kv_cache_gb=0.25")  # fmt: skip
    assert len(steps) == 2
    assert max(s["rollout/abs_logp_diff"] for s in steps) < LOGP_DIFF_LIMIT


def test_a_skyrl_gym_environment_trains_on_vllm(tmp_path):
    """SkyRL-gym's `gsm8k_multi_turn` (the real package) on the real engine, with the calculator model that ends its
    turns: episodes of two turns, the action-token log-probs as close as single-turn runs keep them."""
    steps = train_on_gsm8k(tmp_path, MODEL, "rollout.engine=vllm", "rollout.dtype=float32",
                           "rollout.vllm.kv_cache_gb=0.25")  # fmt: skip
    assert len(steps) == 2
    assert all(s["env/turns"] > 1 for s in steps)
    assert max(s["rollout/abs_logp_diff"] for s in steps) < LOGP_DIFF_LIMIT


VLLM = ("rollout.engine=vllm", "rollout.dtype=float32", "rollout.vllm.kv_cache_gb=0.25")


def test_trl_style_data_environments_and_rewards_train_on_vllm(tmp_path):
    """TRL's conventions (a Dataset by import path, prompt-only; `reward_func(environments, **kwargs)`; a reward
    counting the `tool` messages of its completions) on the real engine."""
    steps = train_on_trl_style(tmp_path, chat_model_dir(tmp_path / "model", head_dim=32), *VLLM)
    assert [s["step"] for s in steps] == [1, 2]
    assert max(s["rollout/abs_logp_diff"] for s in steps) < LOGP_DIFF_LIMIT


def test_skyrl_s_own_rows_and_text2sql_train_on_vllm(tmp_path):
    """SkyRL's gsm8k rows as its script writes them, and text2sql on a local database, with no key but the
    environment's own, on the real engine."""
    model = chat_model_dir(tmp_path / "model", head_dim=32)
    (tmp_path / "gsm8k").mkdir()
    (tmp_path / "sql").mkdir()
    steps = train_on_skyrl_rows(tmp_path / "gsm8k", model, *VLLM)
    steps += train_on_text2sql(tmp_path / "sql", model, *VLLM)
    assert [s["step"] for s in steps] == [1, 2, 1, 2]
    assert steps[-1]["env/turns"] == 2
    assert max(s["rollout/abs_logp_diff"] for s in steps) < LOGP_DIFF_LIMIT


@pytest.mark.parametrize("loader", ["load_calculator", "load_feedback"])
def test_a_verifiers_environment_trains_on_vllm(tmp_path, loader):
    """verifiers' `ToolEnv` (a tool) and `MultiTurnEnv` (feedback), each with a two-function `Rubric`, unchanged on
    the real engine: the action-token log-probs as close as single-turn runs keep them; the rubric's values logged."""
    steps = train_on_verifiers(tmp_path, loader, "rollout.engine=vllm", "rollout.dtype=float32",
                               "rollout.vllm.kv_cache_gb=0.25")  # fmt: skip
    assert len(steps) == 2
    assert max(s["rollout/abs_logp_diff"] for s in steps) < LOGP_DIFF_LIMIT
    assert all("env/correct" in s for s in steps)
