"""Prompt datasets as verl, TRL and SkyRL users keep them, tokenized once, shuffled per epoch.

Files: JSON lines (`.jsonl`, or `.json`: lines or one array), `.parquet`, `.csv`, a directory written by HF
`datasets`' `save_to_disk` (one split), and glob patterns of those (`data/train-*.parquet`, as `load_dataset`'s
`data_files`). A prompt is text or a list of chat messages (verl's `prompt` column); the answer is `data.answer_key`
— by default `answer`, else verl's `reward_model.ground_truth`, else SkyRL's `reward_spec.ground_truth`, else none
(TRL's prompt-only data: a reward that takes the answer then refuses to start). Every other column travels with the
example to the reward functions (verl's `data_source` and `extra_info`, TRL's dataset columns).
"""

import glob
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from lorarl.trainer import default_task
from lorarl.trainer.errors import TrainerError
from lorarl.trainer.hub import dataset_files, is_hub_id

PLACEHOLDER = ({"role": "user", "content": ""},)  # TRL's prompt where an environment owns the data
AUTO_ANSWER = ("answer", "reward_model.ground_truth", "reward_spec.ground_truth")  # data.answer_key=auto's, in order


@dataclass(frozen=True)
class Row:
    where: str  # file and line (or row) counted from 1, for error messages
    fields: dict


@dataclass(frozen=True)
class Example:
    prompt: str | list[dict]  # as in the data: text, or chat messages
    answer: str | None  # None: the row has none (data.answer_key=auto found no answer field)
    prompt_ids: tuple[int, ...]
    columns: dict = field(default_factory=dict)  # the row's other fields (data_source, extra_info, ...)
    where: str = ""  # its file and line, for error messages
    prompt_key: str | None = "prompt"  # the prompt's field in the row (None: the row had none; a default stands in)

    def row(self) -> dict:
        """The data row as it was read: the prompt under its own field (if it had one), and every other field."""
        return {**({self.prompt_key: self.prompt} if self.prompt_key is not None else {}), **self.columns}


def read_rows(files: list[str], *, default_file: str, split: str = "train", config: str | None = None,
              key: str = "data.train_files") -> list[Row]:  # fmt: skip
    """Rows of every file, in order. `default` (`calculator`) names an embedded task's file `default_file`; a Hub
    dataset id (`org/name`) its split `split` of subset `config` (`hub.dataset_files`); an import path
    (`my_data.py:dataset`, `package.module:name`) a `datasets.Dataset` object, or a `DatasetDict`'s split `split`, the
    way TRL scripts hold their data."""
    rows: list[Row] = []
    for name in files:
        if IMPORT_PATH.fullmatch(name):
            rows += _object_rows(name, split, key)
            continue
        if name in default_task.EMBEDDED:
            paths = [default_task.EMBEDDED[name] / default_file]
        elif is_hub_id(name):
            paths = dataset_files(name, key, config=config, split=split)
        else:
            paths = _expand(name)
        for path in paths:
            rows += _read(path)
    return rows


def _expand(name: str) -> list[Path]:
    if any(c in name for c in "*?["):
        found = sorted(Path(p) for p in glob.glob(name, recursive=True))
        if not found:
            raise TrainerError(f"data file pattern {name!r} matches no file")
        return found
    path = Path(name)
    if not path.exists():
        raise TrainerError(f"data file {path} not found")
    return [path]


IMPORT_PATH = re.compile(r"[\w./-]+\.py:\w+|[A-Za-z_][\w.]*:\w+")


def _object_rows(spec: str, split: str, key: str) -> list[Row]:
    """The rows of the `datasets.Dataset` (or the `DatasetDict`'s split `split`) that `spec` names."""
    from lorarl.trainer.registry import PluginError, import_object

    try:
        found = import_object(spec)
    except PluginError as e:
        raise TrainerError(f"{key}: {spec}: {e}") from None
    if isinstance(found, Mapping) and not hasattr(found, "to_list"):  # a DatasetDict (or a dict of datasets)
        if split not in found:
            raise TrainerError(f"{key}: {spec} has no split {split!r} (it has {sorted(found)}); name one with "
                               f"data.{'train' if 'train' in key else 'val'}_split")  # fmt: skip
        found = found[split]
    if not callable(getattr(found, "to_list", None)):
        raise TrainerError(f"{key}: {spec} is a {type(found).__name__}, expected a datasets.Dataset (or a "
                           "DatasetDict)")  # fmt: skip
    return [Row(f"{spec} row {i}", _record(item, f"{spec} row {i}")) for i, item in enumerate(found.to_list(), 1)]


