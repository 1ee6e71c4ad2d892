"""Data-parallel training (FSDP2, 2 CPU ranks over gloo) makes the same update as one rank on the same global batch:
mini-batches split across ranks, micro-batches padded to equal counts, gradients summed, metrics combined; torchrun's
ranks on one node listen on loopback alone."""

import functools
import json
import subprocess
import sys

import numpy as np
import pytest
import torch
from dp_workers import one_step
from listeners import on_loopback_alone, run_and_watch
from peft import PeftModel
from safetensors.torch import load_file
from sync_processes import run_group
from trainer_fixtures import tiny_overrides
from transformers import AutoModelForCausalLM

SETTINGS = {
    "algorithm__mini_batches": 2,  # two optimizer steps, each over half the batch, split across the ranks
    "algorithm__kl_coef": 0.05,  # the reference pass (adapter disabled) runs sharded too
    "actor__micro_batch_tokens": 24,  # several micro-batches per rank, not always as many on each
    "actor__lr": 0.05,
    "model__lora__rank": 4,
}


# PPO with a critic: its adapter sharded with the policy's, its value head sharded on its own, a second backward;
# and the layers checkpointed: FSDP gathers each one again for its recompute in the backward
PPO = {**SETTINGS, "algorithm__adv_estimator": "gae", "critic__lora__rank": 4, "actor__gradient_checkpointing": True}


def run(world: int, setup: dict, output_dir, settings: dict = SETTINGS) -> list[dict]:
    fns = [functools.partial(one_step, world=world, setup=setup, output_dir=str(output_dir), extra=settings)] * world
    outcome = run_group(fns, join=False, deadline=300)
    for status, value in outcome.values():
        assert status == "ok", value
    return [outcome[rank][1] for rank in range(world)]


# fp32 sums in another order; Adam's first steps (~lr·g/|g|) magnify that where g ~ 0: 2e-5 of lr 0.05. PPO's
# advantages are whitened values of the critic, computed in another order too: the odd weight moves up to 1.4% of lr
# (measured on two machines' CPUs; 3% allowed). A real slip (a rank's gradients lost, a micro-batch counted twice)
# moves weights by up to 2·lr and changes grad_norm, which is held to 1e-4.
@pytest.mark.parametrize(
    ("settings", "atol"), [(SETTINGS, 2e-5), (PPO, 1.5e-3)], ids=["grpo", "ppo-with-a-critic-checkpointed"]
)
def test_two_ranks_make_the_update_of_one(tiny_setup, tmp_path, settings, atol):
    (single,) = run(1, tiny_setup, tmp_path / "one", settings)
    pair = run(2, tiny_setup, tmp_path / "two", settings)
    for result in pair:  # both ranks hold the same gathered weights and report the same metrics
        assert result["weights"].keys() == single["weights"].keys()
        for name, value in single["weights"].items():
            np.testing.assert_allclose(result["weights"][name], value, rtol=1e-4, atol=atol, err_msg=name)
        for key, value in single["metrics"].items():
            assert result["metrics"][key] == pytest.approx(value, rel=1e-4, abs=1e-6), key
    assert single["metrics"]["grad_norm"] > 0  # a real update happened
    assert all(result["checkpointed"] == (settings is PPO) for result in (single, *pair))
    if settings is PPO:
        assert single["metrics"]["critic/grad_norm"] > 0
        assert any(".critic." in name for name in single["weights"])
        saved = [tmp_path / world / "checkpoints" / "step_1" / "critic" for world in ("one", "two")]
        for name in ("adapter_model.safetensors", "value_head.safetensors"):
            one, two = (load_file(directory / name) for directory in saved)
            assert one.keys() == two.keys()
            for key in one:
                torch.testing.assert_close(two[key], one[key], rtol=1e-4, atol=2e-5)


def torchrun_command(setup: dict, out, **extra) -> list[str]:
    """A run of two ranks on this node, as torchrun starts them."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
            "-m", "lorarl.trainer.cli", *tiny_overrides(setup, out, **extra)]  # fmt: skip


def torchrun(setup: dict, out, **extra) -> subprocess.CompletedProcess:
    done = subprocess.run(torchrun_command(setup, out, **extra), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done


def records(out) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def straight_run(tiny_setup, tmp_path_factory):
    """One uninterrupted 12-step torchrun run with two ranks (default settings), shared by the tests below: its
    output directory, what it printed, and the listeners of its ranks (torchrun's agent left out)."""
    out = tmp_path_factory.mktemp("straight")
    seen, output = run_and_watch(torchrun_command(tiny_setup, out), skip_root=True)
    return out, output, seen


def test_a_two_rank_torchrun_run_learns_saves_a_loadable_adapter_and_listens_on_loopback(tiny_setup, straight_run):
    """(torchrun's agent hosts the rendezvous store: torch's, on every interface — name the node's address in
    --rdzv-endpoint and a firewall for it; the ranks, lorarl's, listen on loopback.)"""
    out, output, seen = straight_run
    assert seen, "no listener of the ranks was seen"
    assert on_loopback_alone(seen, set()), seen
    assert output.count("done: 12 steps") == 1  # rank 0 reports; rank 1 trains silently
    assert "returned a view tensor" not in output  # FSDP2's warning at each forward, expected: not shown
    rewards = [r["reward/mean"] for r in records(out)]
    assert len(rewards) == 12
    assert sum(rewards[-3:]) / 3 > sum(rewards[:3]) / 3 + 0.1
    adapter = out / "checkpoints" / "step_12" / "adapter"
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_setup["model"]), adapter)
    assert any("lora_B" in name and p.abs().sum() > 0 for name, p in model.named_parameters())  # trained, gathered


def test_a_resumed_two_rank_run_repeats_the_uninterrupted_one(tiny_setup, straight_run, tmp_path):
    """2 steps, then resumed up to 4, make the straight run's steps 3 and 4 (a constant learning rate: the first
    steps of a run do not depend on its length)."""
    interrupted = tmp_path / "interrupted"
    torchrun(tiny_setup, interrupted, trainer__steps=2)
    torchrun(tiny_setup, interrupted, trainer__steps=4, trainer__resume="auto")  # weights, optimizer, data, RNG
    expected, resumed = records(straight_run[0]), records(interrupted)
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]
    for a, b in zip(expected[2:4], resumed[2:], strict=True):
        for key in ("reward/mean", "response_length/mean", "loss", "entropy", "grad_norm"):
            assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-7), (a["step"], key)
