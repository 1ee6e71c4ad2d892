"""The trainer runs without vLLM installed: its engine modules import vLLM only when a vLLM engine starts."""

import subprocess
import sys


def test_importing_the_engine_modules_does_not_import_vllm():
    modules = "lorarl.trainer.engines.vllm_worker, lorarl.trainer.engines.inline, lorarl.trainer.loop"
    code = f"import sys, {modules}; print(any(m == 'vllm' or m.startswith('vllm.') for m in sys.modules))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert done.stdout.strip() == "False"
