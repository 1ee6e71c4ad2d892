"""End-to-end training runs on CPU: the reward rises, outputs are what DESIGN.md says, the engine is a real process
fed by weight_sync, resuming repeats an uninterrupted run, exports equal peft's own merge."""

import json
import os
import sys
from pathlib import Path

import pytest
import torch
from trainer_fixtures import tiny_overrides

from lorarl.lora_merge import iter_merged_weights
from lorarl.trainer.cli import main
from lorarl.trainer.config import load_config
from lorarl.trainer.engines.hf import checksum
from lorarl.trainer.loop import Trainer
from lorarl.trainer.presets import PRESETS


def metrics(output_dir) -> list[dict]:
    return [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def trained(tiny_setup, tmp_path_factory):
    """One short run through the CLI, shared by the tests that inspect its outputs."""
    output_dir = tmp_path_factory.mktemp("run") / "out"
    assert main(tiny_overrides(tiny_setup, output_dir, trainer__eval_every=6, trainer__log_samples=3)) == 0
    return output_dir


def test_reward_rises(trained):
    rewards = [m["reward/mean"] for m in metrics(trained) if "reward/mean" in m]
    assert len(rewards) == 12
    assert sum(rewards[-3:]) / 3 > sum(rewards[:3]) / 3 + 0.1


def test_outputs_are_where_design_says(trained):
    assert (trained / "config.yaml").is_file()
    assert load_config(trained / "config.yaml").trainer.steps == 12  # the resolved config reloads
    record = metrics(trained)[1]
    for key in ("step", "reward/mean", "reward/std", "response_length/mean", "entropy", "timing/rollout_s",
                "timing/sync_s", "timing/train_s", "sync/bytes"):  # fmt: skip
        assert key in record, key
    assert "kl" not in record  # no KL term (kl_coef 0): no reference forward, nothing to report
    assert "val/accuracy" in metrics(trained)[0]  # evaluated before training
    adapter = trained / "checkpoints" / "step_12" / "adapter"
    assert (adapter / "adapter_config.json").is_file()
    assert (adapter / "adapter_model.safetensors").is_file()
    for plot in ("reward", "response_length", "val_accuracy"):
        assert (trained / "plots" / f"{plot}.png").stat().st_size > 1000


def test_without_matplotlib_the_run_warns_and_writes_no_plots(trained, tmp_path, monkeypatch):
    from lorarl.trainer.metrics import plot

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError, as on a bare machine
    with pytest.warns(UserWarning, match="matplotlib is not installed"):
        assert plot(trained / "metrics.jsonl", tmp_path / "plots") == []
    assert not (tmp_path / "plots").exists()


def test_samples_show_what_the_model_wrote_and_what_training_made_of_it(trained):
    rows = [json.loads(line) for line in (trained / "samples.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [step for step in range(1, 13) for _ in range(3)]
    for row in rows:
        assert row["score"] == pytest.approx(row["completion"].count("7") / max(len(row["completion"]), 1))  # sevens
        assert row["reward"] == row["score"]  # no shaping in this run
        assert row["prompt"].endswith("=")
        assert row["tokens"] >= len(row["completion"])
    assert any(r["advantage"] > 0 for r in rows)
    assert any(r["advantage"] < 0 for r in rows)


def test_pass_at_k_is_the_share_of_k_subsets_with_a_correct_sample():
    from itertools import combinations

    from lorarl.trainer.evaluation import pass_at_k

    for n in range(1, 7):
        for correct in range(n + 1):
            samples = [True] * correct + [False] * (n - correct)
            for k in range(1, n + 1):
                subsets = list(combinations(samples, k))
                assert pass_at_k(n, correct, k) == pytest.approx(sum(map(any, subsets)) / len(subsets))


def test_eval_of_a_checkpoint_and_of_its_export(trained, tiny_setup, tmp_path):
    """`trainer eval`: the greedy reward equals transformers' own greedy generation from the saved adapter, scored
    by the run's reward; the merged export scores the same."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from lorarl.trainer.models import load_tokenizer

    checkpoint = trained / "checkpoints" / "step_12"
    assert main(["eval", "--checkpoint", str(checkpoint), "--n", "4", "--out", str(tmp_path / "eval.json")]) == 0
    results = json.loads((tmp_path / "eval.json").read_text())
    assert results["prompts"] == 32
    assert [k for k in results if k.startswith("pass@")] == ["pass@1", "pass@2", "pass@4"]
    assert results["pass@1"] <= results["pass@2"] <= results["pass@4"]
    tokenizer = load_tokenizer(tiny_setup["model"])
    model = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(tiny_setup["model"]), str(checkpoint / "adapter")
    )
    rows = [json.loads(line) for line in Path(tiny_setup["val"]).read_text().splitlines()]
    scores = []
    for row in rows:
        ids = torch.tensor([tokenizer(row["prompt"])["input_ids"]])
        out = model.generate(ids, do_sample=False, max_new_tokens=6, eos_token_id=tokenizer.eos_token_id,
                             pad_token_id=tokenizer.pad_token_id)  # fmt: skip
        text = tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
        scores.append(text.count("7") / max(len(text), 1))
    assert results["greedy_reward"] == pytest.approx(sum(scores) / len(scores))
    assert main(["export", "--checkpoint", str(checkpoint), "--merged", str(tmp_path / "merged")]) == 0
    overrides = [f"model.path={tiny_setup['model']}", f"data.val_files=[{tiny_setup['val']}]",
                 f"reward.fn={tiny_setup['reward']}", "rollout.max_tokens=6", "rollout.n=4"]  # fmt: skip
    assert main(["eval", "--checkpoint", str(tmp_path / "merged"), "--n", "4", "--out", str(tmp_path / "m.json"),
                 *overrides]) == 0  # fmt: skip
    merged = json.loads((tmp_path / "m.json").read_text())
    assert merged["greedy_reward"] == pytest.approx(results["greedy_reward"], abs=1e-6)


def test_saved_adapter_loads_with_peft_and_export_equals_its_merge(trained, tiny_setup, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    adapter = trained / "checkpoints" / "step_12" / "adapter"
    peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_setup["model"]), str(adapter))
    assert main(["export", "--checkpoint", str(adapter.parent), "--merged", str(tmp_path / "merged")]) == 0
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").state_dict()
    reference = peft_model.merge_and_unload().state_dict()
    assert exported.keys() == reference.keys()
    for name, tensor in reference.items():
        torch.testing.assert_close(exported[name], tensor, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(("worker", "dtype"), [("process", "float32"), ("inline", "float32"), ("inline", "bfloat16")])
def test_the_engine_receives_the_merged_weights(tiny_setup, tmp_path, worker, dtype):
    """In a process of its own (over gloo) or in the trainer's (copied in), the engine holds the trainer's merged
    weights after each sync, in a model of its own — in `rollout.dtype` (merged in float32, rounded once), as peft's
    own merge of the same adapter rounds to."""
    from peft import get_peft_model_state_dict

    overrides = tiny_overrides(tiny_setup, tmp_path / "out", rollout__worker=worker, rollout__dtype=dtype)
    trainer = Trainer(load_config(None, overrides, presets=PRESETS))
    assert trainer.policy.dtype == torch.float32
    trainer.start_engine()
    try:
        if worker == "process":
            assert trainer.engine.process.pid != os.getpid()
            assert trainer.engine.process.is_alive()
        else:
            own = {p.data_ptr() for p in trainer.model.parameters()}
            assert not own & {p.data_ptr() for p in trainer.engine.worker.model.parameters()}
        trainer.weights.sync()
        trainer.train_step(1)
        assert trainer.engine.version == 1

        assert trainer.engine.checksum() == checksum(iter_merged_weights(trainer.model, dtype=getattr(torch, dtype)))
        if worker == "inline":
            reference = _peft_merge(tiny_setup["model"], get_peft_model_state_dict(trainer.model),
                                    trainer.model.peft_config["default"])  # fmt: skip
            engine = trainer.engine.worker.model.state_dict()
            for name, tensor in reference.items():
                assert engine[name].dtype == getattr(torch, dtype), name
                tolerance = {"rtol": 1e-6, "atol": 1e-6} if dtype == "float32" else {"rtol": 8e-3, "atol": 1e-5}
                torch.testing.assert_close(engine[name].float(), tensor.to(engine[name].dtype).float(), **tolerance)
    finally:
        trainer.engine.close()
    if worker == "process":
        assert not trainer.engine.process.is_alive()


def _peft_merge(model_path, adapter_tensors, config) -> dict[str, torch.Tensor]:
    """peft's own merge (`merge_and_unload`) of an adapter onto a fresh float32 copy of the base."""
    from peft import get_peft_model, set_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    model = get_peft_model(AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32), config)
    set_peft_model_state_dict(model, adapter_tensors)
    return model.merge_and_unload().state_dict()


def test_resume_repeats_the_uninterrupted_run(tiny_setup, tmp_path, capsys):
    straight, interrupted = tmp_path / "straight", tmp_path / "interrupted"
    assert main(tiny_overrides(tiny_setup, straight, trainer__steps=4)) == 0
    assert main(tiny_overrides(tiny_setup, interrupted, trainer__steps=2, trainer__resume="auto")) == 0
    assert f"no checkpoint in {interrupted}: starting a fresh run" in capsys.readouterr().out  # said, not silent
    assert main(tiny_overrides(tiny_setup, interrupted, trainer__steps=4, trainer__resume="auto")) == 0
    assert "resumed from" in capsys.readouterr().out
    expected, resumed = metrics(straight), metrics(interrupted)
    assert [m["step"] for m in resumed] == [1, 2, 3, 4]
    for a, b in zip(expected[2:], resumed[2:], strict=True):
        for key in ("reward/mean", "response_length/mean", "loss", "entropy", "grad_norm"):
            assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-7), (a["step"], key)


def test_tensorboard_event_files(trained):
    assert list((trained / "tensorboard").glob("events.out.tfevents.*"))


def wandb_records(path):
    """The protobuf records of a `.wandb` run file: a ":W&B" header, then a LevelDB-style log (32 KiB blocks of
    records: crc32 (4 bytes), length (2), type (1: full, 2: first, 3: middle, 4: last), data)."""
    import struct

    from wandb.proto import wandb_internal_pb2

    data = Path(path).read_bytes()
    assert data[:4] == b":W&B"
    position, pending = 7, b""
    while position + 7 <= len(data):
        if (left := 32768 - position % 32768) < 7:
            position += left  # a block's tail too short for a record header is padding
            continue
        length, kind = struct.unpack("<HB", data[position + 4 : position + 7])
        pending += data[position + 7 : position + 7 + length]
        position += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


def test_wandb_offline_and_tensorboard_loggers(tiny_setup, tmp_path, monkeypatch):
    """`trainer.loggers=[wandb,tensorboard]` with no network (WANDB_MODE=offline): wandb's run file holds every
    step's metrics and the run's configuration; TensorBoard's event files are written too."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    out = tmp_path / "out"
    assert main(tiny_overrides(tiny_setup, out, trainer__steps=3, trainer__loggers="[wandb,tensorboard]")) == 0
    (run_file,) = (out / "wandb").glob("offline-run-*/run-*.wandb")
    records = list(wandb_records(run_file))
    history = [{item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in r.history.item}
               for r in records if r.WhichOneof("record_type") == "history"]  # fmt: skip
    assert [h["_step"] for h in history] == [1, 2, 3]
    expected = [m for m in metrics(out) if "reward/mean" in m]
    assert [h["reward/mean"] for h in history] == pytest.approx([m["reward/mean"] for m in expected])
    (run,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert {item.key for item in run.config.update} >= {"model", "algorithm", "trainer"}
    assert list((out / "tensorboard").glob("events.out.tfevents.*"))


def test_full_fine_tuning_with_a_kl_term_keeps_a_frozen_reference(tiny_setup, tmp_path):
    config = load_config(None, tiny_overrides(tiny_setup, tmp_path / "out", model__lora__rank=0, actor__lr=1e-3,
                                              algorithm__kl_coef=0.1, trainer__steps=8), presets=PRESETS)  # fmt: skip
    trainer = Trainer(config)
    assert trainer.policy.frozen_reference is not None
    assert all(p.requires_grad for p in trainer.model.parameters())
    before = {k: v.clone() for k, v in trainer.policy.frozen_reference.state_dict().items()}
    summary = trainer.run()
    assert summary["steps"] == 8
    assert all(torch.equal(v, before[k]) for k, v in trainer.policy.frozen_reference.state_dict().items())
    assert (tmp_path / "out" / "checkpoints" / "step_8" / "model" / "model.safetensors").is_file()
    kls = [m["kl"] for m in metrics(tmp_path / "out") if "kl" in m]
    assert len(kls) == 8
    assert kls[-1] > 0  # the policy moved away from the frozen reference
    assert (tmp_path / "out" / "plots" / "kl.png").stat().st_size > 1000


@pytest.mark.parametrize("kl_coef", [0.0, 0.1])
def test_the_reference_forward_runs_only_for_a_kl_term(tiny_setup, tmp_path, kl_coef):
    config = load_config(None, tiny_overrides(tiny_setup, tmp_path / "out", algorithm__kl_coef=kl_coef,
                                              trainer__steps=1), presets=PRESETS)  # fmt: skip
    trainer = Trainer(config)
    passes = []
    reference = trainer.policy.reference
    trainer.policy.reference = lambda: passes.append("reference") or reference()
    trainer.run()
    assert passes == (["reference"] if kl_coef else [])
    assert ("kl" in metrics(tmp_path / "out")[-1]) == bool(kl_coef)


def test_starting_from_a_saved_adapter(trained, tiny_setup, tmp_path):
    adapter = trained / "checkpoints" / "step_12" / "adapter"
    config = load_config(None, tiny_overrides(tiny_setup, tmp_path / "out", model__lora__adapter_path=str(adapter),
                                              model__lora__rank=4), presets=PRESETS)  # fmt: skip
    trainer = Trainer(config)
    from peft import get_peft_model_state_dict
    from safetensors.torch import load_file

    saved = load_file(str(adapter / "adapter_model.safetensors"))
    loaded = get_peft_model_state_dict(trainer.model)
    assert trainer.model.peft_config["default"].r == 8  # rank and alpha come from the adapter, not model.lora.rank
    assert all(torch.equal(loaded[k], v) for k, v in saved.items())
    assert any(p.requires_grad for p in trainer.policy.trainable())


def test_ppo_epochs_mini_batches_and_kl_in_the_reward(tiny_setup, tmp_path):
    overrides = tiny_overrides(tiny_setup, tmp_path / "out", algorithm__ppo_epochs=2, algorithm__mini_batches=2,
                               algorithm__kl_coef=0.05, algorithm__kl_in_reward=True, actor__warmup_steps=2,
                               actor__lr_schedule="cosine", rollout__dtype="float32")  # fmt: skip
    assert main(overrides) == 0  # (the float32 engine of the run this test was written on: its rise is seed-bound)
    records = [m for m in metrics(tmp_path / "out") if "reward/mean" in m]
    assert len(records) == 12
    assert any(m["clipfrac"] > 0 for m in records)  # a second epoch on the same rollouts moves the ratio
    assert records[-1]["lr"] == pytest.approx(0.0, abs=1e-9)  # the cosine schedule ends at 0
    rewards = [m["reward/mean"] for m in records]
    assert sum(rewards[-3:]) > sum(rewards[:3])


def test_a_step_is_the_same_every_time(tmp_path):
    """The same seed, the same update, bit for bit: on the embedded default (32 prompts x 8) a prompt's 8 responses
    all add their gradients into its KV cache, which advanced indexing accumulated in parallel on CPU, in whatever
    order the threads came (the runs drifted apart after a few steps). Two threads, fixed: a count adapted to the load
    (the default) may differ between the runs when other tests share the cores, and with it large reductions."""
    trained = []
    for run in range(3):
        overrides = [f"trainer.output_dir={tmp_path / str(run)}", "trainer.threads=2"]
        trainer = Trainer(load_config(None, overrides, presets=PRESETS))
        assert trainer.actor.share_prompts
        trainer.start_engine()
        try:
            trainer.weights.sync()
            trainer.train_step(1)
        finally:
            trainer.engine.close()
        trained.append([p.detach().clone() for p in trainer.policy.trainable()])
    for other in trained[1:]:
        assert all(torch.equal(a, b) for a, b in zip(trained[0], other, strict=True))


def test_bfloat16_autocast_trains_as_float32_does(tiny_setup, tmp_path):
    """`actor.autocast=bfloat16`: the same first step (the engine samples the same rollouts) gives the loss and
    gradient norm of the float32 run within bf16's precision."""
    firsts = []
    for autocast in ("none", "bfloat16"):
        out = tmp_path / autocast
        overrides = tiny_overrides(tiny_setup, out, trainer__steps=1, trainer__eval_every=0, actor__autocast=autocast)
        assert main(overrides) == 0
        firsts.append(json.loads((out / "metrics.jsonl").read_text().splitlines()[-1]))
    plain, autocast = firsts
    assert plain["reward/mean"] == autocast["reward/mean"]
    assert plain["grad_norm"] > 0
    assert autocast["grad_norm"] == pytest.approx(plain["grad_norm"], rel=0.02)
    assert autocast["entropy"] == pytest.approx(plain["entropy"], rel=0.01)
