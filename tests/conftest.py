import os

import torch

# CPU machines run @triton.jit kernels through Triton's interpreter; this must be set before any kernel
# module is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
