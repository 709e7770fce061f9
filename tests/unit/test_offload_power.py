"""The step model's power limit (overlap/offload/power.py) and the copies' k only beside GEMMs: the heat's
dynamics, the fit from per-GEMM samples, and what both change in the simulated step."""

import random

import pytest

from tp_overlap.offload import sim
from tp_overlap.offload.planner import MLPShape, Rates, calibrate, simulate
from tp_overlap.offload.power import Heat, fit_heat

HOT = dict(gemm_heat=0.16, heat_ms=60.0, cool_ms=20.0, mem_heat=0.4)
COOL_MS = 2.45
SHAPE = MLPShape(hidden=4096, ffn_hidden=14336, m=4096, num_layers=8, fused_activation=True)
MEASURED = dict(d2h_gbps=55, h2d_gbps=55, fc1_ms=1.3, fc2_ms=0.65, act_ms=0.17, act_plain_ms=0.36,
                act_bwd_ms=0.33, act_bwd_plain_ms=0.69, fc1_bwd_ms=2.5, fc2_bwd_ms=1.3, step_extra_ms=5.0)
OFFLOAD_ALL = {(p, n): "offload" for p in range(SHAPE.num_layers) for n in ("x", "h", "a")}
RECOMPUTE_S = {(p, "s"): "recompute" for p in range(SHAPE.num_layers)}


def heat(level):
    h = Heat(**HOT)
    h.level = level
    return h


def test_back_to_back_gemms_reach_the_hot_time_and_idle_cools_the_gpu():
    h = heat(0.0)
    times = [h.gemm(COOL_MS) for _ in range(400)]
    assert times[0] == pytest.approx(COOL_MS, rel=0.01)
    assert times[-1] == pytest.approx(COOL_MS * 1.16, rel=1e-3)
    assert all(a <= b for a, b in zip(times, times[1:]))
    # half way up after about heat_ms * ln 2 of GEMMs
    elapsed = 0.0
    for t in times:
        elapsed += t
        if t >= COOL_MS * 1.08:
            break
    assert elapsed == pytest.approx(60.0 * 0.693, rel=0.1)
    h.idle(200.0)           # ten cooling time constants
    assert h.gemm(COOL_MS) == pytest.approx(COOL_MS, rel=0.01)
    h = heat(1.0)
    h.memory_bound(1000.0)  # memory-bound kernels hold it at mem_heat, from either side
    assert h.level == pytest.approx(0.4, abs=1e-6)
    h.level = 0.0
    h.memory_bound(1000.0)
    assert h.level == pytest.approx(0.4, abs=1e-6)


def test_no_heat_leaves_every_time_alone():
    h = Heat(0.0, 60.0, 4.0, 0.4)
    assert [h.gemm(COOL_MS) for _ in range(50)] == [COOL_MS] * 50


def synthetic(noise, rng):
    n = lambda v: v * (1 + rng.gauss(0, noise))  # noqa: E731
    h = heat(0.0)
    heating = [n(h.gemm(COOL_MS)) for _ in range(170)]
    cooling = []
    for gap in (2.0, 5.0, 15.0, 40.0):
        h = heat(1.0)
        last = h.gemm(COOL_MS)
        h.idle(gap)
        cooling.append((n(last), gap, [n(h.gemm(COOL_MS)) for _ in range(6)]))
    h, alternating = heat(1.0), []
    for _ in range(170):
        alternating.append((n(h.gemm(COOL_MS)), 0.3))
        h.memory_bound(0.3)
    return heating, cooling, alternating


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_fit_recovers_the_heat_of_synthetic_samples(seed):
    fit = fit_heat(*synthetic(0.003, random.Random(seed)))
    assert fit["gemm_heat"] == pytest.approx(0.16, rel=0.1)
    assert fit["heat_ms"] == pytest.approx(60.0, rel=0.25)
    assert fit["cool_ms"] == pytest.approx(20.0, rel=0.35)
    assert fit["mem_heat"] == pytest.approx(0.4, abs=0.1)
    assert fit["cool_gemm_ms"] == pytest.approx(COOL_MS, rel=0.01)
    assert fit["at_bound"] == [] and fit["heating_rms_ms"] < 0.01 and fit["alternating_rms_ms"] < 0.01


def test_a_gemm_that_does_not_slow_down_fits_no_heat_and_few_samples_are_refused():
    rng = random.Random(3)
    flat = [COOL_MS * (1 + rng.gauss(0, 0.001)) for _ in range(100)]
    assert fit_heat(flat, [(COOL_MS, 5.0, [COOL_MS])], [(COOL_MS, 0.3)] * 10)["gemm_heat"] == 0.0
    with pytest.raises(ValueError, match="heating samples"):
        fit_heat(flat[:5], [], [])


def test_heat_slows_the_plain_step_and_calibration_still_matches_it():
    cold, hot = Rates(**MEASURED), Rates(**MEASURED, **HOT)
    assert simulate(SHAPE, hot, {}, 1).step_ms > 1.05 * simulate(SHAPE, cold, {}, 1).step_ms
    tuned = calibrate(SHAPE, hot, 100.0)
    assert simulate(SHAPE, tuned, {}, 1).step_ms == pytest.approx(100.0, rel=1e-6)


