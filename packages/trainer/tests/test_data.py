"""Prompt data as verl and TRL users keep it (jsonl, json, parquet, csv, `datasets` directories, globs; chat
messages, nested answers), errors naming file and line, length filtering with a count, chat templates and system
prompts, the seeded per-epoch order."""

import json

import pytest

from lorarl.trainer import default_task
from lorarl.trainer.data import PromptSampler, Row, build_examples, read_rows
from lorarl.trainer.errors import TrainerError

ROWS = [{"question": f"{i}+{i}=", "solution": str(2 * i)} for i in range(10)]


def rows_of(fields: list[dict]) -> list[Row]:
    return [Row(f"test row {i}", f) for i, f in enumerate(fields, 1)]


def test_jsonl_and_parquet_read_the_same_rows(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp_path / "a.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    pq.write_table(pa.Table.from_pylist(ROWS), tmp_path / "a.parquet")
    from datasets import Dataset

    (tmp_path / "a.json").write_text(json.dumps(ROWS))
    (tmp_path / "a.csv").write_text("question,solution\n" + "".join(f"{r['question']},{r['solution']}\n" for r in ROWS))
    Dataset.from_list(ROWS).save_to_disk(str(tmp_path / "saved"))
    pq.write_table(pa.Table.from_pylist(ROWS[:4]), tmp_path / "part-0.parquet")
    pq.write_table(pa.Table.from_pylist(ROWS[4:]), tmp_path / "part-1.parquet")
    read = {name: [r.fields for r in read_rows([str(tmp_path / name)], default_file="train.jsonl")]
            for name in ("a.jsonl", "a.parquet", "a.json", "saved", "part-*.parquet")}  # fmt: skip
    assert all(rows == ROWS for rows in read.values()), read
    csv = [r.fields for r in read_rows([str(tmp_path / "a.csv")], default_file="train.jsonl")]
    assert [str(r["solution"]) for r in csv] == [r["solution"] for r in ROWS]  # (csv infers the numbers' type)
    (tmp_path / "a.txt").write_text("x")
    with pytest.raises(TrainerError, match=r"expected \.jsonl, \.json, \.parquet, \.csv or a `datasets` directory"):
        read_rows([str(tmp_path / "a.txt")], default_file="train.jsonl")
    with pytest.raises(TrainerError, match="matches no file"):
        read_rows([str(tmp_path / "nothing-*.parquet")], default_file="train.jsonl")
    (tmp_path / "bad.jsonl").write_text('{"a": 1}\nnot json\n')
    with pytest.raises(TrainerError, match=r"bad\.jsonl:2"):
        read_rows([str(tmp_path / "bad.jsonl")], default_file="train.jsonl")


def test_embedded_task_files_are_disjoint():
    train = read_rows(["default"], default_file="train.jsonl")
    val = read_rows(["default"], default_file="val.jsonl")
    assert len(train) == 20_000
    assert len(val) == 500
    assert not {r.fields["prompt"] for r in train} & {r.fields["prompt"] for r in val}
    for row in val:
        a, b = map(int, row.fields["prompt"].rstrip("=").split("+"))
        assert default_task.is_validation(a, b)


def test_long_prompts_are_dropped_and_counted():
    tokenizer = default_task.build_tokenizer()
    rows = rows_of([{"prompt": "1+1=", "answer": "2"}, {"prompt": "123+456=", "answer": "579"}])
    examples, dropped = build_examples(rows, tokenizer, prompt_key="prompt", answer_key="answer",
                                       max_prompt_tokens=5, chat_template=True)  # fmt: skip
    assert [e.prompt for e in examples] == ["1+1="]
    assert dropped == 1


def test_a_bad_row_is_named_by_its_file_and_line_from_1(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    tokenizer = default_task.build_tokenizer()
    good, bad = {"prompt": "1+1=", "answer": "2"}, {"question": "2+2=", "answer": "4"}
    (tmp_path / "a.jsonl").write_text(json.dumps(good) + "\n\n" + json.dumps(bad) + "\n")  # an empty line 2
    pq.write_table(pa.Table.from_pylist([good, good, {"prompt": "3+3=", "answer": None}]), tmp_path / "a.parquet")
    for name, where, key in [("a.jsonl", "a.jsonl:3", "prompt"), ("a.parquet", "a.parquet row 3", "answer")]:
        rows = read_rows([str(tmp_path / name)], default_file="train.jsonl")
        if key == "answer":
            rows = [r if r.fields["answer"] is not None else type(r)(r.where, {"prompt": "3+3="}) for r in rows]
        with pytest.raises(TrainerError, match=rf"{where}: no '{key}'.*set data\.{key}_key"):
            build_examples(rows, tokenizer, prompt_key="prompt", answer_key="answer", max_prompt_tokens=50,
                           chat_template=False)  # fmt: skip


def test_verl_rows_chat_messages_and_nested_answers(tmp_path):
    """verl's parquet schema as it is: `prompt` a list of chat messages, the answer in
    `reward_model.ground_truth` (found by answer_key=auto), data_source and extra_info kept for the reward."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    tokenizer = default_task.build_tokenizer()
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}={% endfor %}"  # (the tokenizer knows digits)
    rows = [{"data_source": "openai/gsm8k", "prompt": [{"role": "system", "content": "9"},
                                                       {"role": "user", "content": "1+1"}],
             "ability": "math", "reward_model": {"style": "rule", "ground_truth": "2"},
             "extra_info": {"index": 0, "split": "train"}}]  # fmt: skip
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "train.parquet")
    read = read_rows([str(tmp_path / "train.parquet")], default_file="train.jsonl")
    (example,), _ = build_examples(read, tokenizer, prompt_key="prompt", answer_key="auto", max_prompt_tokens=50,
                                   chat_template=True)  # fmt: skip
    assert example.answer == "2"
    assert example.prompt == rows[0]["prompt"]
    assert tokenizer.decode(list(example.prompt_ids)) == "9=1+1="
    assert example.columns["data_source"] == "openai/gsm8k"
    assert example.columns["extra_info"] == {"index": 0, "split": "train"}
    for system_prompt, decoded in [("2", "2=1+1="), ("", "=1+1=")]:  # replaced; cleared (an empty one)
        (example,), _ = build_examples(read, tokenizer, prompt_key="prompt", answer_key="reward_model.ground_truth",
                                       max_prompt_tokens=50, chat_template=True,
                                       system_prompt=system_prompt)  # fmt: skip
        assert tokenizer.decode(list(example.prompt_ids)) == decoded
    with pytest.raises(TrainerError, match="needs the tokenizer's chat template"):
        build_examples(read, tokenizer, prompt_key="prompt", answer_key="auto", max_prompt_tokens=50,
                       chat_template=False)  # fmt: skip


def test_prompt_messages_keep_their_tool_calls(tmp_path):
    """A worked tool call in a prompt (an assistant's `tool_calls`, the tool's reply) reaches the template as written;
    the fields a parquet table leaves empty (None, where other messages have them) are dropped."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from lorarl.trainer.calculator_task import build_tokenizer

    tokenizer = build_tokenizer()
    call = {"type": "function", "function": {"name": "mul", "arguments": {"a": 12, "b": 3}}}
    prompt = [{"role": "user", "content": "12*3"}, {"role": "assistant", "content": "", "tool_calls": [call]},
              {"role": "tool", "content": "36"}, {"role": "assistant", "content": "36"},
              {"role": "user", "content": "45*6"}]  # fmt: skip
    pq.write_table(pa.Table.from_pylist([{"prompt": prompt, "answer": "270"}]), tmp_path / "train.parquet")
    read = read_rows([str(tmp_path / "train.parquet")], default_file="train.jsonl")
    assert read[0].fields["prompt"][0]["tool_calls"] is None  # what the table made of the message without one
    (example,), _ = build_examples(read, tokenizer, prompt_key="prompt", answer_key="answer", max_prompt_tokens=100,
                                   chat_template=True)  # fmt: skip
    expected = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False)
    assert tokenizer.decode(list(example.prompt_ids)) == expected
    assert "<call>mul 12 3</call>" in expected


def test_chat_template_is_applied_when_the_tokenizer_has_one():
    tokenizer = default_task.build_tokenizer()
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}={% endfor %}"
    row = rows_of([{"prompt": "1+1", "answer": "2"}])
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