def _read(path: Path) -> list[Row]:
    if path.is_dir():
        return _read_saved_dataset(path)
    suffix = path.suffix.lower()
    if suffix in (".jsonl", ".json"):
        text = path.read_text()
        if suffix == ".json" and text.lstrip().startswith("["):
            try:
                items = json.loads(text)
            except json.JSONDecodeError as e:
                raise TrainerError(f"{path} is not valid JSON: {e}") from None
            return [Row(f"{path} item {i}", _record(item, f"{path} item {i}")) for i, item in enumerate(items, 1)]
        rows = []
        for number, line in enumerate(text.splitlines(), 1):
            if line.strip():
                try:
                    rows.append(Row(f"{path}:{number}", _record(json.loads(line), f"{path}:{number}")))
                except json.JSONDecodeError as e:
                    raise TrainerError(f"{path}:{number} is not valid JSON: {e}") from None
        return rows
    if suffix == ".parquet":
        import pyarrow.parquet as pq

        return _table_rows(pq.read_table(path), path)
    if suffix == ".csv":
        import pyarrow.csv

        return _table_rows(pyarrow.csv.read_csv(path), path)
    raise TrainerError(f"data file {path}: expected .jsonl, .json, .parquet, .csv or a `datasets` directory")


def _read_saved_dataset(path: Path) -> list[Row]:
    """A directory written by `datasets.Dataset.save_to_disk`: its Arrow stream files, read with pyarrow."""
    import pyarrow as pa

    if (path / "dataset_dict.json").is_file():
        splits = json.loads((path / "dataset_dict.json").read_text()).get("splits", [])
        raise TrainerError(f"{path} holds a DatasetDict: name one of its splits, e.g. "
                           f"{', '.join(str(path / s) for s in splits)}")  # fmt: skip
    state = path / "state.json"
    if not state.is_file():
        raise TrainerError(f"{path} is a directory but not a `datasets` save_to_disk directory (no state.json)")
    files = [path / f["filename"] for f in json.loads(state.read_text())["_data_files"]]
    tables = []
    for file in files:
        with pa.memory_map(str(file)) as source:
            tables.append(pa.ipc.open_stream(source).read_all())
    return _table_rows(pa.concat_tables(tables), path)


def _table_rows(table, path: Path) -> list[Row]:
    return [Row(f"{path} row {i}", fields) for i, fields in enumerate(table.to_pylist(), 1)]


def _record(item, where: str) -> dict:
    if not isinstance(item, dict):
        raise TrainerError(f"{where}: expected an object of fields, got {type(item).__name__}")
    return item


def lookup(fields: dict, key: str):
    """`fields[key]`, following dots into nested objects (`reward_model.ground_truth`); KeyError when absent."""
    value = fields
    for part in key.split("."):
        if not isinstance(value, dict) or part not in value:
            raise KeyError(key)
        value = value[part]
    return value


def build_examples(rows: list[Row], tokenizer, *, prompt_key: str, answer_key: str, max_prompt_tokens: int,
                   chat_template: bool, system_prompt: str | None = None,
                   default_prompt: list[dict] | None = None) -> tuple[list[Example], int]:  # fmt: skip
    """Tokenized examples, and how many were dropped for prompts longer than `max_prompt_tokens`. A chat prompt goes
    through the tokenizer's chat template; `system_prompt` (not None) replaces its system message. A row without a
    prompt takes `default_prompt` where one is given (an environment's routing data: its `reset` gives the prompt)."""
    use_template = bool(chat_template and getattr(tokenizer, "chat_template", None))
    answer_keys = AUTO_ANSWER if answer_key == "auto" else (answer_key,)
    examples, dropped = [], 0
    for row in rows:
        try:
            prompt, in_row = lookup(row.fields, prompt_key), True
        except KeyError:
            if default_prompt is None:
                raise TrainerError(f"{row.where}: no {prompt_key!r} (it has {sorted(row.fields)}); set "
                                   "data.prompt_key") from None  # fmt: skip
            prompt, in_row = default_prompt, False
        answer = _first(row, answer_keys, required=answer_key != "auto")
        ids = _prompt_ids(prompt, tokenizer, use_template, system_prompt, row.where)
        if len(ids) > max_prompt_tokens:
            dropped += 1
            continue
        columns = {k: v for k, v in row.fields.items() if k != prompt_key}
        examples.append(Example(prompt, None if answer is None else str(answer), tuple(ids), columns, row.where,
                                prompt_key if in_row else None))  # fmt: skip
    return examples, dropped


