"""`rollout.overlap`: the next batch is generated while the trainer trains, so each step trains on rollouts of the
weights one update behind (lag exactly 1 after the first step, never more), corrected by the rollout-correction
weights; it still learns, and a resumed run repeats the uninterrupted one."""

import json

import pytest
from trainer_fixtures import tiny_overrides

from lorarl.trainer.cli import main
from lorarl.trainer.config import ConfigError, load_config
from lorarl.trainer.engines import Completion, EngineError
from lorarl.trainer.presets import PRESETS
from lorarl.trainer.rollout import check_versions

OVERLAP = {"rollout__overlap": "true", "rollout__worker": "process", "algorithm__rollout_correction": "token"}


def metrics(output_dir) -> list[dict]:
    return [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]


def test_overlapped_rollouts_lag_one_update_and_the_run_learns(tiny_setup, tmp_path):
    assert main(tiny_overrides(tiny_setup, tmp_path / "out", **OVERLAP)) == 0
    records = [m for m in metrics(tmp_path / "out") if "reward/mean" in m]
    assert [m["rollout/version_lag"] for m in records] == [0] + [1] * 11
    assert all(m["rollout/is_weight_mean"] > 0 for m in records)
    rewards = [m["reward/mean"] for m in records]
    assert sum(rewards[-3:]) / 3 > sum(rewards[:3]) / 3 + 0.1


def test_rollouts_older_than_the_allowed_lag_are_refused():
    for lag, allowed, refused in ((1, (4, 5), 3), (0, (5,), 4)):  # rollout.overlap allows one update behind
        for version in allowed:
            check_versions([Completion(0, (2,), (-0.1,), True, version)], 5, lag=lag)
        with pytest.raises(EngineError, match=f"version \\[{refused}\\]"):
            check_versions([Completion(0, (2,), (-0.1,), True, refused)], 5, lag=lag)
    with pytest.raises(EngineError, match="version \\[6\\]"):  # nor from weights the trainer has not sent
        check_versions([Completion(0, (2,), (-0.1,), True, 6)], 5, lag=1)


@pytest.mark.parametrize(
    ("settings", "message"),
    [({"rollout__worker": "process"}, r"algorithm\.rollout_correction=token"),
     ({"algorithm__rollout_correction": "token"}, r"rollout\.worker=process")],
)  # fmt: skip
def test_overlap_needs_rollout_correction_and_a_worker_process(tiny_setup, tmp_path, settings, message):
    overrides = tiny_overrides(tiny_setup, tmp_path / "out", rollout__overlap="true", **settings)
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides, presets=PRESETS)


def test_a_resumed_overlapped_run_repeats_the_uninterrupted_one(tiny_setup, tmp_path):
    """The checkpoint keeps the batch generated ahead, so the resumed run trains on the same rollouts."""
    straight, interrupted = tmp_path / "straight", tmp_path / "interrupted"
    assert main(tiny_overrides(tiny_setup, straight, trainer__steps=4, **OVERLAP)) == 0
    assert main(tiny_overrides(tiny_setup, interrupted, trainer__steps=2, **OVERLAP)) == 0
    assert main(tiny_overrides(tiny_setup, interrupted, trainer__steps=4, trainer__resume="auto", **OVERLAP)) == 0
    expected, resumed = metrics(straight), metrics(interrupted)
    assert [m["step"] for m in resumed] == [1, 2, 3, 4]
    for a, b in zip(expected[2:], resumed[2:], strict=True):
        for key in ("reward/mean", "response_length/mean", "loss", "entropy", "grad_norm", "rollout/version_lag"):
            assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-7), (a["step"], key)
