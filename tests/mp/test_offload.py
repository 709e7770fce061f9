"""Activation offload on CPU ranks (gloo, real processes) with the real TPMLP stack.

Every check compares against the same stack without offload, bitwise: the offload path only moves bytes
and recomputes with the same ops. Host slots are poisoned between steps, data is fresh every step, M
changes between steps, and one check proves the restored tensors really came through the host slots.
"""

import dataclasses

import pytest
import torch
import torch._dynamo  # noqa: F401  before init_process_group in the children (see launch/cli/dist.py)
import torch.distributed as dist

from tp_overlap.offload.host_pool import HostPool, HostSlot, SlotInUseError, StaleSlotError, live_host_pool_count
from tp_overlap.ops.layers import TPMLP, pool_requirements
from tp_overlap.offload.engine import OffloadEngine, disable_offload, enable_offload, host_bytes
from tp_overlap.offload.planner import MLPShape, Rates, pacing_offset, plan_offload
from tests.multiproc import run_ranks

HIDDEN, FFN, LAYERS = 24, 40, 3
ROWS = (9, 5, 9)                    # rows per rank, step by step: M changes, the largest first and last
RATES = Rates(d2h_gbps=1.0, h2d_gbps=1.0, gemm_tflops=1e-4, hbm_gbps=1.0)  # CPU-scale, synthetic
POISON = float("nan")


def _stack(world, dtype, activation, *, overlap=False, pool=None, save_gathered="view", seed=0):
    torch.manual_seed(seed)
    kwargs = dict(group=dist.group.WORLD, max_m=ROWS[0] * world, dtype=dtype, overlap=overlap,
                  save_gathered=save_gathered)
    if overlap:
        from tp_overlap.config.presets import load_preset
        kwargs.update(pool=pool, config=load_preset("cpu", world))
    return [TPMLP(HIDDEN, FFN, activation=activation, name=f"mlp{seed}.{i}", **kwargs) for i in range(LAYERS)]


def _copy_weights(dst, src):
    with torch.no_grad():
        for a, b in zip(dst, src):
            for pa, pb in zip(a.parameters(), b.parameters()):
                pa.copy_(pb)


def _step(mlps, x, dy):
    for m in mlps:
        m.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_(True)
    y = x
    for m in mlps:
        y = m(y)
    y.backward(dy)
    return [y.detach(), x.grad] + [p.grad.clone() for m in mlps for p in m.parameters()]


def _data(step, rows, dtype, rank):
    gen = torch.Generator().manual_seed(1000 * step + rank)
    return (torch.randn(rows, HIDDEN, generator=gen).to(dtype), torch.randn(rows, HIDDEN, generator=gen).to(dtype))


