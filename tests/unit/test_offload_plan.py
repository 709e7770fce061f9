"""The offload planner with synthetic numbers: budgets, ties, impossible budgets, auto, depth, pacing, table,
and the time model's signs and magnitudes."""

import dataclasses
import itertools

import pytest

from tp_overlap.offload.planner import (AUTO_MAX_ADDED, MLPShape, OffloadPlanError, Rates, calibrate, pacing_offset,
                                    plan_offload, simulate, tensor_bytes)
from tp_overlap.offload._step_inputs import grad_bytes, layer_times

# llama8b-like layer at M = 16384 on one H200-like device: copies at 55 GB/s, GEMMs at 700 TFLOP/s
SHAPE = MLPShape(hidden=4096, ffn_hidden=14336, m=16384, num_layers=2)
RATES = Rates(d2h_gbps=55, h2d_gbps=55, gemm_tflops=700, hbm_gbps=3000)
OPTIONS = {"x": ("keep", "offload"), "h": ("keep", "offload"), "a": ("keep", "offload", "recompute"),
           "s": ("keep", "recompute")}
# a llama8b layer at M = 4096 as measured on one H200 (ms)
MEASURED = dict(d2h_gbps=54, h2d_gbps=54, fc1_ms=1.45, fc2_ms=0.72, act_ms=0.378, act_bwd_ms=0.6)


def every_plan(shape):
    """Every per-(layer, tensor) assignment: 24 per layer."""
    keys = [(p, n) for p in range(shape.num_layers) for n in OPTIONS]
    for combo in itertools.product(*(OPTIONS[n] for _, n in keys)):
        yield dict(zip(keys, combo))


def brute_force(shape, rates, depth=1):
    keep = simulate(shape, rates, {}, 1)
    return keep, [(simulate(shape, rates, plan, depth), plan) for plan in every_plan(shape)]


def test_layer_times_and_bytes_follow_the_shapes():
    b = tensor_bytes(SHAPE)
    assert b == {"x": 16384 * 4096 * 2, "h": 16384 * 28672 * 2, "a": 16384 * 14336 * 2, "s": 16384 * 14336 * 2}
    assert tensor_bytes(MLPShape(hidden=64, ffn_hidden=96, m=10, world_size=2, activation="gelu")) == \
        {"x": 10 * 64 * 2, "h": 10 * 48 * 2, "a": 10 * 48 * 2, "s": 0}
    assert grad_bytes(SHAPE) == (4096 * 28672 * 2, 14336 * 4096 * 2)
    t = layer_times(SHAPE, RATES)
    assert t.fc1 == pytest.approx(2 * 16384 * 4096 * 28672 / 700e12 * 1e3)
    assert t.fc2 == pytest.approx(t.fc1 / 2) and t.recompute == t.act
    assert t.fc1_bwd == 2 * t.fc1 and t.fc2_bwd == 2 * t.fc2
    measured = layer_times(SHAPE, Rates(d2h_gbps=1, h2d_gbps=1, fc1_ms=3.0, recompute_ms=0.25, fc1_bwd_ms=5.5))
    assert (measured.fc1, measured.recompute, measured.fc1_bwd) == (3.0, 0.25, 5.5)


def test_the_step_time_is_the_sum_of_the_layer_pieces_when_nothing_moves():
    shape = MLPShape(hidden=4096, ffn_hidden=14336, m=4096, num_layers=16)
    rates = Rates(**MEASURED, fc1_bwd_ms=3.0, fc2_bwd_ms=1.5, step_extra_ms=4.0)
    per_layer = 1.45 + 0.378 + 0.72 + 3.0 + 0.6 + 1.5
    assert simulate(shape, rates, {}, 1).step_ms == pytest.approx(16 * per_layer + 4.0)


