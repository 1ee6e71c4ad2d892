#!/usr/bin/env bash
# The GPU checks of lorarl.lora_merge, for a CUDA machine whose python3 already holds torch, triton, peft,
# transformers, pytest and ninja (and nvcc for the CUDA op): no install, no network. Runs the package's tests (the
# Triton and CUDA kernels at their GPU tile sizes, against the float64 reference), then the throughput benchmark with
# fp32 and with bf16 factors. Everything it prints is also written to OUT_DIR: env.txt, tests.log, bench-fp32.jsonl,
# bench-bf16.jsonl. Usage: packages/lora_merge/benchmarks/gpu_check.sh OUT_DIR
set -uo pipefail
out=${1:?usage: gpu_check.sh OUT_DIR}
mkdir -p "$out"
out=$(cd "$out" && pwd)
cd "$(dirname "$0")/../../.."
export PYTHONPATH="$PWD/packages/lora_merge/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
  nvcc --version | tail -1
} 2>&1 | tee "$out/env.txt"
python3 -m pytest -q -p no:cacheprovider packages/lora_merge/tests 2>&1 | tee "$out/tests.log"
for factors in fp32 bf16; do
  python3 packages/lora_merge/benchmarks/merge_throughput.py --quick --device cuda --factor-dtype "$factors" \
    | tee "$out/bench-$factors.jsonl"
done
