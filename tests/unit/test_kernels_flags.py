"""Flag kernels under the Triton interpreter (TRITON_INTERPRET=1; the timer path is GPU-only)."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

from kernels.flags import launch_signal, launch_wait  # noqa: E402


def test_signal_writes_epoch_and_wait_passes_when_flag_is_set():
    flag = torch.zeros(1, dtype=torch.int32)
    errors = torch.zeros(3, dtype=torch.int32)
    launch_signal(flag, 5)
    assert int(flag) == 5
    launch_wait(flag, 5, errors, error_code=17, timeout_ns=1000)
    launch_wait(flag, 3, errors, error_code=17, timeout_ns=1000)  # older epochs are satisfied too
    assert errors.tolist() == [0, 0, 0]


def test_expired_wait_records_code_and_epoch_first_writer_wins():
    flag = torch.full((1,), 4, dtype=torch.int32)
    errors = torch.zeros(3, dtype=torch.int32)
    launch_wait(flag, 6, errors, error_code=21, timeout_ns=0)
    assert errors.tolist() == [21, 6, 0]
    launch_wait(flag, 9, errors, error_code=33, timeout_ns=0)
    assert errors.tolist() == [21, 6, 0]


def test_abort_word_ends_a_wait_with_code_minus_one():
    flag = torch.zeros(1, dtype=torch.int32)
    errors = torch.tensor([0, 0, 5], dtype=torch.int32)
    launch_wait(flag, 2, errors, error_code=40, timeout_ns=10**9)
    assert errors.tolist() == [-1, 2, 5]


def test_write_flag_sets_only_its_word():
    from kernels.flags import write_flag
    flags = torch.zeros(4, dtype=torch.int32)
    write_flag(flags, 2, 9)
    assert flags.tolist() == [0, 0, 9, 0]


def test_device_epoch_is_read_from_the_counter_when_the_kernel_runs():
    from kernels.flags import DeviceEpoch, launch_signal_range
    counter = torch.tensor([7], dtype=torch.int32)
    flags = torch.zeros(6, dtype=torch.int32)
    errors = torch.zeros(3, dtype=torch.int32)
    launch_signal(flags[0:1], DeviceEpoch(counter))
    launch_signal_range(flags, 2, 3, DeviceEpoch(counter, -1))
    assert flags.tolist() == [7, 0, 6, 6, 6, 0]
    counter.fill_(8)  # a replayed graph: same launch arguments, the next step's counter
    launch_signal(flags[0:1], DeviceEpoch(counter))
    assert flags.tolist()[0] == 8
    launch_wait(flags[0:1], DeviceEpoch(counter), errors, error_code=3, timeout_ns=0)
    assert errors.tolist() == [0, 0, 0]
    launch_wait(flags[2:3], DeviceEpoch(counter), errors, error_code=3, timeout_ns=0)  # holds 6 < 8
    assert errors.tolist() == [3, 8, 0]


def test_write_flag_with_a_device_epoch_uses_the_kernel():
    from kernels.flags import DeviceEpoch, write_flag
    flags = torch.zeros(3, dtype=torch.int32)
    write_flag(flags, 1, DeviceEpoch(torch.tensor([41], dtype=torch.int32), 1))
    assert flags.tolist() == [0, 42, 0]
