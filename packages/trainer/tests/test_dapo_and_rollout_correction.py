"""DAPO's overlong shaping and dynamic-sampling filter, and rollout correction (truncated importance sampling), against
float64 references written from the formulas; the trainer's refill loop and truncation mask on crafted batches."""

import json
import math

import numpy as np
import pytest
import torch
from test_algorithms import aggregate_reference, batch, loss_inputs, per_token_reference
from trainer_fixtures import tiny_overrides

from lorarl.trainer.algorithms import (
    informative_groups,
    overlong_penalty,
    policy_loss,
    rollout_is_weights,
    rollout_mismatch,
)
from lorarl.trainer.cli import main
from lorarl.trainer.config import ConfigError, load_config
from lorarl.trainer.engines import Completion, SamplingParams
from lorarl.trainer.loop import Trainer
from lorarl.trainer.presets import PRESETS
from lorarl.trainer.rollout import Rollouts, Sample
from lorarl.trainer.update import to_batch


@pytest.mark.parametrize(("max_tokens", "buffer", "penalty"), [(20, 4, 1.0), (20, 20, 0.5), (8, 1, 2.0)])
def test_overlong_penalty(max_tokens, buffer, penalty):
    lengths = torch.arange(0, max_tokens + 1)
    got = overlong_penalty(lengths, max_tokens, buffer, penalty)
    for length, value in zip(lengths.tolist(), got.tolist(), strict=True):
        expected = 0.0 if length <= max_tokens - buffer else -(length - (max_tokens - buffer)) / buffer * penalty
        assert value == pytest.approx(expected, abs=1e-6)
    assert got[-1].item() == pytest.approx(-penalty)  # the full penalty at the length limit


def test_overlong_penalty_rejects_a_bad_buffer():
    with pytest.raises(ValueError, match="buffer"):
        overlong_penalty(torch.tensor([3]), 8, 0)
    with pytest.raises(ValueError, match="buffer"):
        overlong_penalty(torch.tensor([3]), 8, 9)


def test_informative_groups_on_a_crafted_batch():
    # groups interleaved; group 7 all equal, group 3 mixed, group 5 of one, group 2 equal floats, group 9 mixed ties
    group = torch.tensor([7, 3, 7, 3, 5, 2, 2, 9, 9, 9, 7])
    rewards = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.3, 0.25, 0.25, 1.0, 1.0, 0.0, 1.0])
    expected = [False, True, False, True, True, False, False, True, True, True, False]
    assert informative_groups(rewards, group).tolist() == expected


@pytest.mark.parametrize("seed", range(5))
def test_informative_groups_match_a_loop(seed):
    rewards, group_index, _ = batch(seed, groups=(4, 4, 1, 3, 2, 5, 2))
    got = informative_groups(rewards, group_index).tolist()
    for i, keep in enumerate(got):
        peers = {float(rewards[j]) for j in range(len(rewards)) if group_index[j] == group_index[i]}
        alone = int((group_index == group_index[i]).sum()) == 1
        assert keep == (len(peers) > 1 or alone)


def is_weights_reference(old, rollout, mask, level, cap):
    out = torch.zeros(old.shape, dtype=torch.float64)
    for i in range(old.shape[0]):
        valid = [t for t in range(old.shape[1]) if mask[i, t]]
        sequence = sum(float(old[i, t] - rollout[i, t]) for t in valid)
        for t in valid:
            log_ratio = sequence if level == "sequence" else float(old[i, t] - rollout[i, t])
            out[i, t] = min(math.exp(min(max(log_ratio, -20), 20)), cap)
    return out


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("cap", [1.5, 2.0, 10.0])
@pytest.mark.parametrize("seed", range(3))
def test_rollout_is_weights(level, cap, seed):
    old, rollout, _, mask = loss_inputs(seed)  # ragged mask with an empty response; ratios around 1 and far off
    rollout = rollout * 0.5 + old * 0.5
    old = old.clone().requires_grad_(True)
    got = rollout_is_weights(old, rollout, mask, level, cap)
    assert not got.requires_grad  # weights carry no gradient
    torch.testing.assert_close(got, is_weights_reference(old.detach(), rollout, mask, level, cap))
    assert got.max() <= cap


def test_rollout_is_weights_reject_bad_input():
    old, rollout, _, mask = loss_inputs(0)
    with pytest.raises(ValueError, match="level"):
        rollout_is_weights(old, rollout, mask, "geometric", 2.0)
    with pytest.raises(ValueError, match="cap"):
        rollout_is_weights(old, rollout, mask, "token", 0.0)
    with pytest.raises(ValueError, match=r"rollout_logp must have the shape of response_mask"):
        rollout_is_weights(old, rollout[:, :3], mask, "token", 2.0)


