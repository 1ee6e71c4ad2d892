"""Each algorithm preset trains end to end on the tiny CPU setup and the reward rises; DAPO's dynamic sampling refills
its batch; rollout correction sees the engine's log-probs agree with the trainer's."""

import json

import pytest
from trainer_fixtures import tiny_overrides

from lorarl.trainer.cli import main
from lorarl.trainer.config import load_config
from lorarl.trainer.presets import PRESETS


def metrics(output_dir) -> list[dict]:
    records = [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if "reward/mean" in r]


def rises(records: list[dict], by: float = 0.1) -> bool:
    rewards = [r["reward/mean"] for r in records]
    return sum(rewards[-3:]) / 3 > sum(rewards[:3]) / 3 + by


@pytest.mark.parametrize("preset", ["dapo", "drgrpo", "rloo", "gspo"])
def test_each_preset_learns(preset, tiny_setup, tmp_path):
    out = tmp_path / "out"
    assert main(tiny_overrides(tiny_setup, out, algorithm=preset)) == 0
    records = metrics(out)
    assert len(records) == 12
    assert rises(records)
    saved = load_config(out / "config.yaml").algorithm
    assert saved.name == preset
    assert {key: getattr(saved, key) for key in PRESETS[preset].settings} == PRESETS[preset].settings


def test_dapo_dynamic_sampling_refills_the_batch(tiny_setup, tmp_path):
    out = tmp_path / "out"
    overrides = tiny_overrides(tiny_setup, out, algorithm="dapo", reward__fn=tiny_setup["binary_reward"],
                               algorithm__max_sampling_rounds=3)  # fmt: skip
    assert main(overrides) == 0
    records = metrics(out)
    assert rises(records)
    assert any(r["sampling/rounds"] > 1 for r in records)  # uniform groups were dropped and refilled
    for r in records:
        assert r["sampling/prompts"] == 8 * r["sampling/rounds"]
        assert r["sampling/kept_groups"] == 8 or r["sampling/rounds"] == 3  # full, or the cap was reached
    assert all(-1.0 <= r.get("reward/overlong_penalty", 0.0) < 0 for r in records if r["response_length/truncated"])


def test_rollout_correction_sees_the_engine_agree_with_the_trainer(tiny_setup, tmp_path):
    """fp32 engine and trainer on the same weights: the engine's log-probs (at temperature 1.3) equal the trainer's
    old log-probs, so every step's mismatch is ~0 and the importance weights ~1."""
    out = tmp_path / "out"
    overrides = tiny_overrides(tiny_setup, out, algorithm__rollout_correction="sequence", rollout__temperature=1.3,
                               rollout__dtype="float32")  # fmt: skip
    assert main(overrides) == 0
    records = metrics(out)
    assert rises(records)
    for r in records:
        assert r["rollout/abs_logp_diff"] < 1e-4
        assert r["rollout/ratio_p05"] > 0.999
        assert r["rollout/ratio_p95"] < 1.001
        assert r["rollout/is_weight_mean"] == pytest.approx(1.0, abs=1e-3)
