"""Activation offload on one CUDA GPU: the CUDA path, eager and inside a CUDA graph. Prints PASS/FAIL/SKIP.

    python -m tests.gpu.check_offload      # exit status 1 if any check FAILs
    python -m tests.gpu.check_offload --cpu   # dry run of the device-independent checks on CPU

Checks (small shapes, bf16 and fp32, a stack of 3 MLPs; every comparison bitwise against the plain stack
on the same weights and data): the host pool is pinned and where its pages are; a 256 MB offload copy does
not block the host; eager steps with M changing, fresh data and poisoned slots, for several plans (all
offloaded, recompute, planner, prefetch depth 2, paced); the tensors handed back equal those saved; poisoned
slots between forward and backward reach the gradients (the data came through the host); no synchronising
CUDA call in a step (sync debug mode "error"); the step's peak and the activation peak of every variant
(plain stack, keep, recompute, offload all, planner) within 5 % of the step model's prediction; a CUDA
graph of a whole step replayed 20 times with fresh data and poisoned slots, then eager steps again; the
real TPMLP (custom ops) on a one-rank NCCL group.
"""

from __future__ import annotations

import os
import sys
import time
import traceback

import torch

from tp_overlap.launch.measure.bench_mlp import BenchMLP
from tp_overlap.launch.measure.offload_measure import peak_of
from tp_overlap.offload.engine import OffloadEngine, host_bytes
from tp_overlap.offload.host_pool import HostPool
from tp_overlap.offload.planner import MLPShape, Rates, plan_offload, simulate

H, F, LAYERS, ROWS = 512, 1536, 3, (1024, 512, 1024)
RATES = Rates(d2h_gbps=50, h2d_gbps=50, gemm_tflops=400, hbm_gbps=3000)
DEV = torch.device("cuda", 0)
CHECKS: list = []


def check(name):
    """Register a check (run by main, in order of definition)."""
    def wrap(fn):
        CHECKS.append((name, fn))
        return fn
    return wrap


class _Skip(Exception):
    pass


def _stack(dtype, activation="swiglu", seed=0):
    torch.manual_seed(seed)
    return [BenchMLP(H, F, activation=activation, device=DEV, dtype=dtype) for _ in range(LAYERS)]


def _same_weights(dst, src):
    with torch.no_grad():
        for a, b in zip(dst, src):
            for pa, pb in zip(a.parameters(), b.parameters()):
                pa.copy_(pb)


def _run(mlps, engine, x, dy, params):
    for p in params:
        p.grad = None
    y = x
    for i, m in enumerate(mlps):
        y = engine.forward(i, m, y) if engine is not None else m(y)
    y.backward(dy)
    return y


def _snapshot(y, params):
    return [y.detach().clone()] + [p.grad.clone() for p in params]


def _data(step, rows, dtype):
    gen = torch.Generator(DEV).manual_seed(100 + step)
    return (torch.randn(rows, H, generator=gen, device=DEV).to(dtype),
            torch.randn(rows, H, generator=gen, device=DEV).to(dtype))


def _cuda_only() -> None:
    if DEV.type != "cuda":
        raise _Skip("needs CUDA")


def _poison(pool):
    if DEV.type == "cuda":
        torch.cuda.synchronize()
    for slot in pool._slots.values():
        slot.view((slot.nbytes,), torch.uint8).fill_(0xFF)  # NaN in bf16 and fp32


def _plans(dtype, activation="swiglu"):
    shape = MLPShape(hidden=H, ffn_hidden=F, m=ROWS[0], activation=activation, dtype_bytes=dtype.itemsize,
                     num_layers=LAYERS, fused_activation=DEV.type == "cuda")
    everything = {"x": "offload", "h": "offload", "a": "offload"}
    lean = {"x": "keep", "h": "keep", "a": "keep", "s": "recompute"} if activation == "swiglu" else everything
    return {"offload_all": plan_offload(shape, RATES, forced=everything),
            "recompute_s": plan_offload(shape, RATES, forced=lean),
            "recompute": plan_offload(shape, RATES, forced={"x": "offload", "h": "offload", "a": "recompute"}),
            "planner": plan_offload(shape, RATES),
            "depth2": plan_offload(shape, RATES, forced=everything, prefetch_depth=2),
            "paced": plan_offload(shape, RATES, forced=everything, pacing_offset=1)}


