"""kernels/flags.py under the Triton interpreter: the bounded toggle wait and the error record."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from tp_overlap.kernels.flags import SET, record_error, wait_for_flag  # noqa: E402


@triton.jit
def _wait_then_record(flags_ptr, errors_ptr, out_ptr, code_base, N: tl.constexpr):
    # one program per flag: wait (one poll under the interpreter), record the flag's code if it is not SET
    i = tl.program_id(0)
    arrived = wait_for_flag(flags_ptr + i, errors_ptr, 0, USE_TIMER=False)
    if not arrived:
        record_error(errors_ptr, code_base + i)
    tl.store(out_ptr + i, arrived.to(tl.int32))


def test_a_set_flag_arrives_and_a_clear_one_records_its_code_once():
    flags = torch.tensor([SET, 0, SET, 0], dtype=torch.int32)
    errors = torch.zeros(3, dtype=torch.int32)   # [code, value, abort], as the pool's control page
    out = torch.full((4,), -1, dtype=torch.int32)
    _wait_then_record[(4,)](flags, errors, out, 100, N=4)
    assert out.tolist() == [1, 0, 1, 0]
    assert errors[0].item() in (101, 103) and errors[1].item() == SET   # the first failure is kept
    first = errors[0].item()
    _wait_then_record[(4,)](flags, errors, out, 200, N=4)
    assert errors[0].item() == first, "a later failure must not overwrite the first"


def test_a_flag_set_to_another_value_is_not_arrived():
    # toggles: only SET counts (a stale or corrupted value never satisfies a wait)
    flags = torch.tensor([2, -1], dtype=torch.int32)
    errors = torch.zeros(3, dtype=torch.int32)
    out = torch.full((2,), -1, dtype=torch.int32)
    _wait_then_record[(2,)](flags, errors, out, 0, N=2)
    assert out.tolist() == [0, 0]
