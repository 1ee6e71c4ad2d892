#!/usr/bin/env bash
# Make the Tinker cookbook's environment: a client of `trainer serve`, apart from the project's. tinker-cookbook 0.5.8
# (the newest that installs from the registry: 0.6.1 needs tml-renderers >= 0.4.1, absent) pins transformers <= 5.5.4,
# below the project's pin; its math_rl recipe imports pylatexenc even for env=arithmetic. torch is the project's
# version, so uv takes it from its cache.
#
#   scripts/cookbook_env.sh [DIR]   # DIR defaults to .venv-cookbook in the checkout (git-ignored)
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
dir="${1:-$root/.venv-cookbook}"
uv venv --quiet --allow-existing --python 3.11 "$dir"
VIRTUAL_ENV="$dir" uv pip install --quiet "tinker-cookbook==0.5.8" "tinker==0.38.0" "transformers==5.5.4" \
    "torch==2.14.0" "pylatexenc==2.10" pytest
"$dir/bin/python" -c "import tinker_cookbook.recipes.math_rl.train, tinker; print(f'tinker {tinker.__version__}')"
# what it was made from (tests/test_cookbook.py makes it again when this changes)
(cd "$root" && LC_ALL=C cat scripts/cookbook_env.sh | sha256sum | cut -d' ' -f1) > "$dir/lorarl-inputs"
echo "ready: $dir/bin/python -m tinker_cookbook.recipes.math_rl.train base_url=http://127.0.0.1:8000 ..."
