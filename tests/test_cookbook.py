"""The Tinker cookbook's `math_rl` recipe, unchanged, as a client of `trainer serve`: run from its own environment
(`scripts/cookbook_env.sh`: tinker-cookbook 0.5.8 pins a transformers below the project's), on a tiny random model
whose byte-level tokenizer encodes the recipe's text. The cookbook's own metrics check the server: its
`optim/kl_sample_train_v1` compares the sampler's log-probs of each sampled token with the trainer's."""

import json
import os
import subprocess
from pathlib import Path

import pytest
from serve_fixtures import KEYS, make_byte_model_dir, running_server
from side_envs import ROOT, ensure_environment, outside_env

ENV = Path(os.environ.get("LORARL_COOKBOOK_ENV", ROOT / ".venv-cookbook"))
STEPS = 3


@pytest.mark.starts_first
@pytest.mark.timeout(1800)
def test_the_cookbooks_math_rl_runs_unchanged_against_the_server(tmp_path):
    script = ROOT / "scripts" / "cookbook_env.sh"
    python = ensure_environment(ENV, script, [script])
    model = make_byte_model_dir(tmp_path / "model")
    run = tmp_path / "run"
    with running_server(str(model), tmp_path / "state") as url:
        command = [python, "-m", "tinker_cookbook.recipes.math_rl.train", f"base_url={url}", f"model_name={model}",
                   "renderer_name=role_colon", "env=arithmetic", "group_size=4", "groups_per_batch=4",
                   "learning_rate=1e-3", "lora_rank=8", "max_tokens=8", f"max_steps={STEPS}", "eval_every=0",
                   "save_every=2", f"log_path={run}", "behavior_if_log_dir_exists=delete"]  # fmt: skip
        env = {**outside_env(), "TINKER_API_KEY": KEYS[0], "HF_HUB_OFFLINE": "1"}
        done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=1500)
    assert done.returncode == 0, (done.stdout + done.stderr)[-6000:]
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in metrics if "env/all/reward/total" in m]
    assert [m["step"] for m in steps] == list(range(STEPS))
    for m in steps:
        assert abs(m["optim/kl_sample_train_v1"]) < 1e-4, m  # the sampler's log-probs are the trainer's
        assert m["env/all/ac_tokens_per_turn"] > 0
    saved = [json.loads(line) for line in (run / "checkpoints.jsonl").read_text().splitlines()]
    assert [s["name"] for s in saved] == ["000002", "final"]
    assert all(s["state_path"].startswith("tinker://") and s["sampler_path"].startswith("tinker://") for s in saved)