def test_recompute_costs_its_time_and_saves_its_bytes_in_the_table_with_the_right_signs():
    shape = MLPShape(hidden=4096, ffn_hidden=14336, m=4096, num_layers=16)
    rates = Rates(**MEASURED)
    plan = plan_offload(shape, rates, forced={"x": "keep", "h": "keep", "a": "recompute"})
    keep = simulate(shape, rates, {}, 1)
    assert plan.step_ms == pytest.approx(keep.step_ms + 16 * 0.378)  # the top layer's a too: forced
    row = next(r for r in plan.rows if r.tensor == "L3.a")
    ms, peak, act = row.vs_keep["recompute"]
    # the peak is the end of backward's (every gradient there): recompute lowers the activation peak only,
    # by a and by the silu(gate) autograd's activation keeps where nothing of the layer moves
    assert ms == pytest.approx(0.378) and peak == 0 and act == -2 * tensor_bytes(shape)["a"], row
    assert "| L3.a | 112.0 | recompute |" in plan.table()
    assert "0.378; +0.378 ms, peak +0 MiB, act -224 MiB" in plan.table()
    assert plan.added_ms > 0


def test_copies_never_speed_a_gemm_up_and_slow_only_the_gemms_they_overlap():
    shape = MLPShape(hidden=4096, ffn_hidden=14336, m=4096, num_layers=2)
    h = tensor_bytes(shape)["h"]
    copy_ms = 0.5
    gbps = h / (copy_ms * 1e-3) / 1e9
    one = {(0, "h"): "offload"}
    base = dict(d2h_gbps=gbps, h2d_gbps=gbps, fc1_ms=1.45, fc2_ms=0.72, act_ms=0.378, act_bwd_ms=0.6)
    keep = simulate(shape, Rates(**base), {}, 1).step_ms
    # k < 1 is noise: the plan is not predicted faster than keeping everything
    assert simulate(shape, Rates(**base, k_gemm=0.9), one, 1).step_ms == pytest.approx(keep)
    # h's copy out (0.5 ms) runs under fc2 of layer 0 (0.72 ms), its copy back under layer 1's fc2 backward
    slow = simulate(shape, Rates(**base, k_gemm=1.5), one, 1)
    assert slow.stall_ms == 0 and slow.step_ms - keep == pytest.approx(0.5 * 2 * copy_ms)


def test_the_gradients_backward_allocates_set_a_lean_plans_peak():
    shape = MLPShape(hidden=4096, ffn_hidden=14336, m=4096, num_layers=16)
    everything = {(p, n): "offload" for p in range(16) for n in "xha"}
    sim = simulate(shape, Rates(**MEASURED), everything, 1)
    grads = 16 * sum(grad_bytes(shape))
    assert sim.peak_where.startswith("backward L") and sim.peak_bytes > grads > sim.act_peak_bytes
    resident = simulate(MLPShape(hidden=4096, ffn_hidden=14336, m=4096, num_layers=16, grads="resident"),
                        Rates(**MEASURED), everything, 1, fixed_bytes=grads)
    assert resident.peak_bytes == grads + sim.act_peak_bytes


def test_a_loose_budget_keeps_everything():
    keep = simulate(SHAPE, RATES, {}, 1)
    plan = plan_offload(SHAPE, RATES, budget_bytes=keep.peak_bytes)
    assert all(d == "keep" for _, _, d in plan.decisions) and plan.added_ms == 0
    assert plan.peak_bytes == plan.keep_peak_bytes == keep.peak_bytes


@pytest.mark.parametrize("fraction", [1.0, 0.75, 0.5, 0.25, 0.0])
def test_the_choice_fits_and_no_plan_of_any_shape_is_faster(fraction):
    """Budgets from keep-all's peak down to the least peak any plan reaches (12^2 plans, brute force)."""
    keep, everything = brute_force(SHAPE, RATES)
    least = min(sim.peak_bytes for sim, _ in everything)
    budget = int(least + fraction * (keep.peak_bytes - least))
    plan = plan_offload(SHAPE, RATES, budget_bytes=budget, prefetch_depth=1)
    assert plan.peak_bytes <= budget
    best = min(sim.step_ms for sim, _ in everything if sim.peak_bytes <= budget)
    assert plan.step_ms <= best + 1e-9, (plan.table(), best)


