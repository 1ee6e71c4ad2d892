"""Configuration: the schema's defaults (`schema.py`), a preset, a YAML file, dotted overrides — loaded and checked.

    uv run trainer                                   # the embedded default
    uv run trainer my.yaml model.lora.rank=32        # a file, then overrides; later wins
    uv run trainer --help                            # every key, its type, default and meaning

Unknown keys and wrong types are rejected naming the key and the closest valid key. Presets (`presets.py`) are selected
with `algorithm=<name>` (or `algorithm: <name>` in the file), shipped tasks (`tasks/<name>.yaml`, below everything
else) with `task=<name>`, the environment with `env=<name>` (short for `env.name`).
"""

import difflib
import functools
import textwrap
import types
import typing
import warnings
from dataclasses import MISSING, field, fields, make_dataclass
from pathlib import Path

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, ValidationError

from lorarl.trainer import validation
from lorarl.trainer.errors import ConfigError
from lorarl.trainer.pieces import pluggable
from lorarl.trainer.registry import choices_of
from lorarl.trainer.schema import Config, leaves

# keys that moved under the piece they belong to: an old key still works (with a warning naming the new one)
MOVED = {
    "algorithm.norm_std": ("algorithm.grpo.norm_std", "algorithm.grpo_passk.norm_std"),
    "algorithm.gamma": ("algorithm.gae.gamma", "algorithm.reinforce_pp.gamma"),
    "algorithm.lam": ("algorithm.gae.lam",),
    "algorithm.clip_cov_ratio": ("algorithm.clip_cov.ratio",),
    "algorithm.clip_cov_lb": ("algorithm.clip_cov.lb",),
    "algorithm.clip_cov_ub": ("algorithm.clip_cov.ub",),
    "algorithm.kl_cov_ratio": ("algorithm.kl_cov.ratio",),
    "algorithm.kl_cov_coef": ("algorithm.kl_cov.coef",),
    "algorithm.sapo_tau_pos": ("algorithm.sapo.tau_pos",),
    "algorithm.sapo_tau_neg": ("algorithm.sapo.tau_neg",),
    "rollout.batch_size": ("rollout.hf.batch_size",),
    **{f"rollout.{key}": (f"rollout.vllm.{key}",) for key in ("tensor_parallel_size", "gpu_memory_utilization",
                                                              "max_model_len", "kv_cache_gb", "enforce_eager",
                                                              "devices")},
}  # fmt: skip


def load_config(path: str | Path | None = None, overrides: list[str] = (), presets: dict | None = None) -> Config:
    """The schema's defaults, then a preset (`algorithm=<name>`: on the command line, else `algorithm: <name>` in the
    file), then the YAML file, then `key=value` overrides. Plugins named by import path are loaded first, so that
    their settings are keys."""
    layers = _layers(path, overrides, presets)
    _merged(Config, [_without_pieces(layer) for layer in layers])  # the fixed keys first: no registry, no torch yet
    schema = config_class(layers)
    config = OmegaConf.to_object(_merged(schema, layers))
    validation.check(config, schema)
    return config


def _merged(schema: type, layers: list):
    """`layers` merged onto `schema`'s defaults; an unknown key or a wrong type raises naming the key."""
    try:
        return OmegaConf.merge(OmegaConf.structured(schema), *layers)
    except (ConfigKeyError, ConfigAttributeError) as e:
        key = _full_key(e)
        raise ConfigError(f"unknown key {key!r}{_closest(key, schema)}") from None
    except ValidationError as e:
        key = _full_key(e)
        raise ConfigError(f"{key}: {e.msg.splitlines()[0]} (expected {_type_name(_field_type(key, schema))})") from None


def _without_pieces(layer):
    """`layer` without what may be a piece's settings (a mapping under a name the fixed schema lacks)."""
    fixed = {f.name: {g.name for g in fields(f.type)} for f in fields(Config)}
    plain = OmegaConf.to_container(layer)
    for section, keys in plain.items():
        if section in fixed and isinstance(keys, dict):
            plain[section] = {k: v for k, v in keys.items() if k in fixed[section] or not isinstance(v, dict)}
    return OmegaConf.create(plain)


