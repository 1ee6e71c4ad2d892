"""The learning benchmark's wiring, in seconds and without TRL: TRL is handed the prompts lorarl's trainer really
draws, the one evaluator grades as a plain per-problem greedy loop does, and the summary's wall-clock and equal-step
figures are those worked out by hand. The benchmark itself (real model, minutes per run) is not run here."""

import importlib.util
import json
import shutil
import sys
from pathlib import Path

import pytest
import torch

BENCHMARKS = Path(__file__).parents[1] / "benchmarks"


@pytest.fixture(scope="module")
def bench():
    sys.path.insert(0, str(BENCHMARKS))  # it imports its sibling step_vs_trl
    try:
        spec = importlib.util.spec_from_file_location("learning_vs_trl", BENCHMARKS / "learning_vs_trl.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(BENCHMARKS))
    return module


def test_the_recipe_settings_are_those_both_sides_run(bench):
    assert bench.check_recipe() == "number_at_end"  # raises if the recipe moved away from the TRL side's settings


def test_trl_gets_the_prompts_lorarl_draws_in_its_order(bench, tmp_path):
    from lorarl.trainer.config import load_config
    from lorarl.trainer.loop import Trainer

    rows = [{"prompt": f"{a}+{a + 1}=", "answer": str(2 * a + 1)} for a in range(40)]
    train = tmp_path / "train.jsonl"
    train.write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = load_config(overrides=[f"data.train_files=[{train}]", f"data.batch_size={bench.PROMPTS}", "rollout.n=2",
                                    "trainer.steps=3", "trainer.eval_every=0", f"trainer.output_dir={tmp_path / 'out'}",
                                    "trainer.seed=7"])  # fmt: skip
    trainer = Trainer(config)
    drawn = []
    next_batch = trainer.sampler.next_batch

    def recorded() -> list[int]:
        drawn.extend(batch := next_batch())
        return batch

    trainer.sampler.next_batch = recorded
    trainer.run()
    prompts = [trainer.train_set[i].prompt_ids for i in drawn[: 3 * bench.PROMPTS]]
    expected = bench.trl_prompt_order(rows, seed=7)[: 3 * bench.PROMPTS]
    assert [trainer.tokenizer.decode(p) for p in prompts] == [r["prompt"] for r in expected]
    assert len(bench.trl_prompt_order(rows, seed=7)) == bench.STEPS * bench.PROMPTS  # batches span epochs


def greedy_one_by_one(model, tokenizer, prompt: str) -> str:
    """Greedy decoding of one unpadded prompt by argmax, without `generate`."""
    ids = tokenizer(prompt, add_special_tokens=False, return_tensors="pt")["input_ids"]
    new = []
    with torch.inference_mode():
        for _ in range(16):
            token = int(model(torch.cat([ids, torch.tensor([new], dtype=torch.long)], dim=1)).logits[0, -1].argmax())
            if token == tokenizer.eos_token_id:
                break
            new.append(token)
    return tokenizer.decode(new, skip_special_tokens=True)


def test_the_evaluator_grades_as_a_per_problem_greedy_loop(bench, tmp_path):
    """On the embedded default model (a trained adder: some answers right, some wrong), base and with an adapter;
    the reference runs peft's unmerged LoRA forward one problem at a time."""
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from lorarl.trainer import default_task

    model_dir = tmp_path / "model"
    shutil.copytree(default_task.MODEL_DIR, model_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.chat_template = "{{ messages[0]['content'] }}"  # the prompt as it is: this model was trained on it
    tokenizer.save_pretrained(model_dir)
    torch.manual_seed(0)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False)
    adapted = get_peft_model(AutoModelForCausalLM.from_pretrained(model_dir), lora)
    with torch.no_grad():
        for name, p in adapted.named_parameters():
            if "lora_B" in name:
                p.mul_(0.05)  # a nudge: it changes some answers, not all
    adapted.save_pretrained(tmp_path / "adapter")
    problems = default_task.problems(24, validation=True, seed=0)

    scores = bench.grade(model_dir, problems, [None, str(tmp_path / "adapter")], dtype="float32")

    base = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    with_adapter = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_dir), tmp_path / "adapter")
    for model, got in ((base, scores[0]), (with_adapter.eval(), scores[1])):
        answers = [greedy_one_by_one(model, tokenizer, p["prompt"]) for p in problems]
        expected = [float(a.strip() == p["answer"]) for a, p in zip(answers, problems, strict=True)]
        assert got == expected
    assert 0 < sum(scores[0]) < len(problems)  # the comparison has right and wrong answers to agree on
    assert scores[0] != scores[1]  # and the adapter counts