def test_tighter_budgets_never_cost_less_time():
    shape = MLPShape(hidden=4096, ffn_hidden=14336, m=16384, num_layers=4)
    keep = simulate(shape, RATES, {}, 1)
    added = [plan_offload(shape, RATES, budget_bytes=int(keep.peak_bytes * f)).added_ms
             for f in (1.0, 0.9, 0.8, 0.7, 0.6)]
    assert added == sorted(added) and added[0] == 0 and added[-1] > 0, added


def test_an_impossible_budget_raises_naming_the_least_peak():
    keep, everything = brute_force(SHAPE, RATES)
    least = min(sim.peak_bytes for sim, _ in everything)
    with pytest.raises(OffloadPlanError, match=r"no plan fits budget_bytes=\d+ .* the least predicted peak is"):
        plan_offload(SHAPE, RATES, budget_bytes=least - 1, prefetch_depth=1)
    assert plan_offload(SHAPE, RATES, budget_bytes=least, prefetch_depth=1).peak_bytes == least
    with pytest.raises(OffloadPlanError, match="allowed: none"):
        plan_offload(SHAPE, RATES, budget_bytes=least, candidates=())


def test_ties_prefer_moving_nothing_and_do_not_depend_on_the_candidate_order():
    # copies and recompute free: removing `a` costs nothing either way; recompute moves no bytes
    free = Rates(d2h_gbps=1e9, h2d_gbps=1e9, gemm_tflops=700, hbm_gbps=3000, recompute_ms=0.0)
    keep = simulate(SHAPE, free, {}, 1)
    budget = keep.peak_bytes - tensor_bytes(SHAPE)["a"]
    plans = [plan_offload(SHAPE, free, budget_bytes=budget, candidates=order) for order in
             (("x", "h", "a"), ("a", "h", "x"), ("h", "a", "x"))]
    assert plans[0].decisions == plans[1].decisions == plans[2].decisions
    assert plans[0].added_ms == 0
    moved = {(p, n): d for p, n, d in plans[0].decisions if d != "keep"}
    assert "offload" not in moved.values(), plans[0].table()  # a tie with offload: recompute moves nothing
    assert plan_offload(SHAPE, free, budget_bytes=budget).decisions == plans[0].decisions  # deterministic


def test_auto_takes_the_lowest_peak_within_the_time_budget():
    keep, everything = brute_force(SHAPE, RATES)
    plan = plan_offload(SHAPE, RATES, prefetch_depth=1)
    assert plan.mode == "auto" and plan.budget_bytes is None and plan.max_added == AUTO_MAX_ADDED
    limit = AUTO_MAX_ADDED * keep.step_ms
    assert plan.added_ms <= limit
    lowest = min(sim.peak_bytes for sim, _ in everything if sim.step_ms - keep.step_ms <= limit)
    assert plan.peak_bytes == lowest and plan.peak_bytes < keep.peak_bytes
    nothing = plan_offload(SHAPE, RATES, prefetch_depth=1, max_added=0.0)
    assert nothing.added_ms <= 1e-9 and nothing.peak_bytes >= plan.peak_bytes


def test_a_larger_time_budget_never_raises_the_peak_and_the_frontier_is_pareto():
    shape = MLPShape(hidden=4096, ffn_hidden=14336, m=4096, num_layers=16)
    rates = Rates(**MEASURED, k_gemm=1.03)
    plans = [plan_offload(shape, rates, max_added=f) for f in (0.0, 0.01, 0.03, 0.1, 1.0)]
    peaks = [(p.peak_bytes, p.act_peak_bytes) for p in plans]
    assert peaks == sorted(peaks, reverse=True) and peaks[-1] < peaks[0], peaks
    assert all(p.added_ms <= f * p.baseline_step_ms + 1e-6 for p, f in zip(plans, (0.0, 0.01, 0.03, 0.1, 1.0)))
    front = plans[0].frontier
    assert len(front) > 3
    for a, b in zip(front, front[1:]):
        assert a["step_ms"] <= b["step_ms"] and (b["peak_bytes"], b["act_peak_bytes"]) < (a["peak_bytes"],
                                                                                          a["act_peak_bytes"])
    assert front[-1]["act_peak_bytes"] < 0.5 * plans[0].keep_act_peak_bytes