def _poison(pool):
    for slot in pool._slots.values():
        slot.view((slot.nbytes // 4,), torch.float32).fill_(POISON)


def _plans(world, dtype, activation, gathered_is_view):
    shape = MLPShape(hidden=HIDDEN, ffn_hidden=FFN, m=ROWS[0] * world, activation=activation, world_size=world,
                     dtype_bytes=dtype.itemsize, num_layers=LAYERS, gathered_is_view=gathered_is_view)
    everything = {"h": "offload", "a": "offload"} | ({} if gathered_is_view else {"x": "offload"})
    resident = dataclasses.replace(shape, grads="resident")
    return {
        "offload_all": plan_offload(shape, RATES, forced=everything),
        "recompute_a": plan_offload(shape, RATES, forced={"h": "offload", "a": "recompute"} |
                                    ({} if gathered_is_view else {"x": "offload"})),
        "auto": plan_offload(shape, RATES),
        # gradients held across the step: the peak is the activations', which a budget can cut
        "tight": plan_offload(resident, RATES, budget_bytes=plan_offload(resident, RATES).keep_peak_bytes * 3 // 4),
        "depth2": plan_offload(shape, RATES, forced=everything, prefetch_depth=2),
    }


def _bitwise_equal_to_plain(rank, world, dtype_name, activation, overlap, save_gathered):
    torch.set_num_threads(1)
    dtype = getattr(torch, dtype_name)
    view = overlap and save_gathered == "view"
    pool_ctx = None
    if overlap:
        from tp_overlap.symm_mem.pool import SymmetricPool
        req = pool_requirements(hidden=HIDDEN, max_m=ROWS[0] * world, world_size=world, dtype=dtype)
        pool_ctx = SymmetricPool(2 * LAYERS * req.size_bytes, group=dist.group.WORLD,
                                 num_signal_words=2 * LAYERS * req.num_signal_words,
                                 num_device_words=2 * LAYERS * req.num_device_words)
    plain = _stack(world, dtype, activation, overlap=overlap, pool=pool_ctx, save_gathered=save_gathered, seed=1)
    ours = _stack(world, dtype, activation, overlap=overlap, pool=pool_ctx, save_gathered=save_gathered, seed=2)
    _copy_weights(ours, plain)
    report = {}
    for name, plan in _plans(world, dtype, activation, view).items():
        with HostPool(host_bytes(plan)) as host:
            engine = enable_offload(ours, plan, pool=host)
            for step, rows in enumerate(ROWS):
                x, dy = _data(step, rows, dtype, rank)
                want, got = _step(plain, x, dy), _step(ours, x, dy)
                if not all(torch.equal(a, b) for a, b in zip(want, got)):
                    raise AssertionError(f"{name} step {step}: not bitwise equal to the plain stack")
                _poison(host)  # a stale slot would now hand NaNs to the next step
            report[name] = dict(engine.stats())
            report[name]["decisions"] = sorted({d for _, _, d in plan.decisions})
            disable_offload(ours)
            engine.close()
    for m in plain + ours:
        m.close()
    if pool_ctx is not None:
        pool_ctx.barrier()
        pool_ctx.close()
    return report, live_host_pool_count()


CASES = [("float32", "swiglu", False, "view"), ("bfloat16", "gelu", False, "view"),
         ("float32", "swiglu", True, "view"), ("bfloat16", "swiglu", True, "copy")]


def _two_rank_checks(rank, world):
    """Every two-rank check in one spawn (spawning costs seconds on a 2-core machine); a failing check
    returns its error, so the others still report."""
    import traceback
    out = {}
    for name, fn, args in ([(case, _bitwise_equal_to_plain, case) for case in CASES] +
                           [("saved", _saved_tensors_come_back_exactly, ()), ("paced", _paced, ()),
                            ("report", _tp_mlp_report, ())]):
        try:
            out[name] = fn(rank, world, *args)
        except Exception as exc:
            out[name] = f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"
    return out


@pytest.fixture(scope="module")
def two_ranks():
    return run_ranks(_two_rank_checks, 2, timeout_s=300)


def _result(two_ranks, name):
    values = [by_name[name] for by_name in two_ranks]
    for value in values:
        assert not isinstance(value, str), value
    return values


@pytest.mark.parametrize("case", CASES, ids=["-".join(map(str, c)) for c in CASES])
def test_offloaded_stack_is_bitwise_equal_to_the_plain_one_over_steps_with_changing_m(two_ranks, case):
    _, _, overlap, save_gathered = case
    for report, live in _result(two_ranks, case):
        assert live == 0
        full = report["offload_all"]
        moved = 2 if overlap and save_gathered == "view" else 3  # x is a pool view there: never moved
        assert full["offloaded"] == moved * LAYERS * len(ROWS), full
        assert full["unmatched"] == 0 and full["demand_fetches"] == 0 and full["slots_in_use"] == 0, full
        assert full["d2h_bytes"] == full["h2d_bytes"] > 0
        assert report["recompute_a"]["recomputed"] == LAYERS * len(ROWS)
        assert report["tight"]["offloaded"] + report["tight"]["recomputed"] > 0, report["tight"]
        assert report["depth2"]["prefetches"] == full["prefetches"], report["depth2"]


def _saved_tensors_come_back_exactly(rank, world):
    """Log every tensor handed to the engine and every tensor it gives back to autograd."""
    torch.set_num_threads(1)
    mlps = _stack(world, torch.float32, "swiglu")
    plan = _plans(world, torch.float32, "swiglu", False)["offload_all"]
    packed, unpacked = {}, []
    plain_pack, plain_unpack = OffloadEngine._pack, OffloadEngine._unpack

    def pack(self, layer, name, t):
        out = plain_pack(self, layer, name, t)
        packed[id(out)] = t.clone()
        return out

    def unpack(self, record):
        out = plain_unpack(self, record)
        unpacked.append((packed.get(id(record)), out))
        return out

    OffloadEngine._pack, OffloadEngine._unpack = pack, unpack
    try:
        with HostPool(host_bytes(plan)) as host:
            engine = enable_offload(mlps, plan, pool=host)
            x, dy = _data(0, ROWS[0], torch.float32, rank)
            _step(mlps, x, dy)
            num_packed = len(packed)
            equal = [torch.equal(ref, got) for ref, got in unpacked if ref is not None]
            # the restored tensors came through the slots: poisoning them between forward and backward shows
            x, dy = _data(1, ROWS[0], torch.float32, rank)
            xx = x.clone().requires_grad_(True)
            y = xx
            for m in mlps:
                y = m(y)
            _poison(host)
            y.backward(dy)
            poisoned = bool(torch.isnan(xx.grad).any())
            disable_offload(mlps)
            engine.close()
    finally:
        OffloadEngine._pack, OffloadEngine._unpack = plain_pack, plain_unpack
    return num_packed, equal, poisoned


def test_every_offloaded_tensor_comes_back_bit_exact_and_through_the_host_slots(two_ranks):
    for num_packed, equal, poisoned in _result(two_ranks, "saved"):
        assert num_packed == 3 * LAYERS and len(equal) == 3 * LAYERS and all(equal), equal
        assert poisoned, "poisoned slots did not reach the gradients: the data did not come from the host"


def _slot_reuse_is_caught(rank, world):
    torch.set_num_threads(1)
    mlps = _stack(world, torch.float32, "swiglu")
    plan = _plans(world, torch.float32, "swiglu", False)["offload_all"]
    out = {}
    with HostPool(host_bytes(plan)) as host:
        engine = enable_offload(mlps, plan, pool=host)
        x, _ = _data(0, ROWS[0], torch.float32, rank)
        y1 = mlps[0](x.clone().requires_grad_(True))
        try:  # a second forward while the first one's slots are held
            mlps[0](x.clone().requires_grad_(True))
            out["second_forward"] = "no error"
        except SlotInUseError as exc:
            out["second_forward"] = str(exc)
        del y1  # the graph is dropped: its records die and free their slots
        y2 = mlps[0](x.clone().requires_grad_(True))
        out["after_drop"] = "ok"
        # the guard switched off: a second forward rewrites the slots under the first graph, and the
        # generation check must refuse to hand its data to the first graph's backward
        plain_acquire = HostSlot.acquire

        def careless(slot, owner):
            slot.owner = None
            return plain_acquire(slot, owner)

        HostSlot.acquire = careless
        try:
            y3 = mlps[0](x.clone().requires_grad_(True))
            try:
                y2.sum().backward()
                out["stale"] = "no error"
            except StaleSlotError as exc:
                out["stale"] = str(exc)
            del y3
        finally:
            HostSlot.acquire = plain_acquire
        disable_offload(mlps)
        engine.close()
    return out


def _misuse(rank, world):
    """Misuse that must raise a clear error rather than save or return the wrong thing."""
    torch.set_num_threads(1)
    mlps = _stack(world, torch.float32, "swiglu")
    plan = _plans(world, torch.float32, "swiglu", False)["offload_all"]
    errors = {}

    def expect(name, fn):
        try:
            fn()
            errors[name] = "no error"
        except Exception as exc:
            errors[name] = f"{type(exc).__name__}: {exc}"

    small = plan_offload(MLPShape(hidden=HIDDEN, ffn_hidden=FFN, m=ROWS[1] * world, world_size=world,
                                  dtype_bytes=4, num_layers=LAYERS), RATES, forced={"h": "offload"})
    x = torch.randn(ROWS[0] * world, HIDDEN)
    with HostPool(host_bytes(plan) + host_bytes(small)) as host:
        expect("layers", lambda: enable_offload(mlps[:2], plan, pool=host))
        engine = enable_offload(mlps, small, pool=host, name="small")  # slots sized for M = 5 rows
        expect("m", lambda: mlps[0](x.clone().requires_grad_(True)))
        disable_offload(mlps)
        engine = enable_offload(mlps, plan, pool=host)
        with torch.no_grad():  # nothing is saved: the plain math, no slot touched
            errors["no_grad"] = bool(torch.equal(mlps[0](x), type(mlps[0]).forward(mlps[0], x)))
        errors["no_grad_slots"] = host.stats().slots_in_use
        engine.close()
        expect("closed", lambda: mlps[0](x.clone().requires_grad_(True)))
        disable_offload(mlps)
        errors["restored"] = "forward" not in mlps[0].__dict__
    return errors


def _hooked(rank, world):
    """The optional hook of TPMLP.forward (docs/API.md, ~4 lines in layers.py): engine set as an attribute."""
    class HookedMLP(TPMLP):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.offload = None

        def forward(self, x):
            if self.offload is not None:
                engine, position = self.offload
                return engine.forward(position, self, x)
            return super().forward(x)

    torch.manual_seed(5)
    kwargs = dict(group=dist.group.WORLD, max_m=ROWS[0] * world, dtype=torch.float32, overlap=False)
    hooked = [HookedMLP(HIDDEN, FFN, name=f"hk{i}", **kwargs) for i in range(LAYERS)]
    plain = _stack(world, torch.float32, "swiglu", seed=3)
    _copy_weights(hooked, plain)
    plan = _plans(world, torch.float32, "swiglu", False)["recompute_a"]
    with HostPool(host_bytes(plan)) as host:
        engine = enable_offload(hooked, plan, pool=host)
        set_by_attribute = all(m.offload == (engine, i) and "forward" not in m.__dict__ for i, m in enumerate(hooked))
        x, dy = _data(0, ROWS[0], torch.float32, rank)
        equal = all(torch.equal(a, b) for a, b in zip(_step(plain, x, dy), _step(hooked, x, dy)))
        offloaded = engine.stats()["offloaded"]
        disable_offload(hooked)
        engine.close()
    return set_by_attribute, equal, offloaded, all(m.offload is None for m in hooked)


def _one_rank_checks(rank, world):
    return _slot_reuse_is_caught(rank, world), _misuse(rank, world), _hooked(rank, world)


def test_a_slot_is_never_reused_while_held_and_a_reuse_is_detected_and_misuse_is_refused():
    for out, errors, hooked in run_ranks(_one_rank_checks, 1, timeout_s=120):
        assert hooked == (True, True, 2 * LAYERS, True), hooked  # x and h offloaded per layer, a recomputed
        assert "still held by" in out["second_forward"], out
        assert out["after_drop"] == "ok"
        assert "was rewritten" in out["stale"], out
        assert "the plan is for 3 layers, got 2 MLPs" in errors["layers"], errors
        assert "M=9 exceeds the plan's M=5" in errors["m"], errors
        assert errors["no_grad"] is True and errors["no_grad_slots"] == 0, errors
        assert "the engine is closed" in errors["closed"], errors
        assert errors["restored"] is True


def _paced(rank, world):
    torch.set_num_threads(1)
    plain, ours = _stack(world, torch.float32, "swiglu", seed=1), _stack(world, torch.float32, "swiglu", seed=2)
    _copy_weights(ours, plain)
    shape = MLPShape(hidden=HIDDEN, ffn_hidden=FFN, m=ROWS[0] * world, world_size=world, dtype_bytes=4,
                     num_layers=LAYERS)
    offset = pacing_offset("stagger", rank, world)
    plan = plan_offload(shape, RATES, forced={"x": "offload", "h": "offload", "a": "offload"},
                        pacing_offset=offset)
    with HostPool(host_bytes(plan)) as host:
        engine = enable_offload(ours, plan, pool=host)
        ok = True
        for step, rows in enumerate(ROWS):
            x, dy = _data(step, rows, torch.float32, rank)
            ok &= all(torch.equal(a, b) for a, b in zip(_step(plain, x, dy), _step(ours, x, dy)))
            _poison(host)
        stats = engine.stats()
        disable_offload(ours)
        engine.close()
    return offset, ok, stats


def test_staggered_pacing_offsets_ranks_and_stays_bitwise_equal(two_ranks):
    results = _result(two_ranks, "paced")
    assert [offset for offset, _, _ in results] == [0, 1]
    for offset, ok, stats in results:
        assert ok and stats["demand_fetches"] == 0 and stats["slots_in_use"] == 0, stats


def _tp_mlp_report(rank, world):
    """The fields launch.tp_mlp --offload adds to its row, for a forced list and for auto."""
    from tp_overlap.launch.cli.dist import DistContext
    from tp_overlap.launch.measure.offload_report import offload_report
    from tp_overlap.config.offload import parse_offload_arg

    torch.set_num_threads(1)
    ctx = DistContext(rank, world, torch.device("cpu"), dist.group.WORLD)
    mlp = _stack(world, torch.float32, "swiglu")[0]
    x, dy = _data(0, ROWS[0], torch.float32, rank)
    x.requires_grad_(True)
    rows = {arg: offload_report(ctx, mlp, x, dy, parse_offload_arg(arg), warmup=1, reps=2,
                                k_factors=lambda step: {"k_comm_probe": 1.0})
            for arg in ("h,a=recompute", "auto")}
    return {arg: {k: v for k, v in row.items() if k not in ("offload_host_pool", "offload_table")} |
            {"table_lines": len(row["offload_table"].splitlines())} for arg, row in rows.items()}


def test_tp_mlp_offload_report_has_both_steps_the_plan_and_k(two_ranks):
    for by_arg in _result(two_ranks, "report"):
        forced = by_arg["h,a=recompute"]
        assert forced["offload_plan"] == ["L0.x=keep", "L0.h=offload", "L0.a=recompute", "L0.s=keep"], forced
        assert forced["offload_engine"]["offloaded"] > 0 and forced["offload_engine"]["recomputed"] > 0
        assert forced["offload_engine"]["demand_fetches"] == 0
        for row in by_arg.values():
            assert row["t_step_offload_off_ms"] > 0 and row["t_step_offload_on_ms"] > 0
            assert row["offload_time_ratio"] > 0 and row["offload_d2h_gbps"] > 0
            assert row["k_comm_probe_offload_off"] == row["k_comm_probe_offload_on"] == 1.0
            assert row["table_lines"] == 2 + 4 + 1 and row["peak_offload_on_bytes"] is None  # CPU: no peak
