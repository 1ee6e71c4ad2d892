"""Prompt files (jsonl, parquet), length filtering with a count, chat templates, the seeded per-epoch order."""

import json

import pytest

from lorarl.trainer import default_task
from lorarl.trainer.data import PromptSampler, build_examples, read_rows
from lorarl.trainer.errors import TrainerError

ROWS = [{"question": f"{i}+{i}=", "solution": str(2 * i)} for i in range(10)]


def test_jsonl_and_parquet_read_the_same_rows(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp_path / "a.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    pq.write_table(pa.Table.from_pylist(ROWS), tmp_path / "a.parquet")
    jsonl = read_rows([str(tmp_path / "a.jsonl")], default_file="train.jsonl")
    parquet = read_rows([str(tmp_path / "a.parquet")], default_file="train.jsonl")
    assert jsonl == parquet == ROWS
    (tmp_path / "a.csv").write_text("x")
    with pytest.raises(TrainerError, match=r"expected \.jsonl or \.parquet"):
        read_rows([str(tmp_path / "a.csv")], default_file="train.jsonl")
    (tmp_path / "bad.jsonl").write_text('{"a": 1}\nnot json\n')
    with pytest.raises(TrainerError, match=r"bad\.jsonl:2"):
        read_rows([str(tmp_path / "bad.jsonl")], default_file="train.jsonl")


def test_embedded_task_files_are_disjoint():
    train = read_rows(["default"], default_file="train.jsonl")
    val = read_rows(["default"], default_file="val.jsonl")
    assert len(train) == 20_000
    assert len(val) == 500
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in val}
    for row in val:
        a, b = map(int, row["prompt"].rstrip("=").split("+"))
        assert default_task.is_validation(a, b)


def test_long_prompts_are_dropped_and_counted():
    tokenizer = default_task.build_tokenizer()
    rows = [{"prompt": "1+1=", "answer": "2"}, {"prompt": "123+456=", "answer": "579"}]
    examples, dropped = build_examples(rows, tokenizer, prompt_key="prompt", answer_key="answer",
                                       max_prompt_tokens=5, chat_template=True)  # fmt: skip
    assert [e.prompt for e in examples] == ["1+1="]
    assert dropped == 1
    with pytest.raises(TrainerError, match="lacks 'question'"):
        build_examples(
            rows, tokenizer, prompt_key="question", answer_key="answer", max_prompt_tokens=5, chat_template=True
        )


def test_chat_template_is_applied_when_the_tokenizer_has_one():
    tokenizer = default_task.build_tokenizer()
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}={% endfor %}"
    row = [{"prompt": "1+1", "answer": "2"}]
    templated, _ = build_examples(
        row, tokenizer, prompt_key="prompt", answer_key="answer", max_prompt_tokens=50, chat_template=True
    )
    plain, _ = build_examples(
        row, tokenizer, prompt_key="prompt", answer_key="answer", max_prompt_tokens=50, chat_template=False
    )
    assert tokenizer.decode(list(templated[0].prompt_ids)) == "1+1="
    assert tokenizer.decode(list(plain[0].prompt_ids)) == "1+1"


def test_sampler_order_is_seeded_per_epoch_and_resumes():
    sampler = PromptSampler(10, 4, seed=3)
    first = [sampler.next_batch() for _ in range(5)]  # 20 indices: two epochs
    assert sorted(first[0] + first[1] + first[2][:2]) == list(range(10))
    assert first[2][:2] + first[3] + first[4] != first[0] + first[1] + first[2][:2]  # a new order each epoch
    again = PromptSampler(10, 4, seed=3)
    again.next_batch()
    state = again.state_dict()
    resumed = PromptSampler(10, 4, seed=3)
    resumed.load_state_dict(state)
    assert [resumed.next_batch() for _ in range(4)] == first[1:]
    with pytest.raises(TrainerError, match="empty"):
        PromptSampler(0, 4, seed=0)
