"""A verl user's and a TRL user's files, unchanged: verl's parquet schema (chat-message prompts, the answer in
`reward_model.ground_truth`, data_source and extra_info) scored by a verl `compute_score`, and a `datasets` directory
scored by TRL reward functions with their dataset columns — weighted, each logged."""

import json
import shutil

import pyarrow as pa
import pyarrow.parquet as pq
from trainer_fixtures import tiny_overrides

from lorarl.trainer.cli import main
from lorarl.trainer.models import load_tokenizer

VERL_REWARD = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    assert data_source == "tiny_add" and extra_info["split"] in ("train", "test"), (data_source, extra_info)
    return {"score": solution_str.count("7") / max(len(solution_str), 1), "pred": solution_str}
"""

TRL_REWARDS = """
def sevens(prompts, completions, solution, **kwargs):
    assert len(prompts) == len(completions) == len(solution) == len(kwargs["level"])
    return [c.count("7") / max(len(c), 1) for c in completions]


def short(completions, **kwargs):
    return [1.0 / (1 + len(c)) for c in completions]
"""


def with_chat_template(model_dir, out):
    """The tiny model with a chat template (its tokenizer only knows digits, + and =)."""
    shutil.copytree(model_dir, out)
    tokenizer = load_tokenizer(out)
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    tokenizer.save_pretrained(out)
    return out


def records(out) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if '"reward/mean"' in line]


def test_a_verl_user_brings_parquet_and_compute_score(tiny_setup, tmp_path):
    model = with_chat_template(tiny_setup["model"], tmp_path / "model")
    for split, count in (("train", 200), ("test", 16)):
        rows = [{"data_source": "tiny_add", "prompt": [{"role": "user", "content": f"{a}+{a}="}], "ability": "math",
                 "reward_model": {"style": "rule", "ground_truth": str(2 * a)},
                 "extra_info": {"split": split, "index": a}} for a in range(count)]  # fmt: skip
        pq.write_table(pa.Table.from_pylist(rows), tmp_path / f"{split}.parquet")
    (tmp_path / "reward.py").write_text(VERL_REWARD)
    out = tmp_path / "out"
    overrides = tiny_overrides(tiny_setup, out, model__path=str(model),
                               data__train_files=f"[{tmp_path / 'train.parquet'}]",
                               data__val_files=f"[{tmp_path / 'test.parquet'}]",
                               reward__fn=f"{tmp_path / 'reward.py'}:compute_score", trainer__eval_every=6)  # fmt: skip
    assert main(overrides) == 0
    steps = records(out)
    assert len(steps) == 12
    assert sum(r["reward/mean"] for r in steps[-3:]) > sum(r["reward/mean"] for r in steps[:3]) + 0.3


def test_a_trl_user_brings_a_datasets_directory_and_reward_functions(tiny_setup, tmp_path):
    from datasets import Dataset

    rows = [{"prompt": f"{a}+{a}=", "solution": str(2 * a), "level": a % 3} for a in range(216)]
    Dataset.from_list(rows[:200]).save_to_disk(str(tmp_path / "train"))
    Dataset.from_list(rows[200:]).save_to_disk(str(tmp_path / "val"))
    (tmp_path / "rewards.py").write_text(TRL_REWARDS)
    out = tmp_path / "out"
    fns = f"[{tmp_path / 'rewards.py'}:sevens,{tmp_path / 'rewards.py'}:short]"
    overrides = tiny_overrides(tiny_setup, out, data__train_files=f"[{tmp_path / 'train'}]",
                               data__val_files=f"[{tmp_path / 'val'}]", data__answer_key="solution", reward__fns=fns,
                               reward__weights="[1.0,0.1]", reward__fn="default")  # fmt: skip
    assert main(overrides) == 0
    steps = records(out)
    assert len(steps) == 12
    for r in steps:  # (metrics are logged to 6 digits)
        assert abs(r["reward/mean"] - (r["reward/fn/sevens"] + 0.1 * r["reward/fn/short"])) < 1e-5
    assert sum(r["reward/fn/sevens"] for r in steps[-3:]) > sum(r["reward/fn/sevens"] for r in steps[:3]) + 0.3