@check("host pool pinned and placed")
def _pool():
    _cuda_only()
    with HostPool(64 << 20, device=DEV) as pool:
        s = pool.stats()
        if not (pool.pinned and pool._buffer.is_pinned()):
            raise AssertionError(f"not page-locked: {s}")
        wrong = s.numa_node is not None and any(n is not None and n != s.numa_node for n in s.page_nodes)
        return (f"node {s.numa_node} ({s.numa_source}); {s.placement}; pages on {s.page_nodes}"
                + (" -- WARNING: pages off the GPU's node" if wrong else ""))


@check("offload copy does not block the host")
def _async():
    _cuda_only()
    with HostPool(256 << 20, device=DEV) as pool:
        host = pool.slot("a", 256 << 20).view((256 << 20,), torch.uint8)
        dev = torch.randint(0, 255, (256 << 20,), dtype=torch.uint8, device=DEV)
        side = torch.cuda.Stream(priority=-1)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.cuda.stream(side):
            host.copy_(dev, non_blocking=True)
        enqueue_ms = (time.perf_counter() - t0) * 1e3
        torch.cuda.synchronize()
        copy_ms = (time.perf_counter() - t0) * 1e3
        if not torch.equal(host[:4096].cpu(), dev[:4096].cpu()) or enqueue_ms > 0.5 * copy_ms:
            raise AssertionError(f"enqueue {enqueue_ms:.2f} ms of a {copy_ms:.2f} ms copy")
        return f"enqueue {enqueue_ms:.3f} ms, copy {copy_ms:.2f} ms ({(256 << 20) / copy_ms / 1e6:.1f} GB/s)"


def _eager_case(dtype, activation):
    plain, ours = _stack(dtype, activation, 1), _stack(dtype, activation, 2)
    _same_weights(ours, plain)
    p_plain = [p for m in plain for p in m.parameters()]
    p_ours = [p for m in ours for p in m.parameters()]
    lines = []
    for name, plan in _plans(dtype, activation).items():
        with HostPool(host_bytes(plan), device=DEV) as pool:
            engine = OffloadEngine(plan, pool=pool)
            for step, rows in enumerate(ROWS):
                x, dy = _data(step, rows, dtype)
                want = _snapshot(_run(plain, None, x, dy, p_plain), p_plain)
                got = _snapshot(_run(ours, engine, x, dy, p_ours), p_ours)
                if not all(torch.equal(a, b) for a, b in zip(want, got)):
                    raise AssertionError(f"{name} step {step}: not bitwise equal to the plain stack")
                _poison(pool)
            s = engine.stats()
            if s["demand_fetches"] or s["slots_in_use"] or s["unmatched"]:
                raise AssertionError(f"{name}: {s}")
            lines.append(f"{name}: {s['offloaded']} offloaded, {s['recomputed']} recomputed")
            engine.close()
    return "; ".join(lines)


for _dtype, _act in ((torch.bfloat16, "swiglu"), (torch.float32, "swiglu"), (torch.bfloat16, "gelu")):
    check(f"eager steps bitwise equal ({str(_dtype)[6:]}, {_act})")(lambda d=_dtype, a=_act: _eager_case(d, a))


@check("tensors handed back equal those saved; poisoned slots reach the gradients")
def _roundtrip():
    mlps = _stack(torch.bfloat16)
    params = [p for m in mlps for p in m.parameters()]
    plan = _plans(torch.bfloat16)["offload_all"]
    saved, back = {}, []
    plain_pack, plain_unpack = OffloadEngine._pack, OffloadEngine._unpack

    def pack(self, layer, name, t):
        out = plain_pack(self, layer, name, t)
        saved[id(out)] = t.detach().clone()
        return out

    def unpack(self, record):
        out = plain_unpack(self, record)
        if id(record) in saved:
            back.append(torch.equal(saved[id(record)], out))
        return out

    OffloadEngine._pack, OffloadEngine._unpack = pack, unpack
    try:
        with HostPool(host_bytes(plan), device=DEV) as pool:
            engine = OffloadEngine(plan, pool=pool)
            x, dy = _data(0, ROWS[0], torch.bfloat16)
            _run(mlps, engine, x, dy, params)
            if len(back) != 3 * LAYERS or not all(back):
                raise AssertionError(f"{len(back)} tensors back, equal: {back}")
            checked = len(back)
            y = x
            for i, m in enumerate(mlps):
                y = engine.forward(i, m, y)
            _poison(pool)  # after the copies landed (synchronised), before backward reads them back
            y.backward(dy)
            if not any(torch.isnan(p.grad).any() for p in params):
                raise AssertionError("poisoned host slots did not reach the gradients")
            engine.close()
    finally:
        OffloadEngine._pack, OffloadEngine._unpack = plain_pack, plain_unpack
    return f"{checked} tensors"


