"""Ready-made algorithm settings, selected with `algorithm=<name>`; each overrides the `algorithm` section and is then
overridden by a YAML file and `key=value` pairs. Settings follow the papers and verl's recipes, so results transfer."""

import textwrap
from typing import NamedTuple


class Preset(NamedTuple):
    summary: str
    settings: dict


_BASE = {
    "adv_estimator": "grpo",
    "policy_loss": "ppo",
    "clip_low": 0.2,
    "clip_high": 0.2,
    "loss_agg_mode": "token-mean",
    "dynamic_sampling": False,
    "overlong_buffer_frac": 0.0,
}

PRESETS: dict[str, Preset] = {
    "grpo": Preset("GRPO (Shao et al. 2024): group-normalised advantages, PPO clip", _BASE),
    "dapo": Preset(
        "DAPO (Yu et al. 2025): clip-higher 0.28, token-mean, dynamic sampling, overlong penalty over the last 20%",
        {**_BASE, "clip_high": 0.28, "dynamic_sampling": True, "overlong_buffer_frac": 0.2},
    ),
    "drgrpo": Preset(
        "Dr. GRPO (Liu et al. 2025): no std division, per-sequence sums over a constant length",
        {**_BASE, "adv_estimator": "drgrpo", "loss_agg_mode": "seq-mean-token-sum-norm"},
    ),
    "ppo": Preset(
        "PPO (Schulman et al. 2017) with a LoRA critic: GAE (gamma 1, lambda 1) on the critic's values, whitened",
        {**_BASE, "adv_estimator": "gae", "gae": {"gamma": 1.0, "lam": 1.0}},
    ),
    "rloo": Preset("RLOO (Ahmadian et al. 2024): leave-one-out baseline", {**_BASE, "adv_estimator": "rloo"}),
    "gpg": Preset(
        "GPG (Chu et al. 2025): group-centred advantages scaled by 1 / the share of non-zero rewards, plain PG",
        {**_BASE, "adv_estimator": "gpg", "policy_loss": "gpg"},
    ),
    "gmpo": Preset(
        "GMPO (Zhao et al. 2025): geometric mean of token ratios, clipped to [e^-0.4, e^0.4], seq-mean-token-mean",
        {**_BASE, "policy_loss": "gmpo", "clip_low": 0.4, "clip_high": 0.4, "loss_agg_mode": "seq-mean-token-mean"},
    ),
    "sapo": Preset(
        "SAPO (Gao et al. 2025): a soft sigmoid gate instead of the clip (tau 1.0 / 1.05), seq-mean-token-mean",
        {**_BASE, "policy_loss": "sapo", "loss_agg_mode": "seq-mean-token-mean"},
    ),
    "gspo": Preset(
        "GSPO (Zheng et al. 2025): sequence-level ratio clipped to [1-3e-4, 1+4e-4], seq-mean-token-mean",
        {**_BASE, "policy_loss": "gspo", "clip_low": 3e-4, "clip_high": 4e-4, "loss_agg_mode": "seq-mean-token-mean"},
    ),
}


def presets_help() -> str:
    lines = ["Presets (algorithm=<name>, before the other settings):", ""]
    for name, preset in PRESETS.items():
        changed = {k: v for k, v in _flat(preset.settings).items() if name == "grpo" or _flat(_BASE).get(k) != v}
        lines += textwrap.wrap(f"  {name:8} {preset.summary}", 120, subsequent_indent=" " * 11)
        lines += textwrap.wrap(" ".join(f"{k}={v}" for k, v in changed.items()), 120, initial_indent=" " * 13,
                               subsequent_indent=" " * 13)  # fmt: skip
    return "\n".join(lines)


def _flat(settings: dict, prefix: str = "") -> dict:
    """Nested settings (a piece's own: {"gae": {"lam": 1.0}}) as dotted keys."""
    flat = {}
    for key, value in settings.items():
        flat.update(_flat(value, f"{prefix}{key}.") if isinstance(value, dict) else {f"{prefix}{key}": value})
    return flat
