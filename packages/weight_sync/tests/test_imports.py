"""Importing lorarl.weight_sync (its vLLM module included) never imports vLLM: it is an optional extra."""

import subprocess
import sys


def test_import_does_not_need_vllm():
    probe = (
        "import sys, lorarl.weight_sync, lorarl.weight_sync.vllm; "
        "print(sorted(m for m in sys.modules if m == 'vllm' or m.startswith('vllm.')))"
    )
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True)
    assert result.stdout.strip() == "[]"