@check("no synchronising CUDA call in an offloaded step")
def _no_sync():
    _cuda_only()
    mlps = _stack(torch.bfloat16)
    params = [p for m in mlps for p in m.parameters()]
    plan = _plans(torch.bfloat16)["recompute"]
    with HostPool(host_bytes(plan), device=DEV) as pool:
        engine = OffloadEngine(plan, pool=pool)
        x, dy = _data(0, ROWS[0], torch.bfloat16)
        _run(mlps, engine, x, dy, params)  # warm: allocator and kernels
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            _run(mlps, engine, x, dy, params)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize()
        engine.close()


@check("peaks as the step model predicts (within 5 %): every variant, grads dropped and held")
def _peaks():
    """What stays resident is what the plan predicts: the step's peak (grads allocated by backward) and the
    activation peak (grads held), each against the planner's step model, for the plain stack and every plan."""
    # CUDA: tensors of 16-56 MiB, so that the allocator's rounding stays small; CPU dry run: tiny
    dtype, h, f, rows, layers = (torch.bfloat16, 1024, 3584, 8192, 8) if DEV.type == "cuda" else \
        (torch.float32, 64, 224, 96, 6)
    shape = MLPShape(hidden=h, ffn_hidden=f, m=rows, num_layers=layers, dtype_bytes=dtype.itemsize,
                     fused_activation=DEV.type == "cuda")
    torch.manual_seed(0)
    mlps = [BenchMLP(h, f, device=DEV, dtype=dtype) for _ in range(layers)]
    params = [p for m in mlps for p in m.parameters()]
    x, dy = (torch.randn(rows, h, device=DEV).to(dtype) for _ in range(2))

    def drop():
        for p in params:
            p.grad = None

    def hold():
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)

    def step(engine, keep_grads):
        def run():
            if not keep_grads:
                drop()
            _run(mlps, engine, x, dy, [])
        return run

    keep = {"x": "keep", "h": "keep", "a": "keep", "s": "keep"}
    plans = {"keep": plan_offload(shape, RATES, forced=keep),
             "recompute": plan_offload(shape, RATES, forced=keep | {"a": "recompute"}),
             "recompute_s": plan_offload(shape, RATES, forced=keep | {"s": "recompute"}),
             "offload_all": plan_offload(shape, RATES, forced={"x": "offload", "h": "offload", "a": "offload"}),
             "planner": plan_offload(shape, RATES)}
    report, wrong = [], []
    with HostPool(max(host_bytes(p) for p in plans.values()), device=DEV) as pool:
        for name in ["none"] + list(plans):
            engine = OffloadEngine(plans[name], pool=pool) if name in plans else None
            above, before = peak_of(step(engine, False), DEV, prepare=drop)
            act = peak_of(step(engine, True), DEV, prepare=hold)[0]
            drop()
            pred = plans.get(name) or simulate(shape, RATES, {}, 1)
            got = (above, act)
            want = (pred.peak_bytes, pred.act_peak_bytes)  # the step's own bytes: fixed 0
            report.append(f"{name} {got[0] / 2**20:.0f}/{want[0] / 2**20:.0f} MiB, act {got[1] / 2**20:.0f}/"
                          f"{want[1] / 2**20:.0f} MiB")
            if any(abs(g / w - 1) > 0.05 for g, w in zip(got, want)):
                wrong.append(report[-1])
            if engine is not None:
                engine.close()
            pool.reset_slots()
    if wrong:
        raise AssertionError(f"measured/predicted off by more than 5 %: {wrong}; all: {report}")
    return "; ".join(report)