def test_copies_too_slow_for_their_window_are_not_chosen():
    slow = Rates(d2h_gbps=2, h2d_gbps=2, gemm_tflops=700, hbm_gbps=3000)
    plan = plan_offload(SHAPE, slow)
    assert all(d != "offload" for _, n, d in plan.decisions if n == "h"), plan.table()
    forced = plan_offload(SHAPE, slow, forced={"h": "offload"})
    assert forced.added_ms > 10 * plan.added_ms + 1.0  # what forcing it costs, and the model says so
    assert "forced by the caller" in forced.table()


def test_prefetch_depth_auto_goes_deeper_when_one_layer_ahead_stalls():
    shape = MLPShape(hidden=4096, ffn_hidden=14336, m=16384, num_layers=4)
    # h of a layer takes 1.5 backward layers to come back: one layer ahead is too late
    t = layer_times(shape, RATES)
    backward_ms = t.fc1_bwd + t.fc2_bwd + t.act_bwd
    gbps = tensor_bytes(shape)["h"] / (1.5 * backward_ms * 1e-3) / 1e9
    rates = Rates(d2h_gbps=gbps * 10, h2d_gbps=gbps, gemm_tflops=700, hbm_gbps=3000)
    first_h = {(0, "h"): "offload"}
    one, two = simulate(shape, rates, first_h, 1), simulate(shape, rates, first_h, 2)
    assert one.stall_ms > 1.0 and two.stall_ms == 0.0
    plan = plan_offload(shape, rates, budget_bytes=two.peak_bytes, candidates=("h",))
    assert plan.prefetch_depth == 2 and plan.added_ms == 0, plan.table()
    assert [(p, n) for p, n, d in plan.decisions if d == "offload"] == [(0, "h")]


def test_pacing_offsets_are_per_rank_bounded_and_defer_copies():
    assert [pacing_offset("none", r, 8) for r in range(8)] == [0] * 8
    assert pacing_offset("stagger", 0, 1) == 0
    assert [pacing_offset("stagger", r, 2) for r in range(2)] == [0, 1]
    phases = [pacing_offset("stagger", r, 8) for r in range(8)]
    assert set(phases) == {0, 1, 2} and max(phases.count(p) for p in set(phases)) == 3
    with pytest.raises(OffloadPlanError, match="local_rank=2"):
        pacing_offset("stagger", 2, 2)
    with pytest.raises(OffloadPlanError, match="none | stagger"):
        pacing_offset("sometimes", 0, 2)
    everything = {(p, n): "offload" for p in range(2) for n in "xha"}
    fast = Rates(d2h_gbps=2000, h2d_gbps=2000, gemm_tflops=700, hbm_gbps=3000)  # copies land within a save point
    now, later = (simulate(SHAPE, fast, everything, 1, pacing_offset=o) for o in (0, 2))
    assert all(later.release_at[k] == -1 or later.release_at[k] >= now.release_at[k] >= 0
               for k in now.release_at if now.release_at[k] >= 0)
    assert later.release_at != now.release_at


