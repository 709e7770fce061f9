import os

import torch

from tests import triton_state

# CPU machines run @triton.jit kernels through Triton's interpreter; this must be set before any kernel
# module is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

_language = []   # triton.language as it was before any test ran (tests/triton_state.py says why)


def pytest_collection_finish(session):
    _language.extend(triton_state.snapshot())


def pytest_runtest_teardown(item, nextitem):
    # an interpreted kernel that called a Triton device function leaves the interpreter's builtins in
    # triton.language: a real compile in a later test would generate code through them
    triton_state.restore(_language)
