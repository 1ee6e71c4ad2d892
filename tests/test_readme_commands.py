"""Every command the READMEs give is checked, so that a wrong one fails CI instead of a new user: install commands
name extras, groups and packages that exist; `trainer` commands parse — their configuration loads, with the files
the README itself defines (`# my_tools.py` blocks) beside them, and `serve`, `eval` and `export` take their options;
scripts and benchmarks exist and take the options given. A command of a form this test does not know fails it, as
does one it knows but whose pieces are wrong. What needs a GPU, the network or another project's environment is
named in `ELSEWHERE`, with where it is checked instead."""

import os
import re
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
READMES = [ROOT / "README.md", *sorted(ROOT.glob("packages/*/README.md"))]
# commands run elsewhere, or by other tools: (a pattern, why not here)
ELSEWHERE = [
    (r"^ray start", "Ray's own command (tests/test_ray_backend starts Ray itself)"),
    (r"\.venv-cookbook/", "the Tinker cookbook in its own environment: tests/test_cookbook.py runs its math_rl"),
    (r"^python -c import verifiers", "a user's verifiers environment, exported"),
    (r"^\.venv-verifiers-v1/bin/python -c import json, verifiers", "a user's v1 taskset, exported"),
    (r"^uv run (pytest|ruff check)", "CI's own commands (.ci/run)"),
    (r"^\.\.\. \|", "a pipe from a benchmark's output (its script is checked where it is given alone)"),
    (r"torchrun --nnodes", "several nodes (tests/test_data_parallel runs torchrun on one)"),
]
PLACEHOLDERS = re.compile(r"\b(DIR|OUT|HEAD|TRAINER0)\b")  # the reader's own values: any will do
TEMPLATE = re.compile(r"<[a-z_ ]+>")  # `algorithm=<name>`: a pattern, not a command
VLLM_ENV = ROOT / ".venv-vllm-cpu" / "bin" / "python"
DEFINED = r"```(?:python|yaml)\n(# ([\w.-]+\.(?:py|yaml))\b.*?)```"
LOAD = "import sys; from lorarl.trainer.config import load_config; load_config(sys.argv[1] or None, sys.argv[2:])"


def commands() -> list[tuple[str, int, str, dict[str, str]]]:
    """`(readme, line, command, files)`: each command of each README's shell blocks (continued lines joined, comments
    cut) and inline code, with the files the READMEs define (a code block whose first line is `# name.py` or
    `# name.yaml`): the README's own last one above the command, else any README's first."""
    defined: dict[str, str] = {}
    for readme in READMES:
        for body, name in re.findall(DEFINED, readme.read_text(), re.S):
            defined.setdefault(name, body)
    found = []
    for readme in READMES:
        files: dict[str, str] = dict(defined)
        text = readme.read_text()
        for match in re.finditer(r"```(\w*)\n(.*?)```|`([^`\n]+)`", text, re.S):
            line = text[: match.start()].count("\n") + 1
            kind, body, inline = match.groups()
            if inline is not None:
                if re.match(r"(uv|pip|python3?|trainer|scripts/\S+\.sh)\s", inline):
                    found.append((str(readme.relative_to(ROOT)), line, inline, dict(files)))
                continue
            header = re.match(r"# ([\w.-]+\.(?:py|yaml))\b", body)
            if kind in ("python", "yaml") and header:
                files[header[1]] = body
            if kind in ("bash", "sh", "shell"):
                for command in re.sub(r"\\\n\s*", " ", body).splitlines():
                    command = re.split(r"\s+#\s", command)[0].strip()
                    if command and not command.startswith("#"):
                        found.append((str(readme.relative_to(ROOT)), line, command, dict(files)))
    return found


def pyproject(path: Path) -> dict:
    return tomllib.loads(path.read_text())


ROOT_PROJECT = pyproject(ROOT / "pyproject.toml")
TRAINER_PROJECT = pyproject(ROOT / "packages/trainer/pyproject.toml")
LOCKED = {p["name"]: p["version"] for p in tomllib.loads((ROOT / "uv.lock").read_text())["package"] if "version" in p}


def check_uv(words: list[str], files: dict, tmp_path: Path) -> None:
    """`uv sync [--locked] [--extra X] [--group G]`, `uv run [--group G] CMD`, `uv pip install SPEC`."""
    verb, *rest = words
    if verb == "pip":
        return check_pip(rest[1:])
    groups, extras = ROOT_PROJECT["dependency-groups"], ROOT_PROJECT["project"]["optional-dependencies"]
    while rest and rest[0].startswith("--"):
        option = rest.pop(0)
        if option in ("--group", "--extra"):
            name = rest.pop(0)
            assert name in (groups if option == "--group" else extras), f"uv {verb} {option} {name}: no such {option}"
        else:
            assert option in ("--locked", "--no-sync", "--compile-bytecode"), f"uv {verb} {option}: not checked here"
    assert verb in ("sync", "run"), f"uv {verb}: not checked here"
    if verb == "run" and rest:
        check(rest, files, tmp_path)


