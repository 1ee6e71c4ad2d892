"""Prompt datasets: jsonl or parquet rows with a prompt and an answer, tokenized once, shuffled per epoch."""

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from lorarl.trainer import default_task
from lorarl.trainer.errors import TrainerError


@dataclass(frozen=True)
class Example:
    prompt: str
    answer: str
    prompt_ids: tuple[int, ...]


def read_rows(files: list[str], *, default_file: str) -> list[dict]:
    """Rows of every file, in order. `default` names the embedded task's file `default_file`."""
    rows: list[dict] = []
    for name in files:
        path = default_task.MODEL_DIR / default_file if name == "default" else Path(name)
        if not path.is_file():
            raise TrainerError(f"data file {path} not found")
        if path.suffix == ".parquet":
            import pyarrow.parquet as pq

            rows += pq.read_table(path).to_pylist()
        elif path.suffix in (".jsonl", ".json"):
            for number, line in enumerate(path.read_text().splitlines(), 1):
                if line.strip():
                    try:
                        rows.append(json.loads(line))
                    except json.JSONDecodeError as e:
                        raise TrainerError(f"{path}:{number} is not valid JSON: {e}") from None
        else:
            raise TrainerError(f"data file {path}: expected .jsonl or .parquet")
    return rows


def build_examples(
    rows: list[dict], tokenizer, *, prompt_key: str, answer_key: str, max_prompt_tokens: int, chat_template: bool
) -> tuple[list[Example], int]:
    """Tokenized examples, and how many were dropped for prompts longer than `max_prompt_tokens`."""
    use_template = chat_template and getattr(tokenizer, "chat_template", None)
    examples, dropped = [], 0
    for i, row in enumerate(rows):
        if prompt_key not in row or answer_key not in row:
            raise TrainerError(f"row {i} lacks {prompt_key!r} or {answer_key!r} (it has {sorted(row)}); "
                               "set data.prompt_key / data.answer_key")  # fmt: skip
        prompt = str(row[prompt_key])
        if use_template:
            ids = tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True
            )
            ids = ids["input_ids"] if isinstance(ids, Mapping) else ids  # transformers 5 returns a BatchEncoding
        else:
            ids = tokenizer(prompt)["input_ids"]
        if len(ids) > max_prompt_tokens:
            dropped += 1
            continue
        examples.append(Example(prompt, str(row[answer_key]), tuple(ids)))
    return examples, dropped


class PromptSampler:
    """Batches of example indices: a seeded permutation per epoch, walked in order (batches may span epochs)."""

    def __init__(self, size: int, batch_size: int, seed: int):
        if size == 0:
            raise TrainerError("the training dataset is empty (after dropping prompts that are too long)")
        self.size, self.batch_size, self.seed = size, batch_size, seed
        self.epoch, self.position = 0, 0
        self._order = self._permutation(0)

    def _permutation(self, epoch: int) -> list[int]:
        return torch.randperm(
            self.size, generator=torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        ).tolist()

    def next_batch(self) -> list[int]:
        batch = []
        while len(batch) < self.batch_size:
            if self.position == self.size:
                self.epoch, self.position = self.epoch + 1, 0
                self._order = self._permutation(self.epoch)
            take = min(self.batch_size - len(batch), self.size - self.position)
            batch += self._order[self.position : self.position + take]
            self.position += take
        return batch

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.position = state["epoch"], state["position"]
        self._order = self._permutation(self.epoch)