def test_the_table_explains_every_row():
    shape = MLPShape(hidden=4096, ffn_hidden=14336, m=16384, num_layers=2, gathered_is_view=True)
    plan = plan_offload(shape, RATES, forced={"a": "recompute"})
    text = plan.table()
    lines = text.splitlines()
    assert lines[0] == "| tensor | MiB | decision | offload: copy ms; vs keep | recompute: ms; vs keep | evidence |"
    assert len([line for line in lines if line.startswith("| L")]) == 4 * shape.num_layers
    assert "| L0.x | 0.0 | keep | - | - | pool view: costs no memory |" in text
    assert "| L1.a | 448.0 | recompute |" in text and "forced by the caller" in text
    assert "| L0.h | 896.0 |" in text and "34.165; +" in text
    assert text.splitlines()[-1].startswith("predicted: step")
    assert plan.decision(0, "a") == "recompute" and plan.decision(0, "x") == "keep"
    with pytest.raises(OffloadPlanError, match="pool view"):
        plan_offload(shape, RATES, forced={"x": "offload"})
    with pytest.raises(OffloadPlanError, match="forced h=recompute"):
        plan_offload(SHAPE, RATES, forced={"h": "recompute"})


def test_rates_and_shapes_are_validated():
    with pytest.raises(OffloadPlanError, match="Rates.d2h_gbps"):
        Rates(d2h_gbps=0, h2d_gbps=1)
    with pytest.raises(OffloadPlanError, match="Rates.k_copy"):
        Rates(d2h_gbps=1, h2d_gbps=1, k_copy=-1)
    with pytest.raises(OffloadPlanError, match="Rates.fc1_bwd_ms"):
        Rates(d2h_gbps=1, h2d_gbps=1, fc1_bwd_ms=-1.0)
    with pytest.raises(OffloadPlanError, match="MLPShape.grads='sometimes'; allowed: step | resident"):
        MLPShape(hidden=8, ffn_hidden=8, m=8, grads="sometimes")
    with pytest.raises(OffloadPlanError, match="max_added"):
        plan_offload(SHAPE, RATES, max_added=-0.1)
    with pytest.raises(OffloadPlanError, match="Rates.compute_scale"):
        Rates(d2h_gbps=1, h2d_gbps=1, compute_scale=0)


def test_calibration_scales_compute_to_the_measured_plain_step_and_leaves_the_copies_alone():
    shape = MLPShape(hidden=4096, ffn_hidden=14336, m=4096, num_layers=16)
    rates = Rates(**MEASURED, fc1_bwd_ms=3.0, fc2_bwd_ms=1.5, act_bwd_plain_ms=0.5, step_extra_ms=4.0)
    model = simulate(shape, rates, {}, 1).step_ms
    measured = model / 1.12   # pieces measured alone add up 12 % above the step they run in
    tuned = calibrate(shape, rates, measured)
    assert tuned.compute_scale == pytest.approx(1 / 1.12)
    assert simulate(shape, tuned, {}, 1).step_ms == pytest.approx(measured)
    t, t0 = layer_times(shape, tuned), layer_times(shape, rates)
    assert all(a == pytest.approx(b / 1.12) for a, b in zip(dataclasses.astuple(t), dataclasses.astuple(t0)))
    assert (tuned.d2h_gbps, tuned.h2d_gbps, tuned.k_copy, tuned.k_gemm) == (54, 54, 1.0, 1.0)
    # the first copy (an empty queue) lasts its bytes over the measured bandwidth, calibrated or not
    copy_ms = tensor_bytes(shape)["h"] / 54e9 * 1e3
    for r in (rates, tuned):
        saved, landed, *_ = simulate(shape, r, {(0, "h"): "offload"}, 1).windows[(0, "h")]
        assert landed - saved == pytest.approx(copy_ms)
    # calibrating twice on the same measurement changes nothing; a calibrated model calibrates from itself
    assert calibrate(shape, tuned, measured).compute_scale == pytest.approx(tuned.compute_scale)
    for bad in (0, -1.0, None):
        with pytest.raises(OffloadPlanError, match="measured_step_ms"):
            calibrate(shape, rates, bad)