def test_stalls_cool_the_gpu_and_memory_bound_kernels_that_leave_heat_the_rest():
    slow_copies = dict(MEASURED, d2h_gbps=20, h2d_gbps=20)
    cold, hot = Rates(**slow_copies), Rates(**slow_copies, **dict(HOT, mem_heat=0.0))
    plain = simulate(SHAPE, hot, {}, 1).step_ms - simulate(SHAPE, cold, {}, 1).step_ms
    stalled_hot, stalled_cold = simulate(SHAPE, hot, OFFLOAD_ALL, 1), simulate(SHAPE, cold, OFFLOAD_ALL, 1)
    assert stalled_cold.stall_ms > 20
    # the GEMMs after the stalls run cooler: the heat costs the stalled plan less than the plain stack
    assert stalled_hot.step_ms - stalled_cold.step_ms < 0.8 * plain
    # recomputing s removes memory-bound time that cooled the GPU: it saves less with heat than without
    saving = lambda r: simulate(SHAPE, r, {}, 1).step_ms - simulate(SHAPE, r, RECOMPUTE_S, 1).step_ms  # noqa: E731
    assert 0 < saving(hot) < saving(cold)


def test_a_copy_is_k_copy_slower_only_where_a_gemm_runs_beside_it():
    done = {}
    queue = sim._Queue(2.0, done)
    queue.issue(0.0, 10.0, "first")
    queue.issue(0.0, 10.0, "second")
    queue.under_gemm(5.0, 15.0)   # the first copy's last 5 ms of work take the GEMM's 10 ms
    assert queue.spans == [[0.0, 15.0, "first"], [15.0, 25.0, "second"]]   # the second starts after the GEMM
    assert done == {"first": 15.0, "second": 25.0} and queue.free_at == 25.0
    queue.under_gemm(20.0, 22.0)  # 2 ms inside the second: 1 ms of its work, the remaining 4 after
    assert done == {"first": 15.0, "second": 26.0} and queue.free_at == 26.0
    queue.under_gemm(40.0, 50.0)  # nothing beside it (the step's GEMMs come in time order)
    assert done == {"first": 15.0, "second": 26.0}
    waiting = sim._Queue(2.0, {})
    waiting.issue(0.0, 4.0, "a")
    waiting.issue(30.0, 4.0, "b")  # issued when its tensor was ready, long after the queue was free
    waiting.under_gemm(2.0, 10.0)
    assert waiting.spans == [[0.0, 6.0, "a"], [30.0, 34.0, "b"]]
    # in the step: the forward's backlog drains during the stall at the start of backward, unstretched
    rates = dict(MEASURED, d2h_gbps=20, h2d_gbps=20)
    base = simulate(SHAPE, Rates(**rates), OFFLOAD_ALL, 1)
    stretched = simulate(SHAPE, Rates(**rates, k_copy=1.5), OFFLOAD_ALL, 1)
    copies_ms = 2 * base.moved_bytes / 20e9 * 1e3   # both ways
    assert base.stall_ms > 0.3 * copies_ms
    assert base.step_ms < stretched.step_ms < base.step_ms + 0.5 * (copies_ms - base.stall_ms)


def test_the_cpu_probes_report_a_backlog_bandwidth_no_heat_and_rates_that_carry_the_heat():
    import torch

    from tp_overlap.launch.measure.offload_measure import measure_copies, measure_heat, rates_from
    host, dev = torch.randn(1 << 16).view(torch.uint8), torch.empty(1 << 18, dtype=torch.uint8)
    copies = measure_copies(host, dev, sizes=[1 << 16, 1 << 20, 0], reps=2)
    # sizes are capped at the buffer, empty ones dropped; on CPU nothing runs beside a GEMM
    assert copies["backlog_mb"] == [1 / 16, 1 / 4] and copies["d2h_gbps"] > 0 and copies["h2d_gbps"] > 0
    assert not copies["measured_concurrency"] and copies["k_copy_d2h"] == 1.0
    heat = measure_heat(lambda: None, lambda: None, cuda=False)
    assert heat["gemm_heat"] == 0.0 and not heat["measured"]
    times = dict(fc1_ms=1.0, fc2_ms=0.5, act_ms=0.1, act_bwd_ms=0.2)
    assert rates_from(copies, times).gemm_heat == 0.0
    rates = rates_from(copies, times, heat=dict(HOT))
    assert (rates.gemm_heat, rates.heat_ms, rates.cool_ms, rates.mem_heat) == (0.16, 60.0, 20.0, 0.4)


def test_heat_numbers_are_validated():
    from tp_overlap.offload.planner import OffloadPlanError
    for bad in (dict(gemm_heat=-0.1), dict(gemm_heat=2.0), dict(mem_heat=1.5), dict(heat_ms=0), dict(cool_ms=-1)):
        with pytest.raises(OffloadPlanError, match="Rates."):
            Rates(d2h_gbps=55, h2d_gbps=55, **bad)
