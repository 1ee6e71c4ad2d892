"""`rollout.sync=factors` into the real vLLM engine (its CPU build): lorarl's transfer engine merges each factor set
into vLLM's weights from the base weights it keeps — the engine then generates exactly (bit for bit: same tokens, same
log-probs) what the merged weights of the same step make it generate, and what transformers computes with them; a
factor transfer that fails part-way (the sender killed, a corrupted bucket) or that does not fit leaves the previous
version serving; a trainer run with factor sync repeats a merged run's metrics."""

import dataclasses
import json

import pytest
import torch
from peft import LoraConfig, get_peft_model
from test_trainer_vllm import assert_a_short_run
from vllm_cpu_helpers import (
    SenderProcess,
    assert_greedy_and_logprobs_match,
    engine_settings,
    greedy,
    hf_model,
    make_model_dir,
    start_engine,
    trainer_overrides,
)

from lorarl.lora_merge import iter_merged_weights, lora_factors
from lorarl.trainer.cli import main
from lorarl.trainer.engines.inline import InlineEngine
from lorarl.trainer.engines.vllm_worker import VllmWorker
from lorarl.trainer.weights import WeightSync, base_weights
from lorarl.weight_sync import TransferError
from lorarl.weight_sync.factors import factor_set
from lorarl.weight_sync.vllm import OfflineClient, update_round

PROMPTS = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16]]


def adapted(model_dir, targets) -> torch.nn.Module:
    return get_peft_model(hf_model(model_dir), LoraConfig(r=4, lora_alpha=8, target_modules=targets))


def train_a_step(model, seed: int) -> None:
    """New LoRA factors, as an optimizer step gives them."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(0.2 * torch.randn(p.shape, generator=generator))


def merged_reference(model_dir, model):
    return hf_model(model_dir, dict(iter_merged_weights(model)))


@pytest.mark.parametrize("tie", [True, False])
@pytest.mark.parametrize("targets", ["all-linear", ["q_proj", "v_proj", "up_proj"]])
def test_factor_sets_serve_bit_for_bit_what_the_merged_weights_serve(tmp_path, tie, targets):
    # q_proj and v_proj without k_proj: vLLM fuses the three (and their biases) into one layer, reloaded whole
    model_dir = make_model_dir(tmp_path / "m", tie=tie)
    settings = dataclasses.replace(engine_settings(model_dir), inline=True, bucket_bytes=1 << 20)
    engine = InlineEngine(VllmWorker(settings))
    llm = engine.worker.serving.llm
    model = adapted(model_dir, targets)
    try:
        sync = WeightSync(model, engine, kind="factors", dtype=torch.float32, dp=None, version=0)
        for version in (1, 2, 3):
            train_a_step(model, version)
            stats = sync.sync(version=version)
            by_factors = greedy(llm, PROMPTS)
            sync.sync(version=version, kind="merged")  # the same step's weights, merged by the trainer
            by_merged = greedy(llm, PROMPTS)
            for a, b in zip(by_factors, by_merged, strict=True):
                assert list(a.token_ids) == list(b.token_ids)
                assert [s[t].logprob for s, t in zip(a.logprobs, a.token_ids, strict=True)] == [
                    s[t].logprob for s, t in zip(b.logprobs, b.token_ids, strict=True)
                ]  # exactly: the engine holds the same bits
            assert_greedy_and_logprobs_match(llm, merged_reference(model_dir, model), PROMPTS,
                                             version=str(version))  # fmt: skip
            scales = 8 * len(lora_factors(model))  # a float64 each
            factor_bytes = sum(p.nbytes for n, p in model.named_parameters() if "lora_" in n) + scales
            assert stats.bytes == factor_bytes or version == 1  # the base weights went with the first set only
    finally:
        engine.close()


def test_a_failed_factor_transfer_leaves_the_previous_version_serving(tmp_path):
    model_dir = make_model_dir(tmp_path / "m", tie=True)
    llm = start_engine(model_dir)
    client = OfflineClient(llm)
    model = adapted(model_dir, "all-linear")
    base = base_weights(model, lora_factors(model))
    senders = []

    def connect() -> SenderProcess:
        senders.append(SenderProcess.joined_by(client))
        return senders[-1]

    def update(sender, version, *, with_base=False, fault=None):
        train_a_step(model, version)
        tensors = factor_set(lora_factors(model), base if with_base else None)
        sender.send(version, {k: v.detach() for k, v in tensors.items()}, fault)
        return update_round(client, {"version": version, "form": "factors"}, version)

    def assert_serves(version, reference):
        assert llm.get_weight_version() == str(version)
        llm.reset_prefix_cache()
        assert_greedy_and_logprobs_match(llm, reference, PROMPTS, version=str(version))

    try:
        sender = connect()
        update(sender, 1, with_base=True)
        assert sender.result()[0] == "ok"
        v1 = merged_reference(model_dir, model)
        assert_serves(1, v1)
        with pytest.raises(TransferError, match="corrupted"):  # with the base again: a set of several buckets
            update(sender, 2, with_base=True, fault="corrupt")
        assert sender.result()[0] == "error"
        assert_serves(1, v1)
        update(sender, 3)
        assert sender.result()[0] == "ok"
        v3 = merged_reference(model_dir, model)
        assert_serves(3, v3)
        with pytest.raises(TransferError):  # the peer is gone: noticed within the group's timeout
            update(sender, 4, with_base=True, fault="die")
        assert sender.result(timeout=5) is None
        assert_serves(3, v3)
        misfit = factor_set(lora_factors(model)) | {"model.layers.0.mlp.up_proj.weight.lora_A": torch.zeros(4, 3)}
        sender = connect()  # a trainer that comes back joins afresh; the engine kept the base weights
        sender.send(5, {k: v.detach() for k, v in misfit.items()})
        with pytest.raises(ValueError, match="do not fit its base weight"):
            update_round(client, {"version": 5, "form": "factors"}, 5)
        sender.result()  # it sent the set whole: the engine refused it after
        assert_serves(3, v3)
        update(sender, 6)
        assert sender.result()[0] == "ok"
        assert_serves(6, merged_reference(model_dir, model))
    finally:
        for sender in senders:
            sender.close()
        llm.llm_engine.engine_core.shutdown()


@pytest.mark.parametrize("worker", ["inline", "process"])
def test_a_factor_run_repeats_a_merged_run(trainer_setup, tmp_path, worker):
    """The merged run is also the short run of its placement (`test_trainer_vllm.test_a_short_run_in_each_placement`),
    checked as that test checks it."""
    runs = {}
    for sync in ("merged", "factors"):
        out = tmp_path / sync
        overrides = trainer_overrides(trainer_setup, out, rollout__sync=sync, rollout__worker=worker, trainer__steps=5)
        assert main(overrides) == 0
        runs[sync] = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    same = lambda record: {k: v for k, v in record.items() if not k.startswith(("timing/", "sync/"))}  # noqa: E731
    assert [same(r) for r in runs["factors"]] == [same(r) for r in runs["merged"]]
    assert_a_short_run(runs["merged"], 5)
