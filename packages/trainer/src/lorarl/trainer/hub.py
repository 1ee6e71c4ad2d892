"""Models and datasets named by their Hugging Face Hub id (`Qwen/Qwen2.5-0.5B-Instruct`, `openai/gsm8k`), resolved to
local files through huggingface_hub's cache (`HF_HOME`, `HF_HUB_CACHE`): downloaded once, read from the cache after,
and from the cache alone with `HF_HUB_OFFLINE=1` or when the Hub cannot be reached. The trainer and every engine then
load the same resolved directory. A name that exists on disk is a path, never an id."""

import re
from pathlib import Path

from lorarl.trainer.errors import TrainerError

HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
MODEL_FILES = ["*.json", "*.safetensors", "*.model", "*.txt", "*.tiktoken", "*.jinja"]  # config, weights, tokenizer
DATA_SUFFIXES = (".parquet", ".jsonl", ".json", ".csv")


def is_hub_id(name: str) -> bool:
    """`org/name`, not a file's name (`data/train.jsonl` is a path, found or not), and nothing of that name on disk."""
    path = Path(name)
    return bool(HUB_ID.fullmatch(name)) and path.suffix not in (*DATA_SUFFIXES, ".gguf") and not path.exists()


def model_dir(repo_id: str, *, revision: str | None = None, extra: tuple[str, ...] = ()) -> Path:
    """The snapshot of model `repo_id`: its config, tokenizer and safetensors weights (its `.bin` weights where it has
    no safetensors), and the `extra` files (a GGUF checkpoint)."""
    directory = _snapshot(repo_id, "model.path", revision=revision, allow_patterns=[*MODEL_FILES, *extra])
    if not (directory / "config.json").is_file() and not extra:
        raise TrainerError(f"model.path={repo_id!r}: the Hub repository has no config.json (not a transformers model)")
    if not extra and not any(directory.glob("*.safetensors")):
        directory = _snapshot(repo_id, "model.path", revision=revision, allow_patterns=[*MODEL_FILES, "*.bin"])
    return directory


def dataset_files(repo_id: str, key: str, *, config: str | None, split: str) -> list[Path]:
    """The files of split `split` (of `config`) of dataset `repo_id`, in the layouts the Hub's datasets use:
    `<config>/<split>-*.parquet` (e.g. openai/gsm8k's `main/train-00000-of-00001.parquet`), `data/<split>-*`,
    `<split>-*` or `<split>.<ext>`, as parquet, JSON lines, JSON or CSV."""
    folders = [f"{config}/", f"{config}/data/"] if config else ["data/", ""]
    patterns = [f"{folder}{split}{tail}" for folder in folders for tail in ("-*", ".*", "/*")]
    directory = _snapshot(repo_id, key, repo_type="dataset", allow_patterns=patterns)
    found = sorted(path for pattern in patterns for path in directory.glob(pattern)
                   if path.is_file() and path.suffix in DATA_SUFFIXES)  # fmt: skip
    if not found:
        named = "" if config else " (set data.dataset_config to the subset, e.g. main for openai/gsm8k)"
        raise TrainerError(f"{key}: dataset {repo_id!r} has no files of split {split!r}"
                           f"{f' in subset {config!r}' if config else ''}{named}; looked for "
                           f"{', '.join(patterns)}")  # fmt: skip
    return list(dict.fromkeys(found))


def _snapshot(repo_id: str, key: str, *, repo_type: str = "model", revision: str | None = None,
              allow_patterns: list[str]) -> Path:  # fmt: skip
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    what = f"{key}={repo_id!r}"
    try:
        return Path(snapshot_download(repo_id, repo_type=repo_type, revision=revision, allow_patterns=allow_patterns))
    except LocalEntryNotFoundError:
        why = "HF_HUB_OFFLINE=1" if constants.HF_HUB_OFFLINE else "the Hub could not be reached"
        fetch = f"hf download {repo_id}" + (" --repo-type dataset" if repo_type == "dataset" else "") + (
            f" --revision {revision}" if revision else "")  # fmt: skip
        raise TrainerError(
            f"{what}: nothing of that name on disk, not in the Hugging Face cache ({constants.HF_HUB_CACHE}) and "
            f"{why}: fetch it first where the Hub is reachable (`{fetch}`), or name a local path"
        ) from None
    except GatedRepoError:
        raise TrainerError(f"{what}: a gated repository: accept its terms on the Hub and log in (`hf auth login`) "
                           "or set HF_TOKEN") from None  # fmt: skip
    except RepositoryNotFoundError:
        raise TrainerError(
            f"{what}: no such {repo_type} on the Hub (or a private one: log in, or set HF_TOKEN)"
        ) from None
    except RevisionNotFoundError:
        raise TrainerError(f"{what}: the Hub repository has no revision {revision!r} (model.revision)") from None
