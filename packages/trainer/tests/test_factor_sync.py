"""`rollout.sync=factors` with the HF engine: only the LoRA factors cross (the base weights once), and the engine's
merge from its pristine base leaves it holding exactly — bit for bit — what a merged sync of the same step gives it,
sync after sync; a factor set that does not fit changes nothing; a run learns exactly as a merged run does."""

import json

import pytest
import torch
from trainer_fixtures import make_model_dir, tiny_overrides

from lorarl.lora_merge import iter_merged_weights, lora_factors
from lorarl.trainer.cli import main
from lorarl.trainer.config import load_config
from lorarl.trainer.engines import EngineError
from lorarl.trainer.engines.hf import checksum
from lorarl.trainer.loop import Trainer
from lorarl.trainer.models import adapters
from lorarl.trainer.presets import PRESETS
from lorarl.weight_sync import Update
from lorarl.weight_sync.factors import factor_set


def randomize_adapter(model, seed: int, *, scale: float = 0.3) -> None:
    """New A and B factors, as a training step gives them (B = 0 with `scale` 0: the adapter adds nothing)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name or ("lora_A" in name and scale):
                p.copy_(scale * torch.randn(p.shape, generator=generator))


def factor_trainer(setup, tmp_path, **extra) -> Trainer:
    overrides = tiny_overrides(setup, tmp_path / "out", rollout__sync="factors", **extra)
    return Trainer(load_config(None, overrides, presets=PRESETS))


@pytest.fixture
def bf16_exact_setup(tiny_setup, tmp_path):
    """The tiny model with weights a bfloat16 engine holds exactly (a bf16 checkpoint trained in float32)."""
    directory = make_model_dir(tmp_path / "bf16-model")
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(directory).to(torch.bfloat16).save_pretrained(directory)
    return tiny_setup | {"model": str(directory)}


@pytest.mark.parametrize("worker", ["inline", "process"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_each_factor_sync_gives_the_engine_the_merged_weights_bit_for_bit(tiny_setup, bf16_exact_setup, tmp_path,
                                                                          worker, dtype):  # fmt: skip
    for index, setup in enumerate((tiny_setup, bf16_exact_setup)):  # the base copy as sent, and narrowed to bf16
        trainer = factor_trainer(setup, tmp_path / str(index), rollout__worker=worker, rollout__dtype=dtype)
        with adapters(trainer.model, None):
            base = {name: t.clone() for name, t in iter_merged_weights(trainer.model)}
        trainer.start_engine()
        try:
            for version in range(1, 5):
                randomize_adapter(trainer.model, version)
                stats = trainer.weights.sync(version=version)
                merged = iter_merged_weights(trainer.model, dtype=getattr(torch, dtype))
                assert trainer.engine.checksum() == checksum(merged), version
                assert trainer.engine.version == version
                lora_bytes = sum(p.nbytes for n, p in trainer.model.named_parameters() if "lora_" in n)
                scales = 8 * len(lora_factors(trainer.model))  # a float64 each
                assert stats.bytes == lora_bytes + scales or version == 1  # the base weights went with the first only
            with adapters(trainer.model, None):
                after = dict(iter_merged_weights(trainer.model))
            assert all(torch.equal(after[name], base[name]) for name in base)  # the trainer's base is untouched
        finally:
            trainer.engine.close()


def test_a_hundred_factor_syncs_leave_the_engines_base_bit_identical(tiny_setup, tmp_path):
    trainer = factor_trainer(tiny_setup, tmp_path, rollout__worker="process", rollout__dtype="float32")
    with adapters(trainer.model, None):
        base = checksum(iter_merged_weights(trainer.model))
    trainer.start_engine()
    try:
        for version in range(1, 101):
            randomize_adapter(trainer.model, version)
            trainer.weights.sync(version=version)
        assert trainer.engine.checksum() == checksum(iter_merged_weights(trainer.model))
        randomize_adapter(trainer.model, 0, scale=0.0)  # B = 0: what the engine merges is its base copy alone
        trainer.weights.sync(version=101)
        assert trainer.engine.checksum() == base
    finally:
        trainer.engine.close()


@pytest.mark.parametrize("worker", ["inline", "process"])
def test_a_factor_set_that_does_not_fit_changes_nothing(tiny_setup, tmp_path, worker):
    trainer = factor_trainer(tiny_setup, tmp_path, rollout__worker=worker)
    trainer.start_engine()
    engine = trainer.engine
    try:
        randomize_adapter(trainer.model, 1)
        trainer.weights.sync(version=1)
        served = engine.checksum()
        name = "model.layers.1.mlp.down_proj.weight"
        good = factor_set(lora_factors(trainer.model))
        for broken, why in [
            ({**good, f"{name}.lora_A": torch.zeros(8, 3)}, "do not fit its base weight"),
            ({k: v for k, v in good.items() if k != f"{name}.lora_B"}, "lacks"),
        ]:
            with pytest.raises((EngineError, ValueError), match=why):
                engine.sync(Update("factors", 2, broken))
            assert engine.version == 1
            assert engine.checksum() == served
        nowhere = factor_set({"model.nowhere.weight": (torch.zeros(8, 32), torch.zeros(32, 8), 1.0, False)})
        with pytest.raises((EngineError, ValueError), match="the model lacks"):
            engine.sync(Update("factors", 2, nowhere))
        assert engine.version == 1
        assert engine.checksum() == served
        randomize_adapter(trainer.model, 3)
        trainer.weights.sync(version=3)
        assert engine.checksum() == checksum(iter_merged_weights(trainer.model, dtype=trainer.rollout_dtype))
    finally:
        engine.close()


def test_a_factor_run_learns_exactly_as_a_merged_run_does(tiny_setup, tmp_path):
    runs = {}
    for sync in ("merged", "factors"):
        out = tmp_path / sync
        assert main(tiny_overrides(tiny_setup, out, rollout__sync=sync)) == 0
        runs[sync] = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    same = lambda record: {k: v for k, v in record.items() if not k.startswith(("timing/", "sync/"))}  # noqa: E731
    assert [same(r) for r in runs["factors"]] == [same(r) for r in runs["merged"]]
    rewards = [r["reward/mean"] for r in runs["factors"]]
    assert sum(rewards[-3:]) / 3 > sum(rewards[:3]) / 3 + 0.1
    factor_bytes = [r["sync/bytes"] for r in runs["factors"] if r["step"] > 0]
    assert max(factor_bytes) < min(r["sync/bytes"] for r in runs["merged"] if r["step"] > 0)