def check_pip(specs: list[str]) -> None:
    for spec in specs:
        spec = spec.strip("'\"")
        if spec.startswith("./"):
            assert (ROOT / spec / "pyproject.toml").is_file(), f"pip install {spec}: not a package of this workspace"
            continue
        name, extras, version = re.fullmatch(r"([\w-]+)(?:\[([\w,-]+)\])?(?:==(\S+))?", spec).groups()
        if name == "lorarl-trainer":
            missing = set((extras or "").split(",")) - set(TRAINER_PROJECT["project"]["optional-dependencies"]) - {""}
            assert not missing, f"pip install {spec}: lorarl-trainer has no extra {missing}"
        else:
            assert LOCKED.get(name) == version, f"pip install {spec}: the lock has {name} {LOCKED.get(name)}"


def check_trainer(args: list[str], files: dict, tmp_path: Path) -> None:
    """A `trainer` command's arguments: a subcommand's options, or the configuration they make."""
    from lorarl.trainer.cli import eval_arguments, export_arguments
    from lorarl.trainer.config import load_config
    from lorarl.trainer.presets import PRESETS
    from lorarl.trainer.serve.server import arguments as serve_arguments

    args = [PLACEHOLDERS.sub("x", a) for a in args if a != "..."]
    parsers = {"serve": serve_arguments, "eval": eval_arguments, "export": export_arguments}
    if args and args[0] in parsers:
        parser = parsers[args[0]]()
        if args[0] == "eval":
            _, overrides = parser.parse_known_args(args[1:] or ["--checkpoint", "x"])
            load_config(None, overrides, presets=PRESETS)
        elif args[0] == "export" and len(args) == 1:
            return
        else:
            parser.parse_args(args[1:])
        return
    if args and args[0] == "--help":
        args = args[1:]
    for name, body in files.items():
        (tmp_path / name).write_text(body)
    config = [a for a in args if a.endswith(".yaml")]
    overrides = [a for a in args if "=" in a and not a.endswith(".yaml")]
    assert len(config) + len(overrides) == len(args), f"trainer {' '.join(args)}: arguments that are neither"
    path = config[0] if config else None
    if path is not None and not (tmp_path / path).is_file():
        assert (ROOT / path).is_file(), f"trainer {path}: the READMEs define no such file, nor does the repository"
        os.chdir(ROOT)  # a file of the repository, and the paths it holds, from the repository's root
    if "rollout.engine=vllm" in overrides:  # read where it runs: in vLLM's environment (scripts/vllm_cpu_env.sh)
        done = subprocess.run([str(VLLM_ENV), "-c", LOAD, str(path or ""), *overrides], capture_output=True, text=True,
                              timeout=300)  # fmt: skip
        assert done.returncode == 0, done.stderr[-2000:]
        return
    load_config(path, overrides, presets=PRESETS)


def check_script(script: str, args: list[str]) -> None:
    """A script or benchmark of this repository, and the options given (each in its `--help`)."""
    path = ROOT / script
    assert path.is_file(), f"{script}: no such file"
    options = [a.split("=")[0] for a in args if a.startswith("--")]
    if path.suffix == ".sh":
        text = path.read_text()
        missing = [o for o in options if o not in text]
    else:
        help_text = subprocess.run([sys.executable, str(path), "--help"], capture_output=True, text=True,
                                   timeout=120).stdout  # fmt: skip
        missing = [o for o in options if o not in help_text]
        subcommands = [a for a in args[:1] if not a.startswith("-")]
        missing += [s for s in subcommands if s not in help_text]
    assert not missing, f"{script}: takes no {missing}"


def check(words: list[str], files: dict, tmp_path: Path) -> None:
    while words and re.fullmatch(r"[A-Z_]+=\S*", words[0]):  # VAR=value before the command
        words = words[1:]
    if any(re.search(pattern, " ".join(words)) for pattern, _ in ELSEWHERE):
        return
    head, *rest = words
    if head == "uv":
        return check_uv(rest, files, tmp_path)
    if head == "pip":
        return check_pip(rest[1:])
    if head in ("trainer", ".venv-vllm-cpu/bin/trainer", ".venv-verifiers-v1/bin/trainer"):
        return check_trainer(rest, files, tmp_path)
    if head in ("python", "python3", ".venv-vllm-cpu/bin/python", "torchrun") and "-m" in rest:
        module = rest[rest.index("-m") + 1]
        assert module == "lorarl.trainer.cli", f"{module}: not checked here"
        return check_trainer(rest[rest.index("-m") + 2 :], files, tmp_path)
    if head in ("python", "python3", ".venv-vllm-cpu/bin/python"):
        return check_script(rest[0], rest[1:])
    if head.startswith(("scripts/", "packages/", "benchmarks/")):
        return check_script(head, rest)
    pytest.fail(f"a command of a form this test does not check: {' '.join(words)}")


COMMANDS = commands()


@pytest.mark.parametrize(("readme", "line", "command", "files"), COMMANDS,
                         ids=[f"{r}:{n}" for r, n, _, _ in COMMANDS])  # fmt: skip
def test_a_readme_command_is_right(readme, line, command, files, tmp_path, monkeypatch):
    if TEMPLATE.search(command):
        return
    monkeypatch.chdir(tmp_path)  # the files the README defines are where the command reads them
    command = re.sub(r" \[[^\]]*\]", "", command)  # optional arguments: `[--n 8]`
    for part in command.split("&&"):
        check(shlex.split(part), files, tmp_path)


def test_the_readmes_hold_commands():
    assert len(COMMANDS) > 50  # the parsing found them (a broken pattern would find none, and check nothing)
