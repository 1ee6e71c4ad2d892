"""How long a context the rollout engine takes, and the room it leaves a prompt.

A sequence is a prompt (at most `data.max_prompt_tokens`) and what follows it: a response (`rollout.max_tokens`), or
an episode's actions and observations (`env.max_tokens`). The two must fit the model's positions together: a model
run past them (the HF engine) degrades silently, and vLLM refuses the request mid-run. So the sum is checked before
anything loads; left unset, `env.max_tokens` takes the room a set `data.max_prompt_tokens` leaves (half the positions
where neither is set), `data.max_prompt_tokens` the room the budget leaves (each at most 512). An engine capped
lower (`rollout.vllm.max_model_len`, or a plugin engine's) ends the episodes that outgrow it with stop reason
`context`.
"""

from pathlib import Path

from lorarl.trainer.envs import SINGLE_TURN
from lorarl.trainer.errors import ConfigError

DEFAULT_PROMPT_TOKENS = 512
DEFAULT_EPISODE_TOKENS = 512


def model_positions(model_dir: Path) -> int | None:
    """The positions the model was built for (`max_position_embeddings`), or None where its config names none."""
    from transformers import AutoConfig

    return getattr(AutoConfig.from_pretrained(model_dir), "max_position_embeddings", None)


def fit_context(config, model_dir: Path, episodes=None) -> int | None:
    """Check that a prompt and its budget fit the model's positions, setting an unset `data.max_prompt_tokens` to the
    room the budget leaves; bound the `episodes` (an `EpisodeRunner`) by both; return the longest context the engine
    takes (None: unbounded)."""
    max_context = _fitted(config, model_dir)
    if episodes is not None:
        episodes.bound(config.data.max_prompt_tokens, max_context)
    return max_context


def _fitted(config, model_dir: Path) -> int | None:
    data, r, env = config.data, config.rollout, config.env
    positions = model_positions(model_dir)
    if env.name != SINGLE_TURN and env.max_tokens is None:  # the room the prompt leaves
        left = DEFAULT_EPISODE_TOKENS if positions is None else positions - (data.max_prompt_tokens or positions // 2)
        env.max_tokens = max(1, min(DEFAULT_EPISODE_TOKENS, left))
    budget_key, budget = (("rollout.max_tokens", r.max_tokens) if env.name == SINGLE_TURN
                          else ("env.max_tokens", env.max_tokens))  # fmt: skip
    if positions is None:
        data.max_prompt_tokens = data.max_prompt_tokens or DEFAULT_PROMPT_TOKENS
        return None
    if budget >= positions:
        raise ConfigError(f"{budget_key}={budget} leaves no room for a prompt (data.max_prompt_tokens) in the model's "
                          f"{positions} positions (max_position_embeddings): lower it")  # fmt: skip
    if data.max_prompt_tokens is None:
        data.max_prompt_tokens = min(DEFAULT_PROMPT_TOKENS, positions - budget)
    elif data.max_prompt_tokens + budget > positions:
        raise ConfigError(f"data.max_prompt_tokens={data.max_prompt_tokens} + {budget_key}={budget} is more than the "
                          f"model's {positions} positions (max_position_embeddings): lower one of them")  # fmt: skip
    capped = getattr(getattr(r, r.engine, None), "max_model_len", None)  # vLLM's, where it is set
    return min(positions, capped) if capped else positions
