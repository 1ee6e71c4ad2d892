"""Models and datasets by Hub id, through a Hugging Face cache made here (no network): the default-sized model and
its task, cached as `tiny-org/adder` and the dataset `tiny-org/sums` (subset `main`, parquet files as the Hub
converts datasets), train by name with `HF_HUB_OFFLINE=1` and online with the Hub unreachable; with nothing cached,
one line names the id and how to fetch it; a split the dataset lacks is named with where it was looked for."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from huggingface_hub import constants

from lorarl.trainer import default_task
from lorarl.trainer.errors import TrainerError
from lorarl.trainer.hub import dataset_files, is_hub_id
from lorarl.weight_sync import free_port

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def cache_repo(cache: Path, repo_id: str, files: dict[str, Path], repo_type: str = "model") -> Path:
    """`files` (name in the repository -> a file here) as the Hugging Face cache holds a downloaded snapshot."""
    folder = cache / f"{repo_type}s--{repo_id.replace('/', '--')}"
    snapshot = folder / "snapshots" / COMMIT
    for name, source in files.items():
        (snapshot / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source, snapshot / name)
    (folder / "refs").mkdir(parents=True, exist_ok=True)
    (folder / "refs" / "main").write_text(COMMIT)
    return snapshot


def as_parquet(jsonl: Path, out: Path) -> Path:
    rows = [json.loads(line) for line in jsonl.read_text().splitlines() if line.strip()]
    pq.write_table(pa.Table.from_pylist(rows), out)
    return out


@pytest.fixture(scope="module")
def hub_cache(tmp_path_factory) -> Path:
    cache = tmp_path_factory.mktemp("hf-cache")
    model_files = {p.name: p for p in default_task.MODEL_DIR.iterdir() if p.suffix in (".json", ".safetensors")}
    cache_repo(cache, "tiny-org/adder", model_files)
    parts = tmp_path_factory.mktemp("parts")
    data = {f"main/{split}-00000-of-00001.parquet": as_parquet(default_task.MODEL_DIR / f"{name}.jsonl",
                                                               parts / f"{split}.parquet")
            for split, name in (("train", "train"), ("test", "val"))}  # fmt: skip
    cache_repo(cache, "tiny-org/sums", data, repo_type="dataset")
    return cache


def run_trainer(cache: Path, out: Path, *overrides: str, offline: bool) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")} | {"HF_HUB_CACHE": str(cache)}
    env |= {"HF_HUB_OFFLINE": "1"} if offline else {"HF_ENDPOINT": f"http://127.0.0.1:{free_port()}"}  # unreachable
    command = [sys.executable, "-m", "lorarl.trainer.cli", *overrides, "trainer.steps=2", "trainer.eval_every=2",
               "data.val_size=20", f"trainer.output_dir={out}"]  # fmt: skip
    return subprocess.run(command, capture_output=True, text=True, timeout=600, env=env)


@pytest.mark.parametrize("offline", [True, False])
def test_a_hub_model_and_a_hub_dataset_train_from_the_cache(hub_cache, tmp_path, offline):
    done = run_trainer(hub_cache, tmp_path / "out", "model.path=tiny-org/adder", "data.train_files=tiny-org/sums",
                       "data.val_files=[tiny-org/sums]", "data.dataset_config=main", offline=offline)  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["step"] > 0] == [1, 2]
    accuracy = [r["val/accuracy"] for r in records if "val/accuracy" in r]
    assert len(accuracy) == 2  # the Hub dataset's test split validated, at the start and the end
    assert 0 < accuracy[0] < 1  # the cached model, imperfect at its task
    assert "model:\n  path: tiny-org/adder" in (tmp_path / "out" / "config.yaml").read_text()  # resumes by id


def test_nothing_cached_offline_names_the_id_and_how_to_fetch_it(tmp_path):
    done = run_trainer(tmp_path / "empty-cache", tmp_path / "out", "model.path=tiny-org/nowhere", offline=True)
    assert done.returncode != 0
    message = done.stdout + done.stderr
    assert "model.path='tiny-org/nowhere': nothing of that name on disk, not in the Hugging Face cache" in message
    assert "HF_HUB_OFFLINE=1" in message
    assert "`hf download tiny-org/nowhere`" in message
    assert "Traceback" not in message


def test_a_split_or_subset_the_dataset_lacks_is_named(hub_cache, monkeypatch):
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(hub_cache))
    assert [p.name for p in dataset_files("tiny-org/sums", "data.val_files", config="main", split="test")] == [
        "test-00000-of-00001.parquet"]  # fmt: skip
    lacks = r"data.val_files: dataset 'tiny-org/sums' has no files of split 'validation' in subset 'main'; looked for "
    with pytest.raises(TrainerError, match=lacks + r"main/validation-\*"):
        dataset_files("tiny-org/sums", "data.val_files", config="main", split="validation")
    with pytest.raises(TrainerError, match=r"set data\.dataset_config to the subset"):
        dataset_files("tiny-org/sums", "data.train_files", config=None, split="train")


def test_a_name_on_disk_is_a_path_not_an_id(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert is_hub_id("org/data")
    (tmp_path / "org" / "data").mkdir(parents=True)
    assert not is_hub_id("org/data")
    assert not is_hub_id("data/train.jsonl/x")
    assert not is_hub_id("train.jsonl")
    assert not is_hub_id("data/train.jsonl")  # a missing file is reported as one, not looked up on the Hub