def test_rollout_mismatch_metrics():
    old, rollout, _, mask = loss_inputs(4)
    got = rollout_mismatch(old, rollout, mask)
    delta = np.array([float(old[i, t] - rollout[i, t]) for i in range(mask.shape[0]) for t in range(mask.shape[1])
                      if mask[i, t]])  # fmt: skip
    ratio = np.exp(delta)
    assert got["rollout/abs_logp_diff"] == pytest.approx(np.abs(delta).mean(), rel=1e-12)
    assert got["rollout/kl"] == pytest.approx((ratio - 1 - delta).mean(), rel=1e-12)
    for q, key in [(0.05, "rollout/ratio_p05"), (0.5, "rollout/ratio_p50"), (0.95, "rollout/ratio_p95")]:
        assert got[key] == pytest.approx(np.quantile(ratio, q), rel=1e-12)
    assert got["rollout/ratio_max"] == pytest.approx(ratio.max(), rel=1e-12)
    assert rollout_mismatch(old, old, mask)["rollout/abs_logp_diff"] == 0.0


@pytest.mark.parametrize("name", ["ppo", "cispo"])
def test_policy_loss_weighs_tokens_by_the_is_weights(name):
    logp, old, adv, mask = loss_inputs(5)
    rollout = old + torch.randn(old.shape, generator=torch.Generator().manual_seed(9), dtype=torch.float64) * 0.3
    weights = rollout_is_weights(old, rollout, mask, "token", 2.0)
    loss, _ = policy_loss(name, logp, old, adv, mask, is_weights=weights)
    expected = aggregate_reference(per_token_reference(name, logp, old, adv, 0.2, 0.2) * weights, mask, "token-mean")
    assert loss.item() == pytest.approx(expected, rel=1e-10)
    with pytest.raises(ValueError, match="is_weights must have the shape"):
        policy_loss(name, logp, old, adv, mask, is_weights=weights[:2])


# --- the trainer's sampling loop on crafted batches ------------------------------------------------------------------


def crafted(rewards_by_group: list[list[float]], first_group: int, finished: bool = True) -> list[Sample]:
    samples = []
    for g, rewards in enumerate(rewards_by_group):
        for r in rewards:
            completion = Completion(g, (5, 6, 7), (-0.1, -0.2, -0.3), finished, 0)
            samples.append(Sample([1, 2], completion, first_group + g, r, r))
    return samples


def scripted_trainer(tiny_setup, tmp_path, rounds_script, **extra):
    """A trainer (no engine started) whose generation rounds return the scripted rewards, one list per round."""
    config = load_config(None, tiny_overrides(tiny_setup, tmp_path, data__batch_size=3, rollout__n=2, **extra),
                         presets=PRESETS)  # fmt: skip
    trainer = Trainer(config)
    trainer.rollouts = Rollouts(config, None, trainer.train_set, trainer.sampler, trainer.tokenizer, trainer.reward)
    script = iter(rounds_script)
    trainer.rollouts.generate = lambda step, round_, first_group, version: crafted(next(script), first_group)
    return trainer


def test_dynamic_sampling_refills_with_informative_groups(tiny_setup, tmp_path):
    rounds = [[[1, 1], [0, 1], [0, 0]], [[1, 0], [0.5, 0.5], [1, 0]], [[0, 1], [0, 1], [0, 1]]]
    trainer = scripted_trainer(tiny_setup, tmp_path, rounds, algorithm__dynamic_sampling=True)
    kept, metrics = trainer.rollouts.collect(1, version=0)
    assert sorted({s.group for s in kept}) == [1, 3, 5]  # two rounds were enough: the third is never drawn
    assert len(kept) == 6
    assert (metrics["sampling/rounds"], metrics["sampling/prompts"], metrics["sampling/kept_groups"]) == (2, 6, 3)
    assert metrics["reward/mean"] == pytest.approx(np.mean([1, 1, 0, 1, 0, 0, 1, 0, 0.5, 0.5, 1, 0]))


def test_dynamic_sampling_keeps_batch_size_groups(tiny_setup, tmp_path):
    rounds = [[[1, 1], [0, 1], [0, 0]], [[1, 0], [0, 1], [1, 0]]]
    trainer = scripted_trainer(tiny_setup, tmp_path, rounds, algorithm__dynamic_sampling=True)
    kept, metrics = trainer.rollouts.collect(1, version=0)
    assert sorted({s.group for s in kept}) == [1, 3, 4]  # the first three informative groups; group 5 is dropped
    assert metrics["sampling/kept_groups"] == 3