def _layers(path: str | Path | None, overrides: list[str], presets: dict | None) -> list:
    """The configuration's layers in order (presets, file, overrides), old keys moved."""
    loaded = _read_yaml(path) if path is not None else {}
    overrides = [f"env.name={o.split('=', 1)[1]}" if o.split("=", 1)[0] == "env" else o for o in overrides]
    if isinstance(loaded.get("env"), str):  # env: <name>
        loaded["env"] = {"name": loaded["env"]}
    tasks = [o.split("=", 1)[1] for o in overrides if o.split("=", 1)[0] == "task"]
    if isinstance(loaded.get("task"), str):
        tasks.insert(0, loaded.pop("task"))
    chosen = [o.split("=", 1)[1] for o in overrides if o.split("=", 1)[0] == "algorithm"]
    overrides = [o for o in overrides if o.split("=", 1)[0] not in ("algorithm", "task")]
    if isinstance(loaded.get("algorithm"), str):
        chosen.insert(0, loaded.pop("algorithm"))
    layers = [_listed(_read_yaml(_task_file(name))) for name in tasks]
    layers += [_preset_layer(name, presets) for name in chosen]
    layers.append(_listed(_moved(loaded, f"in {path}")))
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"{item!r}: overrides are key=value (e.g. model.lora.rank=32)")
        key, value = item.split("=", 1)
        layer = OmegaConf.to_container(OmegaConf.from_dotlist([f"{key}={value}"]))
        layers.append(_listed(_moved(layer, "on the command line")))
    return [OmegaConf.create(layer) for layer in layers]


def _takes_a_list(tp) -> bool:
    return typing.get_origin(tp) is list or any(typing.get_origin(t) is list for t in typing.get_args(tp))


LIST_KEYS = [key for key, f in leaves(Config) if _takes_a_list(f.type)]


def _listed(layer: dict) -> dict:
    """`layer` with a single value given where the schema takes a list as that list of one
    (`data.train_files=data/train.jsonl`, `target_modules: q_proj`)."""
    for key in LIST_KEYS:
        *sections, name = key.split(".")
        node = layer
        for section in sections:
            node = node.get(section) if isinstance(node, dict) else None
        if isinstance(node, dict) and isinstance(node.get(name), str | int | float):
            node[name] = [node[name]]
    return layer


def _moved(layer: dict, where: str) -> dict:
    """`layer` with the keys of `MOVED` under their new names."""
    for old, new in MOVED.items():
        section, key = old.split(".")
        if not isinstance(layer.get(section), dict) or key not in layer[section]:
            continue
        value = layer[section].pop(key)
        warnings.warn(f"{old} {where} is now {' and '.join(new)}", FutureWarning, stacklevel=4)
        for target in new:
            _, piece, name = target.split(".")
            layer[section].setdefault(piece, {})[name] = value
    return layer


def config_class(layers: list = ()) -> type[Config]:
    """The schema: `Config`, each section holding the settings of every registered piece that has any under the
    piece's name — after loading the plugins that `layers` name by import path."""
    chosen = OmegaConf.merge(*layers) if layers else OmegaConf.create()
    sections: dict[str, list] = {}
    for key, registry in pluggable().items():
        section = key.split(".")[0]
        value = OmegaConf.select(chosen, key, default=None)
        for spec in value if OmegaConf.is_list(value) else [value]:
            if isinstance(spec, str) and ":" in spec:
                validation.load_plugin(key, spec, registry)
        pieces = sections.setdefault(section, [])
        pieces.extend(entry for entry in registry.entries() if entry not in pieces)  # reward.fn and .fns share one
    return _derived(tuple((section, tuple(entries)) for section, entries in sections.items()))


@functools.cache
def _derived(sections: tuple) -> type[Config]:
    """The `Config` subclass for these registered pieces (one class per set, so that configs compare equal)."""
    extended = {}
    for section, entries in sections:
        base = next(f.type for f in fields(Config) if f.name == section)
        taken = {f.name: "a key of the section" for f in fields(base)}
        extra = []
        for entry in entries:
            if entry.settings is None:
                continue
            if entry.name in taken:
                raise ConfigError(f"{section}.{entry.name}: the settings of {entry.name!r} would replace "
                                  f"{taken[entry.name]}; register it under another name")  # fmt: skip
            taken[entry.name] = f"the settings of another piece named {entry.name!r}"
            extra.append((entry.name, entry.settings, field(default_factory=entry.settings, metadata={"of": entry})))
        extended[section] = make_dataclass(base.__name__, extra, bases=(base,))
    return make_dataclass("Config", [(name, cls, field(default_factory=cls)) for name, cls in extended.items()],
                          bases=(Config,))  # fmt: skip


