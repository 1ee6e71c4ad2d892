"""The configuration's checks, once loaded: each value within its key's range or choices, each pluggable key naming a
registered piece (or a plugin), and the rules across keys — each error naming its keys."""

import importlib.util
import sys

from lorarl.trainer.context import DEFAULT_EPISODE_TOKENS
from lorarl.trainer.errors import ConfigError
from lorarl.trainer.pieces import pluggable
from lorarl.trainer.registry import PluginError, Registry, choices_of
from lorarl.trainer.schema import Config, leaves


def check(config: Config, schema: type) -> None:
    check_values(config, schema)
    check_choices(config)
    check_rules(config)


def load_plugin(key: str, spec: str, registry: Registry) -> None:
    if key.startswith("reward."):
        from lorarl.trainer.rewards import load_reward

        try:
            load_reward(spec)
        except Exception as e:
            raise ConfigError(str(e)) from None
        return
    if spec in registry.keywords:
        return
    try:
        registry[spec]
    except PluginError as e:
        raise ConfigError(f"{key}={spec!r}: {e}") from None


def check_values(config: Config, schema: type) -> None:
    for key, f in leaves(schema):
        section, name = key.rsplit(".", 1)
        value = getattr(_resolve(config, section), name)
        choices, low, high = choices_of(f), f.metadata.get("minimum"), f.metadata.get("maximum")
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


def check_choices(config: Config) -> None:
    """Each pluggable key names a registered piece (or a plugin, loaded with the schema)."""
    for key, registry in pluggable().items():
        section, name = key.split(".")
        value = getattr(getattr(config, section), name)
        for spec in value if isinstance(value, list) else [value]:
            load_plugin(key, spec, registry)  # raises, naming the registered ones


