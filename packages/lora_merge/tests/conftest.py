import os

import torch

# Triton kernels run on CPU under the interpreter; it must be on before triton decorates the kernel (first use).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
