"""Configuration: the schema's defaults (`schema.py`), a preset, a YAML file, dotted overrides — loaded and checked.

    uv run trainer                                   # the embedded default
    uv run trainer my.yaml model.lora.rank=32        # a file, then overrides; later wins
    uv run trainer --help                            # every key, its type, default and meaning

Unknown keys and wrong types are rejected naming the key and the closest valid key. Presets (`presets.py`) are selected
with `algorithm=<name>` (or `algorithm: <name>` in the file).
"""

import difflib
import types
import typing
from dataclasses import MISSING, fields, is_dataclass
from pathlib import Path

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, ValidationError

from lorarl.trainer.schema import Config


class ConfigError(ValueError):
    """A configuration the trainer cannot run: names the key, says what is expected."""


def load_config(path: str | Path | None = None, overrides: list[str] = (), presets: dict | None = None) -> Config:
    """The schema's defaults, then a preset (`algorithm=<name>`: on the command line, else `algorithm: <name>` in the
    file), then the YAML file, then `key=value` overrides."""
    schema = OmegaConf.structured(Config)
    loaded = _read_yaml(path) if path is not None else {}
    overrides = list(overrides)
    chosen = [o.split("=", 1)[1] for o in overrides if o.split("=", 1)[0] == "algorithm"]
    overrides = [o for o in overrides if o.split("=", 1)[0] != "algorithm"]
    if isinstance(loaded.get("algorithm"), str):
        chosen.insert(0, loaded.pop("algorithm"))
    layers = [_preset_layer(name, presets) for name in chosen]
    layers.append(OmegaConf.create(loaded))
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"{item!r}: overrides are key=value (e.g. model.lora.rank=32)")
        key, value = item.split("=", 1)
        layers.append(OmegaConf.from_dotlist([f"{key}={value}"]))
    try:
        merged = OmegaConf.merge(schema, *layers)
    except (ConfigKeyError, ConfigAttributeError) as e:
        key = _full_key(e)
        raise ConfigError(f"unknown key {key!r}{_closest(key)}") from None
    except ValidationError as e:
        key = _full_key(e)
        raise ConfigError(f"{key}: {e.msg.splitlines()[0]} (expected {_type_name(_field_type(key))})") from None
    config = OmegaConf.to_object(merged)
    _check_values(config)
    _check_rules(config)
    return config


def _read_yaml(path: str | Path) -> dict:
    try:
        loaded = yaml.safe_load(Path(path).read_text()) or {}
    except FileNotFoundError:
        raise ConfigError(f"config file {path} not found") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {path} is not valid YAML: {e}") from None
    if not isinstance(loaded, dict):
        raise ConfigError(f"config file {path} must hold a mapping of sections")
    return loaded


def _preset_layer(name: str, presets: dict | None):
    if not presets or name not in presets:
        raise ConfigError(f"algorithm={name}: unknown preset; choose one of {sorted(presets or {})}")
    return OmegaConf.create({"algorithm": {"name": name, **presets[name].settings}})


def to_yaml(config: Config) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(config))


def help_text() -> str:
    """Every key with its type, default and meaning."""
    lines = ["Configuration keys (set in a YAML file or as key=value; later wins):", ""]
    for key, f in _leaves(Config):
        default = f.default_factory() if f.default is MISSING else f.default
        choices, low, high = f.metadata.get("choices"), f.metadata.get("minimum"), f.metadata.get("maximum")
        meaning = f.metadata.get("help", "") + (f" [{' | '.join(map(str, choices))}]" if choices else "")
        if low is not None or high is not None:
            meaning += f" [{'' if low is None else low}..{'' if high is None else high}]"
        lines.append(f"  {key:32} {_type_name(f.type):10} {default!r:18} {meaning}")
    return "\n".join(lines)


def _leaves(cls, prefix: str = ""):
    for f in fields(cls):
        if is_dataclass(f.type):
            yield from _leaves(f.type, f"{prefix}{f.name}.")
        else:
            yield f"{prefix}{f.name}", f


def _valid_keys() -> list[str]:
    keys = [key for key, _ in _leaves(Config)]
    return keys + sorted({key.rsplit(".", 1)[0] for key in keys if "." in key})


def _closest(key: str) -> str:
    close = difflib.get_close_matches(key, _valid_keys(), n=1, cutoff=0.5)
    if not close:
        last = key.rsplit(".", 1)[-1]
        close = [k for k in _valid_keys() if k.endswith("." + last)][:1]
    return f"; did you mean {close[0]!r}?" if close else ""


