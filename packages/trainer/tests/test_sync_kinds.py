"""Sync kinds are a registry: a kind of the user's own — here merged weights sent in float16 — is one decorated
function in one file, given by import path (`rollout.sync=file.py:name`); it trains with the HF engine in the
trainer's process and in one of its own, the engine holding exactly the float16 rounding of the trainer's merge."""

import json

import pytest
import torch
from trainer_fixtures import tiny_overrides

from lorarl.lora_merge import iter_merged_weights
from lorarl.trainer.cli import main
from lorarl.trainer.config import load_config
from lorarl.trainer.engines.hf import checksum
from lorarl.trainer.errors import ConfigError
from lorarl.trainer.loop import Trainer
from lorarl.trainer.presets import PRESETS
from lorarl.trainer.sync_kinds import SYNC_KINDS

HALF_PRECISION_KIND = '''
import torch

from lorarl.lora_merge import iter_merged_weights, merged_weight_specs
from lorarl.trainer.sync_kinds import register_sync_kind
from lorarl.weight_sync import Update


@register_sync_kind("merged_fp16")
def merged_fp16(source, version):
    """The merged weights sent in float16: half the bytes of float32 (the engine casts them to its dtype)."""
    model, half = source.model, torch.float16
    return Update("weights", version, iter_merged_weights(model, dtype=half), merged_weight_specs(model, dtype=half))
'''


@pytest.fixture
def kind_file(tmp_path):
    path = tmp_path / "my_sync.py"
    path.write_text(HALF_PRECISION_KIND)
    yield f"{path}:merged_fp16"
    if "merged_fp16" in SYNC_KINDS:
        SYNC_KINDS.remove("merged_fp16")


@pytest.mark.parametrize("worker", ["inline", "process"])
def test_a_sync_kind_from_a_file_trains_and_the_engine_holds_its_rounding(tiny_setup, tmp_path, kind_file, worker):
    out = tmp_path / "out"
    overrides = tiny_overrides(tiny_setup, out, rollout__sync=kind_file, rollout__worker=worker,
                               rollout__dtype="float32", trainer__steps=2)  # fmt: skip
    assert main(overrides) == 0
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["step"] > 0] == [1, 2]

    trainer = Trainer(load_config(None, overrides, presets=PRESETS))
    trainer.start_engine()
    try:
        stats = trainer.weights.sync(version=1)
        merged = dict(iter_merged_weights(trainer.model, dtype=torch.float32))
        rounded = [(name, t.to(torch.float16).to(torch.float32)) for name, t in merged.items()]
        assert trainer.engine.checksum() == checksum(rounded)  # float16's rounding, cast back by the engine
        assert trainer.engine.checksum() != checksum(merged.items())  # (which differs from float32's merge)
        assert stats.bytes == sum(t.numel() * 2 for t in merged.values())  # two bytes an element
    finally:
        trainer.engine.close()


def test_a_sync_kind_that_returns_the_wrong_thing_is_named(tiny_setup, tmp_path):
    path = tmp_path / "bad_sync.py"
    path.write_text(HALF_PRECISION_KIND.replace('"merged_fp16"', '"wrong_form"').replace(
        'return Update("weights"', 'return Update("factors", version, {}) or Update("weights"'))  # fmt: skip
    overrides = tiny_overrides(tiny_setup, tmp_path / "out", rollout__sync=f"{path}:merged_fp16", trainer__steps=1)
    try:
        trainer = Trainer(load_config(None, overrides, presets=PRESETS))
        trainer.start_engine()
        with pytest.raises(Exception, match=r"sync kind wrong_form .*returned Update factors version 0; expected a "
                                            r"weights Update of version 0"):  # fmt: skip
            trainer.weights.sync()
        trainer.engine.close()
    finally:
        SYNC_KINDS.remove("wrong_form")


def test_an_unknown_sync_kind_names_the_registered_ones(tiny_setup, tmp_path):
    overrides = tiny_overrides(tiny_setup, tmp_path / "out", rollout__sync="merged16")
    with pytest.raises(ConfigError, match=r"unknown sync kind 'merged16': expected one of merged, adapter, factors, "
                                          r"base, auto.*did you mean 'merged'"):  # fmt: skip
        load_config(None, overrides, presets=PRESETS)


def test_a_plugin_kind_whose_update_does_not_fit_the_engine_is_named_in_one_line(tiny_setup, tmp_path, capsys):
    path = tmp_path / "misfit.py"
    path.write_text(HALF_PRECISION_KIND.replace('"merged_fp16"', '"misfit"').replace(
        "    model, half = source.model, torch.float16\n",
        "    return Update('weights', version, {'no.such.weight': torch.zeros(2)})\n"))  # fmt: skip
    try:
        assert main(tiny_overrides(tiny_setup, tmp_path / "out", rollout__sync=f"{path}:merged_fp16")) == 2
        output = capsys.readouterr().out.strip().splitlines()
        assert output[-1].startswith(f"error: rollout.sync={path}:merged_fp16: its version 0 does not fit the engine")
        assert "no.such.weight" in output[-1]
        assert "Traceback" not in "\n".join(output)
    finally:
        SYNC_KINDS.remove("misfit")


@pytest.mark.parametrize("worker", ["inline", "process"])
def test_merged_updates_after_the_first_carry_the_adapted_modules_alone(tiny_setup, tmp_path, worker):
    """After a first, full update the merged sync sends only the modules the adapter changes (q_proj's and v_proj's
    attention blocks, whole, for an engine that fuses q/k/v): its bytes are theirs, and the engine then holds the
    whole merged model, bit for bit (its checksum)."""
    from peft.tuners.lora import LoraLayer

    overrides = tiny_overrides(tiny_setup, tmp_path / "out", rollout__worker=worker, rollout__dtype="float32",
                               model__lora__target_modules="[q_proj,v_proj]")  # fmt: skip
    trainer = Trainer(load_config(None, overrides, presets=PRESETS))
    trainer.start_engine()
    try:
        first = trainer.weights.sync(version=1)
        with torch.no_grad():  # what training does to the adapter: its B factors no longer zero
            for name, param in trainer.model.named_parameters():
                if "lora_B" in name:
                    param.normal_(0, 0.1)
        second = trainer.weights.sync(version=2)
        merged = dict(iter_merged_weights(trainer.model, dtype=torch.float32))
        adapted = {n.removeprefix("base_model.model.") for n, m in trainer.model.named_modules()
                   if isinstance(m, LoraLayer)}  # fmt: skip
        blocks = {name.rsplit(".", 1)[0] for name in adapted}  # model.layers.N.self_attn
        changing = [n for n in merged if n.rsplit(".", 2)[0] in blocks]
        assert first.bytes == sum(t.nbytes for t in merged.values())
        assert second.bytes == sum(merged[n].nbytes for n in changing) < first.bytes
        assert trainer.engine.checksum() == checksum(merged.items())
    finally:
        trainer.engine.close()
