"""Mixtures of experts in vLLM's CPU build: transformers 5's fused expert tensors under their own names reach what
vLLM's CPU MoE kernel runs (it prepacks expert weights into a layout of its own, which a reload must make again), so
after each version the engine's greedy tokens and log-probs are transformers' on those weights; and a run trains on
it with the merged and the factor sync alike, and its export loads in vLLM."""

import json

import pytest
import torch
from trainer_fixtures import make_moe_model_dir
from vllm_cpu_helpers import assert_greedy_and_logprobs_match, hf_model, start_engine, trainer_overrides

from lorarl.trainer.cli import main
from lorarl.weight_sync import Update
from lorarl.weight_sync.vllm import OfflineClient, VllmWeightTransfer

PROMPTS = [[3, 4, 5, 6], [7, 8, 9], [10, 11, 12, 13, 14]]  # the tiny models' 16 tokens


@pytest.mark.parametrize(("family", "intermediate"), [("qwen3_moe", 48), ("qwen2_moe", 32)],
                         ids=["qwen3-moe-padded", "qwen2-moe-shared-expert"])  # fmt: skip
def test_expert_versions_serve_what_transformers_computes(tmp_path, family, intermediate):
    """Version 1 moves every expert (and the rest); version 2 only the experts (a subset update: whole MoE layers).
    An expert width vLLM pads (48: its CPU kernel takes multiples of 32) is padded again at each reload."""
    directory = make_moe_model_dir(tmp_path / family, family, moe_intermediate_size=intermediate)
    llm = start_engine(directory)
    try:
        transfer = VllmWeightTransfer(OfflineClient(llm), channel="local")
        base = hf_model(directory).state_dict()
        state = dict(base)
        for version, names in ((1, list(base)), (2, [n for n in base if ".mlp.experts." in n])):
            generator = torch.Generator().manual_seed(version)
            update = {n: base[n] + 0.05 * torch.randn(base[n].shape, generator=generator) for n in names}
            transfer.send(Update("weights", version, update))
            state |= update
            llm.reset_prefix_cache()
            assert_greedy_and_logprobs_match(llm, hf_model(directory, state), PROMPTS, version=str(version))
    finally:
        llm.llm_engine.engine_core.shutdown()


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe"])
def test_a_moe_trains_on_vllm_alike_with_merged_and_factor_syncs(trainer_setup, tmp_path, family):
    setup = trainer_setup | {"model": str(make_moe_model_dir(tmp_path / family, family))}
    runs = {}
    for sync in ("merged", "factors"):
        out = tmp_path / sync
        assert main(trainer_overrides(setup, out, rollout__sync=sync, trainer__steps=3)) == 0
        runs[sync] = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    same = lambda record: {k: v for k, v in record.items() if not k.startswith(("timing/", "sync/"))}  # noqa: E731
    assert [same(r) for r in runs["factors"]] == [same(r) for r in runs["merged"]]
    steps = [r for r in runs["merged"] if r["step"] > 0]
    assert max(r["rollout/abs_logp_diff"] for r in steps) < 1e-4  # the engine samples the trainer's merged weights
    assert any(r["grad_norm"] > 0 for r in steps)
    if family != "qwen3_moe":
        return
    # `trainer export --merged` of the checkpoint: a model vLLM loads (per-expert checkpoint names, as transformers
    # saves them) and serves as transformers computes it
    exported = tmp_path / "exported"
    assert main(["export", "--checkpoint", str(tmp_path / "merged" / "checkpoints" / "step_3"),
                 "--merged", str(exported)]) == 0  # fmt: skip
    llm = start_engine(exported)
    try:
        assert_greedy_and_logprobs_match(llm, hf_model(exported), PROMPTS, version="default")
    finally:
        llm.llm_engine.engine_core.shutdown()


def test_an_adapter_sync_of_experts_is_refused_in_one_line(trainer_setup, tmp_path, capsys):
    """vLLM serves LoRA on per-expert layers only, not peft's flat fused-expert adapter: said before anything starts."""
    setup = trainer_setup | {"model": str(make_moe_model_dir(tmp_path / "moe"))}
    assert main(trainer_overrides(setup, tmp_path / "out", rollout__sync="adapter")) != 0
    error = capsys.readouterr().out.strip().splitlines()[-1]
    assert error == ("error: rollout.sync=adapter: vLLM cannot serve a LoRA on fused experts (peft's "
                     "target_parameters); use rollout.sync=merged or factors, or leave the experts out "
                     "(model.lora.exclude_modules=[experts])")  # fmt: skip


def test_routing_replay_on_vllms_cpu_build_is_refused_in_one_line(tmp_path, capsys):
    """vLLM returns routes from its GPU model runner only (Model Runner V2, with Triton): on its CPU build replay is
    refused before the engine starts, saying where routes come from instead."""
    assert main(["model.path=default-moe", "rollout.engine=vllm", "algorithm.routing_replay=true",
                 f"trainer.output_dir={tmp_path}"]) != 0  # fmt: skip
    error = capsys.readouterr().out.strip().splitlines()[-1]
    assert error == ("error: rollout.record_routes (algorithm.routing_replay needs it): vLLM returns the experts it "
                     "routed to only from its GPU model runner (Model Runner V2, with Triton); its CPU build cannot. "
                     "The HF engine records them on a CPU (rollout.engine=hf)")  # fmt: skip


def test_the_embedded_moe_learns_with_vllm(tmp_path):
    """`trainer model.path=default-moe actor.lr=3e-4 rollout.engine=vllm`: validation accuracy rises on vLLM's CPU
    build too (measured over 120 steps: 0.48 -> 0.54, at best 0.65 by step 50); the first 60 steps here."""
    out = tmp_path / "out"
    overrides = ["model.path=default-moe", "actor.lr=3e-4", "rollout.engine=vllm", "trainer.steps=60",
                 "trainer.threads=1"]  # one thread: vLLM's CPU worker fixes the process's count once it starts
    assert main([*overrides, f"trainer.output_dir={out}"]) == 0
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    accuracy = [r["val/accuracy"] for r in records if "val/accuracy" in r]
    assert accuracy[-1] > accuracy[0]
    assert max(accuracy[1:]) >= accuracy[0] + 0.08, accuracy
