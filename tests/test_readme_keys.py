"""What the READMEs say about configuration keys holds, as test_readme_commands.py holds their commands: every key
they name is one the trainer takes (or an old one it still moves), the keys they call old are old, and a default
they state beside a key, "`key` (N", is the key's default."""

import dataclasses
import re
from pathlib import Path

from lorarl.trainer.config import MOVED, config_class
from lorarl.trainer.schema import leaves

ROOT = Path(__file__).resolve().parents[1]
READMES = [ROOT / "README.md", *sorted(ROOT.glob("packages/*/README.md"))]
SCHEMA = config_class()
SECTIONS = {f.name for f in dataclasses.fields(SCHEMA)}
DEFAULTS = {key: field.default_factory() if field.default_factory is not dataclasses.MISSING else field.default
            for key, field in leaves(SCHEMA)}  # fmt: skip
NAMED = re.compile(r"`([a-z_]+(?:\.[a-z_0-9]+)+)(?:=[^`]*)?`")  # `section.key`, `section.key=value`
STATED = re.compile(r"`([a-z_]+(?:\.[a-z_0-9]+)+)` \(([0-9][0-9.]*)(?: s)?[,;)]")  # `section.key` (default
OLD = re.compile(r"Old flat keys \(([^)]*)\)")


def claims(pattern: re.Pattern) -> list[tuple[str, re.Match]]:
    return [(f"{readme.relative_to(ROOT)}:{readme.read_text()[: m.start()].count(chr(10)) + 1}", m)
            for readme in READMES for m in pattern.finditer(readme.read_text())]  # fmt: skip


def known(key: str) -> bool:
    """A key the trainer takes, an old one it moves, a section of keys, or a field of a mapping-valued key."""
    return (key in DEFAULTS or key in MOVED or any(k.startswith(key + ".") for k in DEFAULTS)
            or any(key.startswith(k + ".") and isinstance(v, dict) for k, v in DEFAULTS.items()))  # fmt: skip


def test_every_key_a_readme_names_is_one_the_trainer_takes():
    named = [(where, m[1]) for where, m in claims(NAMED)
             if m[1].split(".")[0] in SECTIONS and not m[1].endswith((".py", ".yaml", ".md"))]  # fmt: skip
    assert len(named) > 100  # they were found
    assert [f"{where}: {key}" for where, key in named if not known(key)] == []


def test_the_keys_a_readme_calls_old_are_old_and_the_defaults_it_states_are_the_defaults():
    old = [(where, key) for where, m in claims(OLD) for key in re.findall(r"`([\w.]+)`", m[1])]
    assert old
    for where, key in old:
        assert key in MOVED, f"{where}: {key} is called an old key, but it is a current one" if key in DEFAULTS else key
    stated = [(where, m[1], m[2]) for where, m in claims(STATED) if m[1] in DEFAULTS]
    assert stated
    for where, key, value in stated:
        assert float(value) == DEFAULTS[key], f"{where}: {key} ({value}): its default is {DEFAULTS[key]}"
