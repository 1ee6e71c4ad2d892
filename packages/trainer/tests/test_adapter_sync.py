"""`rollout.sync=adapter` with the HF engine: the engine serves the trainer's LoRA unmerged (peft) and generates what
the merged weights generate; `rollout.sync=auto` measures each mode once and keeps the fastest."""

import json

import pytest
from trainer_fixtures import assert_same_completions, served_merged_served, tiny_overrides

from lorarl.trainer.cli import main
from lorarl.trainer.config import load_config
from lorarl.trainer.loop import Trainer
from lorarl.trainer.presets import PRESETS


@pytest.mark.parametrize("worker", ["process", "inline"])
def test_the_served_adapter_generates_what_the_merged_weights_generate(tiny_setup, tmp_path, worker):
    # in float32: in bfloat16 the two round differently (the merged weight once, the unmerged path per product); at a
    # fixed thread count: the two served rounds repeat bit for bit whatever else the machine runs
    overrides = tiny_overrides(tiny_setup, tmp_path / "out", rollout__sync="adapter", rollout__worker=worker,
                               rollout__dtype="float32", trainer__threads=1)  # fmt: skip
    served, merged, again = served_merged_served(Trainer(load_config(None, overrides, presets=PRESETS)))
    assert_same_completions(served, merged)
    assert [a.token_ids for a in again] == [a.token_ids for a in served]
    assert [a.logprobs for a in again] == [a.logprobs for a in served]


def test_an_adapter_run_learns(tiny_setup, tmp_path):
    out = tmp_path / "out"
    assert main(tiny_overrides(tiny_setup, out, rollout__sync="adapter")) == 0
    rewards = [json.loads(line)["reward/mean"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert sum(rewards[-3:]) / 3 > sum(rewards[:3]) / 3 + 0.1


def test_auto_measures_each_mode_and_keeps_the_fastest(tiny_setup, tmp_path, capsys):
    out = tmp_path / "out"
    assert main(tiny_overrides(tiny_setup, out, rollout__sync="auto", trainer__steps=3)) == 0
    first = json.loads((out / "metrics.jsonl").read_text().splitlines()[0])
    assert first["step"] == 0
    total = {}
    for mode in ("adapter", "merged", "factors"):
        assert first[f"sync/auto_{mode}_sync_s"] > 0
        assert first[f"sync/auto_{mode}_generate_s"] > 0
        total[mode] = first[f"sync/auto_{mode}_sync_s"] + first[f"sync/auto_{mode}_generate_s"]
    fastest = min(total, key=total.get)
    assert {mode: first[f"sync/auto_chose_{mode}"] for mode in total} == {m: float(m == fastest) for m in total}
    assert f"rollout.sync=auto chose {fastest}" in capsys.readouterr().out