def _full_key(error: Exception) -> str:
    key = getattr(error, "full_key", None) or getattr(error, "key", None) or str(error)
    return str(key)


def _field_type(key: str):
    for name, f in _leaves(Config):
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
    return getattr(tp, "__name__", str(tp))


def _check_values(config: Config) -> None:
    for key, f in _leaves(Config):
        section, name = key.rsplit(".", 1)
        value = getattr(_resolve(config, section), name)
        choices, low, high = f.metadata.get("choices"), f.metadata.get("minimum"), f.metadata.get("maximum")
        if choices and value not in choices:
            raise ConfigError(f"{key}={value!r}: expected one of {', '.join(map(str, choices))}")
        if value is None:  # an optional key left unset
            continue
        if (low is not None and value < low) or (high is not None and value > high):
            expected = f">= {low}" if high is None else f"<= {high}" if low is None else f"in [{low}, {high}]"
            raise ConfigError(f"{key}={value!r}: expected a value {expected}")


def _resolve(config: Config, dotted: str):
    for part in dotted.split("."):
        config = getattr(config, part)
    return config


def _check_rules(config: Config) -> None:
    """Rules across keys (or stricter than a range) that users trip over, each naming its keys."""
    from lorarl.trainer.algorithms import ADVANTAGES, overlong_buffer

    a, r, w = config.algorithm, config.rollout, config.reward
    estimator = ADVANTAGES[a.adv_estimator]
    if config.actor.lr <= 0:
        raise ConfigError(f"actor.lr={config.actor.lr}: expected a value > 0")
    if getattr(estimator, "needs_values", False) and config.critic.lr <= 0:
        raise ConfigError(f"critic.lr={config.critic.lr}: expected a value > 0 (adv_estimator={a.adv_estimator} "
                          "trains a critic)")  # fmt: skip
    if getattr(estimator, "compares_groups", False) and r.n < 2:
        raise ConfigError(f"rollout.n={r.n}: algorithm.adv_estimator={a.adv_estimator} compares the responses to a "
                          "prompt, so it needs rollout.n >= 2 (with one, every advantage is 0 or the raw reward); "
                          "or choose an estimator without groups: reinforce_pp, remax, gae")  # fmt: skip
    if a.dual_clip is not None and a.dual_clip <= 1:
        raise ConfigError(f"algorithm.dual_clip={a.dual_clip}: expected a bound > 1 (or null: off)")
    buffer = overlong_buffer(a.overlong_buffer_frac, r.max_tokens)
    if a.overlong_buffer_frac > 0 and buffer >= r.max_tokens:
        raise ConfigError(f"algorithm.overlong_buffer_frac={a.overlong_buffer_frac} of rollout.max_tokens="
                          f"{r.max_tokens} is a buffer of {buffer} tokens: the overlong penalty would hit every "
                          "response (expected a buffer shorter than max_tokens)")  # fmt: skip
    if not 0 < r.top_p <= 1 or r.temperature < 0:
        raise ConfigError(f"rollout.top_p={r.top_p}, rollout.temperature={r.temperature}: expected 0 < top_p <= 1 "
                          "and temperature >= 0")  # fmt: skip
    if a.mini_batches > config.data.batch_size * r.n:
        raise ConfigError(f"algorithm.mini_batches={a.mini_batches}: more than the {config.data.batch_size * r.n} "
                          "responses of a step (data.batch_size x rollout.n)")  # fmt: skip
    if w.fns and w.fn != "default":
        raise ConfigError(f"reward.fn={w.fn!r} and reward.fns={w.fns}: set one (reward.fns replaces reward.fn)")
    if w.weights and len(w.weights) != len(w.fns or [w.fn]):
        raise ConfigError(f"reward.weights={w.weights}: expected one weight per reward function "
                          f"({len(w.fns or [w.fn])})")  # fmt: skip
    unknown = set(config.trainer.loggers or []) - {"tensorboard", "wandb"}
    if unknown:
        raise ConfigError(f"trainer.loggers={config.trainer.loggers}: unknown {sorted(unknown)}; expected tensorboard, "
                          "wandb")  # fmt: skip
    if w.timeout_s and not w.workers:
        raise ConfigError(f"reward.timeout_s={w.timeout_s} needs reward.workers >= 1 (a call is stopped in a worker "
                          "process)")  # fmt: skip
