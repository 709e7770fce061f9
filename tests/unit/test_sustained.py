"""tp_overlap.launch.measure.sustained: the sampler's block windows (ramp-up cuts) and its inert CPU form."""

import math
import time

import pytest
import torch

from tp_overlap.launch.measure.sustained import GpuSampler, sustained_blocks


def test_window_drops_each_ramp_and_averages_the_rest():
    sampler = GpuSampler(torch.device("cpu"))
    sampler.power_ramp_s = 1.0  # as with the driver's 1 s power average
    sampler._samples = [(10 + i / 8, 1000.0 + i, 500.0 + i) for i in range(30)]  # every 0.125 s
    clock, power = sampler.window(10.0, 12.0)
    assert clock == 1009.0  # samples 2..16: from 0.2 s after the start to the end
    assert power == 512.0   # samples 8..16: from 1 s after the start
    assert sampler.window(20.0, 21.0) == (None, None)


def test_sampler_is_inert_without_a_gpu():
    with GpuSampler(torch.device("cpu")) as sampler:
        assert sampler.window(0.0, math.inf) == (None, None)


def test_blocks_run_every_variant_the_same_number_of_steps_in_mirrored_order():
    calls = []
    steps = {"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}
    out = sustained_blocks(steps, seconds=0.005, step_ms=1.0, group=None, device=torch.device("cpu"), rank=0)
    assert calls == ["a"] * 5 + ["b"] * 5 + ["b"] * 5 + ["a"] * 5
    assert set(out) == {"a", "b"} and all(len(v["block_ms"]) == 2 and v["sm_clock_mhz"] is None
                                          for v in out.values())
    with pytest.raises(ValueError, match="finite seconds > 0"):
        sustained_blocks(steps, seconds=math.nan, step_ms=1.0, group=None, device=torch.device("cpu"), rank=0)


def test_block_time_is_per_step():
    # 50 steps of >= 2 ms each: per step is >= 2 ms, per block would be >= 100 ms
    out = sustained_blocks({"a": lambda: time.sleep(0.002)}, seconds=0.1, step_ms=2.0, group=None,
                           device=torch.device("cpu"), rank=0)
    assert all(2.0 <= ms < 20 for ms in out["a"]["block_ms"]), out
    assert out["a"]["ms"] == sum(out["a"]["block_ms"]) / 2