def _first(row: Row, keys: tuple[str, ...], *, required: bool):
    for key in keys:
        try:
            return lookup(row.fields, key)
        except KeyError:
            continue
    if not required:
        return None
    raise TrainerError(f"{row.where}: no {' or '.join(map(repr, keys))} (it has {sorted(row.fields)}); set "
                       "data.answer_key")  # fmt: skip


def without_answer(examples: list[Example]) -> Example | None:
    """The first example that has no answer, if any."""
    return next((e for e in examples if e.answer is None), None)


def _prompt_ids(prompt, tokenizer, use_template: bool, system_prompt: str | None, where: str) -> list[int]:
    messages = prompt_messages(prompt, system_prompt, where)
    if not use_template:
        if len(messages) > 1 or not isinstance(prompt, str):
            raise TrainerError(f"{where}: a chat prompt (messages, or data.system_prompt) needs the tokenizer's "
                               "chat template (it has none, or data.chat_template=false)")  # fmt: skip
        return tokenizer(prompt)["input_ids"]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return ids["input_ids"] if isinstance(ids, Mapping) else ids  # transformers 5 returns a BatchEncoding


def prompt_messages(prompt, system_prompt: str | None, where: str) -> list[dict]:
    """A data row's prompt (text, or {role, content} messages) as chat messages, with `data.system_prompt`. A
    message keeps its other fields (an assistant's `tool_calls`, a tool's `name`) but those a table left empty (None:
    a column other rows fill)."""
    if isinstance(prompt, str):
        messages = [{"role": "user", "content": prompt}]
    elif isinstance(prompt, list) and all(isinstance(m, dict) and {"role", "content"} <= m.keys() for m in prompt):
        messages = [{k: v for k, v in m.items() if v is not None or k == "content"} for m in prompt]
    else:
        raise TrainerError(f"{where}: the prompt must be text or a list of {{role, content}} messages, got "
                           f"{type(prompt).__name__}")  # fmt: skip
    if system_prompt is not None:
        messages = [{"role": "system", "content": system_prompt}] + [m for m in messages if m["role"] != "system"]
    return messages


def load_examples(role: str, tokenizer, section, *, env_owns_data: bool = False) -> tuple[list[Example], int]:
    """The examples of `data.<role>_files` ("train" or "val") by the `data` section's keys (`DataSection`), and how
    many were too long. No files (`[]`) with an environment that makes its own tasks (`env_owns_data`: a TRL
    environment whose `reset` returns the prompt, TRL's `train_dataset=None`): `data.batch_size` rows of an empty
    prompt, each episode's `reset` filling it in."""
    files = getattr(section, f"{role}_files")
    if not files:
        if not env_owns_data:
            raise TrainerError(f"data.{role}_files is empty: name the data, or an environment that makes its own tasks "
                               "(a TRL environment_factory class whose reset returns the prompt)")  # fmt: skip
        rows = [Row(f"data.{role}_files=[] (the environment's reset gives the prompt) row {i}",
                    {"prompt": list(PLACEHOLDER)}) for i in range(1, section.batch_size + 1)]  # fmt: skip
    else:
        rows = read_rows(files, default_file=f"{role}.jsonl", split=getattr(section, f"{role}_split"),
                         config=section.dataset_config, key=f"data.{role}_files")  # fmt: skip
    examples, dropped = build_examples(rows, tokenizer, prompt_key=section.prompt_key, answer_key=section.answer_key,
                                       max_prompt_tokens=section.max_prompt_tokens, chat_template=section.chat_template,
                                       system_prompt=section.system_prompt,
                                       default_prompt=list(PLACEHOLDER) if env_owns_data else None)  # fmt: skip
    if not examples:
        raise TrainerError(f"no usable prompts in {files}: {len(rows)} rows, {dropped} longer than "
                           f"data.max_prompt_tokens={section.max_prompt_tokens}")  # fmt: skip
    return examples, dropped


class PromptSampler:
    """Batches of example indices: a seeded permutation per epoch, walked in order (batches may span epochs)."""

    def __init__(self, size: int, batch_size: int, seed: int):
        if size == 0:
            raise TrainerError("the training dataset is empty (after dropping prompts that are too long)")
        if batch_size > size:
            raise TrainerError(f"data.batch_size={batch_size} is larger than the {size} training prompts: every step "
                               f"would draw the same prompts several times; use data.batch_size <= {size}")  # fmt: skip
        self.size, self.batch_size, self.seed = size, batch_size, seed
        self.epoch, self.position = 0, 0
        self._order = self._permutation(0)

    def _permutation(self, epoch: int) -> list[int]:
        import torch  # here: an environment's worker process (env.processes) imports this module, not torch

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