def check_rules(config: Config) -> None:
    """Rules across keys (or stricter than a range) that users trip over, each naming its keys."""
    from lorarl.trainer.algorithms import ADVANTAGES, overlong_buffer
    from lorarl.trainer.engines import ENGINES, placement
    from lorarl.trainer.envs import SINGLE_TURN

    a, r, w, t = config.algorithm, config.rollout, config.reward, config.trainer
    estimator = ADVANTAGES[a.adv_estimator]
    if config.actor.lr <= 0:
        raise ConfigError(f"actor.lr={config.actor.lr}: expected a value > 0")
    if estimator.needs_values and config.critic.lr <= 0:
        raise ConfigError(f"critic.lr={config.critic.lr}: expected a value > 0 (adv_estimator={a.adv_estimator} "
                          "trains a critic)")  # fmt: skip
    if estimator.compares_groups and r.n < 2:
        raise ConfigError(f"rollout.n={r.n}: algorithm.adv_estimator={a.adv_estimator} compares the responses to a "
                          "prompt, so it needs rollout.n >= 2 (with one, every advantage is 0 or the raw reward); "
                          "or choose an estimator without groups: reinforce_pp, remax, gae")  # fmt: skip
    if a.dual_clip is not None and a.dual_clip <= 1:
        raise ConfigError(f"algorithm.dual_clip={a.dual_clip}: expected a bound > 1 (or null: off)")
    buffer = overlong_buffer(a.overlong_buffer_frac, r.max_tokens)
    single_turn = config.env.name == SINGLE_TURN  # an episode's buffer is a share of env.max_tokens (checked below)
    if single_turn and a.overlong_buffer_frac > 0 and buffer >= r.max_tokens:
        raise ConfigError(f"algorithm.overlong_buffer_frac={a.overlong_buffer_frac} of rollout.max_tokens="
                          f"{r.max_tokens} is a buffer of {buffer} tokens: the overlong penalty would hit every "
                          "response (expected a buffer shorter than max_tokens)")  # fmt: skip
    if r.min_tokens > r.max_tokens:
        raise ConfigError(f"rollout.min_tokens={r.min_tokens}: expected at most rollout.max_tokens={r.max_tokens}")
    if r.top_p <= 0:
        raise ConfigError(f"rollout.top_p={r.top_p}: expected 0 < top_p <= 1")
    if r.temperature == 0 and r.n > 1:
        raise ConfigError(f"rollout.temperature=0 samples greedily, one response per prompt, but rollout.n={r.n}: "
                          "raise the temperature, or set rollout.n=1 (with an estimator without groups)")  # fmt: skip
    if a.mini_batches > config.data.batch_size * r.n:
        raise ConfigError(f"algorithm.mini_batches={a.mini_batches}: more than the {config.data.batch_size * r.n} "
                          "responses of a step (data.batch_size x rollout.n)")  # fmt: skip
    if w.fns and w.fn != "default":
        raise ConfigError(f"reward.fn={w.fn!r} and reward.fns={w.fns}: set one (reward.fns replaces reward.fn)")
    if w.weights and len(w.weights) != len(w.fns or [w.fn]):
        raise ConfigError(f"reward.weights={w.weights}: expected one weight per reward function "
                          f"({len(w.fns or [w.fn])})")  # fmt: skip
    unknown = set(t.loggers or []) - {"tensorboard", "wandb"}
    if unknown:
        raise ConfigError(f"trainer.loggers={t.loggers}: unknown {sorted(unknown)}; expected tensorboard, wandb")
    if w.timeout_s and not w.workers:
        raise ConfigError(f"reward.timeout_s={w.timeout_s} needs reward.workers >= 1 (a call is stopped in a worker "
                          "process)")  # fmt: skip
    if r.replicas > 1 and t.backend != "ray":
        raise ConfigError(f"rollout.replicas={r.replicas} needs trainer.backend=ray")
    if r.overlap and a.rollout_correction == "none":
        raise ConfigError("rollout.overlap trains on rollouts of the weights one update behind: set "
                          "algorithm.rollout_correction=token (or sequence) to correct for that")  # fmt: skip
    band = list(a.rollout_correction_band)
    if len(band) != 2 or not 0 <= band[0] <= 1 <= band[1]:
        raise ConfigError(f"algorithm.rollout_correction_band={band}: expected [low, high] with 0 <= low <= 1 <= high")
    if r.sync != "merged" and config.model.lora.rank == 0 and config.model.lora.adapter_path is None:
        raise ConfigError(f"rollout.sync={r.sync} needs a LoRA adapter (model.lora.rank > 0)")
    if config.critic.lora.adapter_path is not None:
        raise ConfigError("critic.lora.adapter_path is not supported: a critic continues from a checkpoint "
                          "(trainer.resume)")  # fmt: skip
    env = config.env
    if env.tools and single_turn:
        raise ConfigError(f"env.tools={env.tools} needs an environment that calls them: env.name=tools (or your own)")
    if env.name == "verifiers" and not env.verifiers.id:
        raise ConfigError("env=verifiers needs env.verifiers.id: an installed verifiers environment's id, or an import "
                          "path to a vf.Environment or a function returning one")  # fmt: skip
    if r.max_staleness:
        check_staleness(config)
    if r.in_flight_updates and (not r.max_staleness or single_turn):
        raise ConfigError("rollout.in_flight_updates moves an episode to newer weights at its next turn: it needs "
                          "rollout.max_staleness >= 1 and an environment (env.name)")  # fmt: skip
    if not single_turn and r.overlap:
        raise ConfigError("rollout.overlap does not play multi-turn episodes (env.name): each turn waits for the "
                          "environment; set rollout.max_staleness=1 instead")  # fmt: skip
    budget = env.max_tokens or DEFAULT_EPISODE_TOKENS  # (unset: set with the model's positions; a share the same)
    if not single_turn and a.overlong_buffer_frac > 0 and overlong_buffer(a.overlong_buffer_frac, budget) >= budget:
        raise ConfigError(f"algorithm.overlong_buffer_frac={a.overlong_buffer_frac}: with an environment the buffer "
                          f"is a share of env.max_tokens={env.max_tokens}, and covers all of it")  # fmt: skip
    if r.overlap and placement(r, t.backend) == "inline":
        raise ConfigError("rollout.overlap generates beside the training: it needs rollout.worker=process")
    requires = ENGINES[r.engine].requires
    if requires and t.backend != "ray" and importlib.util.find_spec(requires[0]) is None:  # Ray may place it elsewhere
        raise ConfigError(f"rollout.engine={r.engine} needs {requires[0]}, which this Python ({sys.executable}) "
                          f"cannot import: {requires[1]}")  # fmt: skip


def check_staleness(config: Config) -> None:
    """`rollout.max_staleness`: batches generated beside the training, each from one exact earlier version."""
    r, a, k = config.rollout, config.algorithm, config.rollout.max_staleness
    from lorarl.trainer.algorithms import ADVANTAGES
    from lorarl.trainer.engines import placement

    rules = [
        (r.overlap, "and rollout.overlap: set one (overlap is one batch ahead on one engine)"),
        (a.rollout_correction == "none", "trains on rollouts of earlier weights: set "
                                         "algorithm.rollout_correction=token (or sequence) to correct for that"),
        (placement(r, config.trainer.backend) == "inline" and r.engine != "hf", "generates beside the training: "
                                                                               "it needs rollout.worker=process"),
        (a.dynamic_sampling, "draws each step's batch ahead of it: algorithm.dynamic_sampling draws more as it goes"),
        (ADVANTAGES[a.adv_estimator].needs_greedy_baseline, f"and algorithm.adv_estimator={a.adv_estimator}: its "
                                                            "greedy baseline is generated on the current weights"),
        (r.sync == "auto", "starts k + 1 engines: name the sync kind (rollout.sync=merged, factors or adapter)"),
        (r.replicas > 1, "and rollout.replicas: one engine per batch in flight already"),
        (config.trainer.backend == "ray", "runs its engines as processes (trainer.backend=ray: not yet)"),
    ]  # fmt: skip
    for broken, why in rules:
        if broken:
            raise ConfigError(f"rollout.max_staleness={k} {why}")