@check("CUDA graph of a whole step: 20 replays, fresh data, poisoned slots, then eager again")
def _graph():
    _cuda_only()
    dtype = torch.bfloat16
    plain, ours = _stack(dtype, seed=1), _stack(dtype, seed=2)
    _same_weights(ours, plain)
    p_plain = [p for m in plain for p in m.parameters()]
    p_ours = [p for m in ours for p in m.parameters()]
    shape = MLPShape(hidden=H, ffn_hidden=F, m=ROWS[0], num_layers=LAYERS, fused_activation=DEV.type == "cuda")
    plan = plan_offload(shape, RATES, forced={"x": "offload", "h": "offload", "a": "recompute"})
    with HostPool(host_bytes(plan), device=DEV) as pool:
        engine = OffloadEngine(plan, pool=pool)
        static_x, static_dy = (t.clone() for t in _data(0, ROWS[0], dtype))
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                _run(ours, engine, static_x, static_dy, p_ours)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        for p in p_ours:
            p.grad = None
        with torch.cuda.graph(graph):
            static_y = _run(ours, engine, static_x, static_dy, p_ours)
        for rep in range(20):
            x, dy = _data(1000 + rep, ROWS[0], dtype)
            static_x.copy_(x)
            static_dy.copy_(dy)
            _poison(pool)
            graph.replay()
            torch.cuda.synchronize()
            got = [static_y.detach().clone()] + [p.grad.clone() for p in p_ours]
            want = _snapshot(_run(plain, None, x, dy, p_plain), p_plain)
            if not all(torch.equal(a, b) for a, b in zip(want, got)):
                raise AssertionError(f"replay {rep}: not bitwise equal to the plain stack")
        for step in range(3):  # eager again on the same stream as the replays
            x, dy = _data(2000 + step, ROWS[step % 2], dtype)
            got = _snapshot(_run(ours, engine, x, dy, p_ours), p_ours)
            want = _snapshot(_run(plain, None, x, dy, p_plain), p_plain)
            if not all(torch.equal(a, b) for a, b in zip(want, got)):
                raise AssertionError(f"eager step {step} after replays: not bitwise equal")
        engine.close()
    return "20 replays and 3 eager steps bitwise equal"


@check("TPMLP (custom ops) on a one-rank NCCL group, eager")
def _tpmlp():
    import torch.distributed as dist
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29561")
    try:
        import torch._dynamo  # noqa: F401  (before the process group: see launch/cli/dist.py)
        if DEV.type == "cuda":
            dist.init_process_group("nccl", rank=0, world_size=1, device_id=DEV)
        else:
            dist.init_process_group("gloo", rank=0, world_size=1)
    except Exception as exc:
        raise _Skip(f"no one-rank process group here: {exc}")
    try:
        from tp_overlap.ops.layers import TPMLP
        from tp_overlap.offload.engine import disable_offload, enable_offload
        kwargs = dict(group=dist.group.WORLD, max_m=ROWS[0], dtype=torch.bfloat16, overlap=False, device=DEV)
        torch.manual_seed(3)
        plain = [TPMLP(H, F, name=f"p{i}", **kwargs) for i in range(LAYERS)]
        ours = [TPMLP(H, F, name=f"o{i}", **kwargs) for i in range(LAYERS)]
        _same_weights(ours, plain)
        plan = _plans(torch.bfloat16)["recompute"]
        with HostPool(host_bytes(plan), device=DEV) as pool:
            enable_offload(ours, plan, pool=pool)
            for step, rows in enumerate(ROWS):
                x, dy = _data(step, rows, torch.bfloat16)
                pp, po = [p for m in plain for p in m.parameters()], [p for m in ours for p in m.parameters()]
                want = _snapshot(_run(plain, None, x, dy, pp), pp)
                got = _snapshot(_run(ours, None, x, dy, po), po)
                if not all(torch.equal(a, b) for a, b in zip(want, got)):
                    raise AssertionError(f"step {step}: TPMLP with offload not bitwise equal")
                _poison(pool)
            disable_offload(ours)
        for m in plain + ours:
            m.close()
        return "3 steps bitwise equal"
    finally:
        dist.destroy_process_group()


def main(argv) -> int:
    global DEV
    if "--cpu" in argv:
        DEV = torch.device("cpu")
    elif not torch.cuda.is_available():
        print("SKIP all: no CUDA device (use --cpu for a dry run)")
        return 0
    results = []
    for name, fn in CHECKS:
        start = time.perf_counter()
        try:
            detail = fn()
            results.append(("PASS", name, detail or ""))
        except _Skip as exc:
            results.append(("SKIP", name, str(exc)))
        except Exception as exc:
            results.append(("FAIL", name, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()[-2500:]}"))
        print(f"{results[-1][0]} {name} ({time.perf_counter() - start:.1f} s): {results[-1][2]}", flush=True)
    failed = [r for r in results if r[0] == "FAIL"]
    print(f"\n{len(results) - len(failed)} of {len(results)} checks passed or skipped"
          + (f"; FAILED: {', '.join(r[1] for r in failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