def _read_yaml(path: str | Path) -> dict:
    try:
        loaded = yaml.safe_load(Path(path).read_text()) or {}
    except FileNotFoundError:
        if "." in str(path) and not str(path).endswith((".yaml", ".yml")) and "/" not in str(path):
            raise ConfigError(f"{path!r}: neither a config file nor key=value; an override needs a value (e.g. "
                              f"{path}=...)") from None  # fmt: skip
        raise ConfigError(f"config file {path} not found") from None
    except IsADirectoryError:
        raise ConfigError(f"config file {path} is a directory") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {path} is not valid YAML: {e}") from None
    if not isinstance(loaded, dict):
        raise ConfigError(f"config file {path} must hold a mapping of sections")
    return loaded


TASKS_DIR = Path(__file__).resolve().parent / "tasks"


def task_names() -> list[str]:
    """The shipped tasks (`task=<name>`)."""
    return sorted(p.stem for p in TASKS_DIR.glob("*.yaml"))


def _task_file(name: str) -> Path:
    """`task=<name>`: a shipped task's settings (`tasks/<name>.yaml`), the first layer of the configuration."""
    path = TASKS_DIR / f"{name}.yaml"
    if not path.is_file():
        names = task_names()
        raise ConfigError(f"task={name}: unknown task; choose one of {names}")
    return path


def _preset_layer(name: str, presets: dict | None):
    if not presets or name not in presets:
        raise ConfigError(f"algorithm={name}: unknown preset; choose one of {sorted(presets or {})}")
    return OmegaConf.create({"algorithm": {"name": name, **presets[name].settings}})


def to_yaml(config: Config) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(config))


def help_text(path: str | Path | None = None, overrides: list[str] = (), presets: dict | None = None) -> str:
    """Every key with its type, default and meaning — the settings of every registered piece with it, and of the
    plugins the configuration (`path`, `overrides`) names by import path."""
    schema = config_class(_layers(path, overrides, presets))
    lines = ["Configuration keys (set in a YAML file or as key=value; later wins):", ""]
    for key, f in leaves(schema):
        default = f.default_factory() if f.default is MISSING else f.default
        choices, low, high = choices_of(f), f.metadata.get("minimum"), f.metadata.get("maximum")
        meaning = f.metadata.get("help", "") + (f" [{' | '.join(map(str, choices))}]" if choices else "")
        if low is not None or high is not None:
            meaning += f" [{'' if low is None else low}..{'' if high is None else high}]"
        lines += _wrapped(f"  {key:32} {_type_name(f.type):16} {default!r:18} ", meaning)
    for key, registry in pluggable().items():
        if key != "reward.fns":
            lines += ["", f"{key}: the registered choices"]
            for name, meaning in [*((e.name, e.summary) for e in registry.entries()), *registry.keywords.items()]:
                lines += _wrapped(f"  {name:24} ", meaning)
    return "\n".join(lines)


HELP_WIDTH = 120


def _wrapped(head: str, text: str) -> list[str]:
    """`head` then `text` wrapped to `HELP_WIDTH` columns, its lines under the first (or, after a long head, on
    lines of their own)."""
    indent = len(head) if len(head) <= 72 else 6
    wrapped = textwrap.wrap(text, HELP_WIDTH - indent) or [""]
    if indent == len(head):
        return [head + wrapped[0], *(" " * indent + line for line in wrapped[1:])]
    heads = textwrap.wrap(head, HELP_WIDTH, subsequent_indent=" " * indent)
    return [*heads, *(" " * indent + line for line in wrapped)]


def _valid_keys(schema: type) -> list[str]:
    keys = [key for key, _ in leaves(schema)]
    return keys + sorted({key.rsplit(".", 1)[0] for key in keys if "." in key})


def _closest(key: str, schema: type) -> str:
    moved = [new for old, new in MOVED.items() if key == old]
    if moved:
        return f"; it is now {' and '.join(moved[0])}"
    close = difflib.get_close_matches(key, _valid_keys(schema), n=1, cutoff=0.5)
    if not close:
        last = key.rsplit(".", 1)[-1]
        close = [k for k in _valid_keys(schema) if k.endswith("." + last)][:1]
    return f"; did you mean {close[0]!r}?" if close else ""


def _full_key(error: Exception) -> str:
    key = getattr(error, "full_key", None) or getattr(error, "key", None) or str(error)
    return str(key)


def _field_type(key: str, schema: type):
    for name, f in leaves(schema):
        if name == key:
            return f.type
    return None


def _type_name(tp) -> str:
    if tp is None:
        return "a valid value"
    origin = typing.get_origin(tp)
    if origin in (list,):
        return f"list[{_type_name(typing.get_args(tp)[0])}]"
    if origin in (typing.Union, types.UnionType):
        return " | ".join(_type_name(a) for a in typing.get_args(tp))
    if tp is type(None):
        return "None"
    return getattr(tp, "__name__", str(tp))