def test_dynamic_sampling_stops_at_the_round_cap(tiny_setup, tmp_path):
    rounds = [[[1, 1], [0, 1], [0, 0]], [[0, 0], [1, 1], [1, 1]], [[0, 1], [0, 1], [0, 1]]]
    trainer = scripted_trainer(tiny_setup, tmp_path, rounds, algorithm__dynamic_sampling=True,
                               algorithm__max_sampling_rounds=2)  # fmt: skip
    kept, metrics = trainer.rollouts.collect(1, version=0)
    assert [s.group for s in kept] == [1, 1]  # trains on what was kept
    assert (metrics["sampling/rounds"], metrics["sampling/kept_groups"]) == (2, 1)


def test_dynamic_sampling_with_nothing_informative_trains_on_the_last_round(tiny_setup, tmp_path):
    rounds = [[[1, 1], [0, 0], [0, 0]], [[1, 1], [1, 1], [0, 0]]]
    trainer = scripted_trainer(tiny_setup, tmp_path, rounds, algorithm__dynamic_sampling=True,
                               algorithm__max_sampling_rounds=2)  # fmt: skip
    kept, metrics = trainer.rollouts.collect(1, version=0)
    assert [s.group for s in kept] == [3, 3, 4, 4, 5, 5]
    assert metrics["sampling/kept_groups"] == 0


def test_without_dynamic_sampling_one_round_is_used_as_is(tiny_setup, tmp_path):
    trainer = scripted_trainer(tiny_setup, tmp_path, [[[1, 1], [0, 1], [0, 0]]])
    kept, metrics = trainer.rollouts.collect(1, version=0)
    assert len(kept) == 6
    assert "sampling/rounds" not in metrics


def test_truncated_responses_get_no_loss_when_masked():
    samples = crafted([[1, 0]], 0) + crafted([[1, 0]], 1, finished=False)
    samples[0] = Sample([1], Completion(0, (4,), (-0.5,), True, 0), 0, 1.0, 1.0)  # a shorter response
    plain = to_batch(samples, mask_truncated=False)
    masked = to_batch(samples, mask_truncated=True)
    assert plain.response_mask.tolist() == [[True, False, False]] + [[True] * 3] * 3
    assert torch.equal(masked.response_mask, plain.response_mask)
    assert masked.loss_mask.tolist() == [[True, False, False], [True] * 3, [False] * 3, [False] * 3]
    assert masked.rollout_logp[0].tolist() == [-0.5, 0.0, 0.0]
    assert masked.sample_lengths == [2, 5, 5, 5]


@pytest.mark.parametrize("band", ["[1.5,2.0]", "[0.5]", "[0.2,0.9]"])
def test_a_bad_correction_band_is_refused_naming_the_key(tiny_setup, tmp_path, band):
    overrides = tiny_overrides(tiny_setup, tmp_path / "out", algorithm__rollout_correction="token_mask",
                               algorithm__rollout_correction_band=band)  # fmt: skip
    with pytest.raises(ConfigError, match=r"algorithm\.rollout_correction_band=.*expected \[low, high\]"):
        load_config(None, overrides, presets=PRESETS)


@pytest.mark.parametrize("mode", ["token_mask", "sequence_reject"])
def test_masking_modes_train_and_report_the_share_kept(tiny_setup, tmp_path, mode):
    """A run with each mode completes, the share of tokens kept logged every step (with the engine in bf16, some fall
    outside a tight band)."""
    out = tmp_path / "out"
    assert main(tiny_overrides(tiny_setup, out, algorithm__rollout_correction=mode, rollout__dtype="bfloat16",
                               algorithm__rollout_correction_band="[0.99,1.01]")) == 0  # fmt: skip
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    kept = [r["rollout/is_weight_mean"] for r in records]
    assert all(0.0 < k <= 1.0 for k in kept)


def test_remax_rollouts_carry_each_prompts_greedy_score(tiny_setup, tmp_path):
    trainer = Trainer(load_config(None, tiny_overrides(tiny_setup, tmp_path / "out", algorithm__adv_estimator="remax"),
                                  presets=PRESETS))  # fmt: skip
    engine = trainer.start_engine()
    try:
        trainer.weights.sync()
        samples, _ = trainer.rollouts.collect(1, version=0)
        prompts = sorted({tuple(s.prompt_ids) for s in samples})
        greedy = engine.generate([list(p) for p in prompts], SamplingParams(n=1, temperature=0.0, max_tokens=6))
        texts = trainer.tokenizer.batch_decode([c.token_ids for c in greedy], skip_special_tokens=True)
        examples = {tuple(e.prompt_ids): e for e in trainer.rollouts.examples}
        fn = trainer.reward.fns[0]
        scores = [fn(examples[p].prompt, text, examples[p].answer) for p, text in zip(prompts, texts, strict=True)]
        expected = dict(zip(prompts, scores, strict=True))
        assert all(s.baseline == expected[tuple(s.prompt_ids)] for s in samples)
        assert "loss" in trainer.train_step(2)  # the step takes its baselines through to the estimator
    finally:
        engine.close()