def test_the_gemm_slows_by_the_k_of_the_copy_direction_it_overlaps():
    shape = MLPShape(hidden=4096, ffn_hidden=14336, m=4096, num_layers=4)
    one = {(0, "h"): "offload"}
    base = dict(MEASURED, k_gemm=1.1)
    same = simulate(shape, Rates(**base), one, 1).step_ms
    assert simulate(shape, Rates(**base, k_gemm_h2d=1.1), one, 1).step_ms == pytest.approx(same)
    keep = simulate(shape, Rates(**base), {}, 1).step_ms
    cheap_back = simulate(shape, Rates(**base, k_gemm_h2d=1.0), one, 1).step_ms
    cheap_out = simulate(shape, Rates(**dict(base, k_gemm=1.0), k_gemm_h2d=1.1), one, 1).step_ms
    # each direction's copy lasts about as long: each k accounts for part of the added time, both for all of it
    assert keep < cheap_back < same and keep < cheap_out < same
    assert (cheap_back - keep) + (cheap_out - keep) == pytest.approx(same - keep, rel=0.05)


def test_s_is_recomputed_where_the_engines_activation_is_faster_and_weighed_where_slower():
    shape = MLPShape(hidden=4096, ffn_hidden=14336, m=4096, num_layers=8, fused_activation=True)
    b = tensor_bytes(shape)
    # one kernel each way (CUDA, measured): faster than autograd's forward and backward
    fast = Rates(**MEASURED | dict(act_ms=0.12, act_bwd_ms=0.22), act_plain_ms=0.34, act_bwd_plain_ms=0.64)
    keep = simulate(shape, fast, {}, 1)
    plan = plan_offload(shape, fast, max_added=0.0, candidates=("s",))
    assert all(plan.decision(p, "s") == "recompute" for p in range(8))
    assert plan.step_ms == pytest.approx(keep.step_ms + 8 * (0.22 + 0.12 - 0.64 - 0.34))  # faster
    assert plan.act_peak_bytes <= keep.act_peak_bytes - 7 * b["s"]  # the top layer's s too: it is free
    row = next(r for r in plan.rows if r.tensor == "L3.s")
    assert row.recompute_ms == pytest.approx(0.22 + 0.12 - 0.64 - 0.34) and row.decision == "recompute"
    # the engine's activation unfused (CPU): slower than autograd's, so s costs time and a budget limits it
    slow = Rates(**MEASURED | dict(act_bwd_ms=0.89), act_plain_ms=0.378, act_bwd_plain_ms=0.70)
    unfused = dataclasses.replace(shape, fused_activation=False)
    assert plan_offload(unfused, slow, max_added=0.0, candidates=("s",)).added_ms == 0
    some = plan_offload(unfused, slow, max_added=0.01, candidates=("s",))
    n_rec = sum(d == "recompute" for _, _, d in some.decisions)
    assert 0 < n_rec < 8 and some.added_ms == pytest.approx(n_rec * 0.19)
    # s of a layer that already runs the engine's activation (h moved) saves nothing: never chosen with it
    both = plan_offload(shape, fast, forced={"h": "offload"}, candidates=("h", "s"))
    assert all(both.decision(p, "s") == "keep" for p in range(8))
    gelu = MLPShape(hidden=64, ffn_hidden=96, m=16, activation="gelu")
    with pytest.raises(OffloadPlanError, match="only swiglu saves"):
        plan_offload(gelu, fast, forced={"s": "recompute"})


def test_the_fused_activation_allocates_no_temporary():
    rates = Rates(**MEASURED)
    shape = MLPShape(hidden=4096, ffn_hidden=14336, m=4096, num_layers=1, grads="resident")
    lean = {(0, "s"): "recompute"}
    unfused = simulate(shape, rates, lean, 1)
    fused = simulate(dataclasses.replace(shape, fused_activation=True), rates, lean, 1)
    assert fused.step_ms == unfused.step_ms and fused.peak_bytes <= unfused.peak_bytes
    # the plain stack allocates what autograd allocates either way
    assert simulate(dataclasses.replace(shape, fused_activation=True), rates, {}, 1).peak_bytes == \
        simulate(shape, rates, {}, 1).peak_bytes
