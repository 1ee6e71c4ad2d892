"""Makes this environment look like the GPU machines this project is lent (put this folder on PYTHONPATH): the
packages they lack cannot be imported from the installed site-packages, only from PYTHONPATH's own folders (the
sources, `gpu_check.py --vendor`). They have torch, transformers, peft, triton, accelerate, safetensors, ninja and
their dependencies."""

import importlib.machinery
import sys

ABSENT = (
    "omegaconf", "rich", "markdown_it", "mdurl", "pygments", "matplotlib", "pyarrow", "datasets", "trl", "pandas",
    "psutil", "pytest", "vllm", "ray", "wandb", "tensorboard", "gguf",
)  # fmt: skip

outside = [p for p in sys.path if p and "site-packages" not in p and "dist-packages" not in p]
for name in ABSENT:
    if importlib.machinery.PathFinder.find_spec(name, outside) is None:
        sys.modules[name] = None  # what an absent package looks like: `import` fails, `find_spec` finds nothing