def run(side: str, seed: int, points: list[tuple[int, float, float | None]]) -> dict:
    """A run's record as `run_side` writes it: (step, wall seconds, accuracy or None where no adapter was saved)."""
    rows = [{"step": s, "wall_s": w} | ({"accuracy": a} if a is not None else {}) for s, w, a in points]
    return {"side": side, "seed": seed, "steps_done": points[-1][0], "wall_s": points[-1][1], "peak_rss_gb": 1.0,
            "points": rows}  # fmt: skip


def test_the_summary_against_hand_worked_curves(bench):
    runs = [
        run("lorarl", 0, [(5, 10.0, 0.2), (10, 20.0, 0.6), (15, 30.0, 0.5)]),
        run("lorarl", 1, [(5, 12.0, 0.4), (10, 22.0, 0.4), (15, 32.0, 0.7)]),
        run("trl", 0, [(5, 40.0, 0.3), (7, 50.0, None), (10, 60.0, 0.5), (15, 90.0, 0.9)]),
        run("trl", 1, [(5, 44.0, 0.1), (10, 64.0, 0.5)]),
    ]
    s = bench.summarize(runs, base=0.05, budget_s=70.0)  # TRL's step 15 (90 s) is past the budget
    assert s["marks_s"] == [0.0, 10.0, 12.0, 20.0, 22.0, 30.0, 32.0, 40.0, 44.0, 60.0, 64.0]
    assert s["curves"]["trl"]["mean"] == pytest.approx([0.05] * 7 + [0.175, 0.2, 0.3, 0.5])
    assert s["curves"]["lorarl"]["mean"][1:4] == pytest.approx([0.125, 0.3, 0.5])  # base, then one seed's 0.2, ...
    assert (s["curves"]["lorarl"]["min"][3], s["curves"]["lorarl"]["max"][3]) == (pytest.approx(0.4), 0.6)
    assert s["trl_best_mean_accuracy"] == pytest.approx(0.5)
    assert (s["trl_reaches_best_s"], s["lorarl_reaches_trl_best_s"]) == (64.0, 20.0)
    assert s["time_ratio"] == pytest.approx(20 / 64)
    assert s["equal_steps"] == [
        {"step": 5, "lorarl_mean": pytest.approx(0.3), "lorarl_min": 0.2, "lorarl_max": 0.4,
         "lorarl_spread": pytest.approx(0.2), "trl_mean": pytest.approx(0.2), "trl_min": 0.1, "trl_max": 0.3,
         "trl_spread": pytest.approx(0.2)},
        {"step": 10, "lorarl_mean": pytest.approx(0.5), "lorarl_min": 0.4, "lorarl_max": 0.6,
         "lorarl_spread": pytest.approx(0.2), "trl_mean": pytest.approx(0.5), "trl_min": 0.5, "trl_max": 0.5,
         "trl_spread": 0.0},
    ]  # fmt: skip
    assert s["by_step"]["lorarl"] == [{"step": 5, "mean": pytest.approx(0.3), "min": 0.2, "max": 0.4},
                                      {"step": 10, "mean": pytest.approx(0.5), "min": 0.4, "max": 0.6},
                                      {"step": 15, "mean": pytest.approx(0.6), "min": 0.5, "max": 0.7}]  # fmt: skip
    assert [row["step"] for row in s["by_step"]["trl"]] == [5, 10]  # the steps every TRL run saved
    assert (s["lorarl_peak_mean"], s["lorarl_final_mean"]) == (pytest.approx(0.6), pytest.approx(0.6))


def test_a_run_saves_its_adapter_at_the_marks_and_stops_at_the_budget(bench, tmp_path):
    from peft import LoraConfig, get_peft_model
    from tiny_models import tiny_qwen2

    model = get_peft_model(tiny_qwen2(), LoraConfig(r=2, target_modules=["q_proj"]))
    progress = bench.Progress(tmp_path, launched=0.0, budget_s=float("inf"), save_every=3)
    assert not any(progress.step_done(step, model, {"reward": 0.0}) for step in range(1, 7))
    progress.budget_s = 0.0  # spent: the step that notices saves its adapter too
    assert progress.step_done(7, model, {"reward": 0.0})
    saved = [p["step"] for p in json.loads((tmp_path / "progress.json").read_text()) if "adapter" in p]
    assert saved == [3, 6, 7]
    assert all((tmp_path / f"step-{s}" / "adapter_config.json").is_file() for s in saved)
