"""The engine's keep path does no per-tensor work: a kept tensor is saved by autograd as without the engine,
and a plan that moves nothing runs the very ops (and autograd nodes) of the stack without the engine.

    python -m tests.unit.test_offload_keep [steps]    # host time per step: none, the engine's activation
                                                      # without the engine, the engine keeping everything

The checks count the engine's Python calls (pack and unpack hooks, backward hooks) in a step, which is what
the host pays per tensor; the microbenchmark (not a test: host timings on a shared machine are noise) prints
what a step costs with and without the engine.
"""

import dataclasses
import statistics
import sys
import time

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tp_overlap.launch.measure.bench_mlp import BenchMLP
from tp_overlap.offload.activation import SavedInputActivation
from tp_overlap.offload.engine import OffloadEngine
from tp_overlap.offload.host_pool import HostPool
from tp_overlap.offload.planner import MLPShape, Rates, plan_offload

H, F, M, LAYERS = 64, 224, 16, 4
RATES = Rates(d2h_gbps=50, h2d_gbps=50)
KEEP = {"x": "keep", "h": "keep", "a": "keep", "s": "keep"}


def _stack():
    torch.manual_seed(0)
    return [BenchMLP(H, F, device="cpu", dtype=torch.float32) for _ in range(LAYERS)]


def _shape():
    return MLPShape(hidden=H, ffn_hidden=F, m=M, dtype_bytes=4, num_layers=LAYERS)


def _counting(monkeypatch):
    calls = {"pack": [], "unpack": 0, "backward_hooks": 0}
    pack, unpack, begins = OffloadEngine._pack, OffloadEngine._unpack, OffloadEngine._backward_begins

    def counted_pack(self, layer, name, t):
        calls["pack"].append((layer, name))
        return pack(self, layer, name, t)

    def counted_unpack(self, packed):
        calls["unpack"] += 1
        return unpack(self, packed)

    def counted_begins(self, layer):
        calls["backward_hooks"] += 1
        return begins(self, layer)

    monkeypatch.setattr(OffloadEngine, "_pack", counted_pack)
    monkeypatch.setattr(OffloadEngine, "_unpack", counted_unpack)
    monkeypatch.setattr(OffloadEngine, "_backward_begins", counted_begins)
    return calls


def _step(mlps, engine, x, dy):
    for m in mlps:
        m.zero_grad(set_to_none=True)
    y = x
    for i, m in enumerate(mlps):
        y = engine.forward(i, m, y)
    y.backward(dy)
    return [p.grad.clone() for m in mlps for p in m.parameters()]


def test_keeping_everything_calls_no_hook_and_matches_the_plain_stack(monkeypatch):
    calls = _counting(monkeypatch)
    mlps, x, dy = _stack(), torch.randn(M, H), torch.randn(M, H)
    for m in mlps:
        m.zero_grad(set_to_none=True)
    y = x
    for m in mlps:
        y = m(y)
    y.backward(dy)
    plain = [p.grad.clone() for m in mlps for p in m.parameters()]
    with HostPool(1 << 20, device="cpu") as pool:
        engine = OffloadEngine(plan_offload(_shape(), RATES, forced=KEEP), pool=pool)
        got = _step(mlps, engine, x, dy)
        assert calls == {"pack": [], "unpack": 0, "backward_hooks": 0}, calls
        assert engine.stats()["kept"] == 3 * LAYERS
        assert all(torch.equal(a, b) for a, b in zip(plain, got))


def test_only_the_ops_of_moved_tensors_are_hooked(monkeypatch):
    calls = _counting(monkeypatch)
    mlps, x, dy = _stack(), torch.randn(M, H), torch.randn(M, H)
    plan = plan_offload(_shape(), RATES, forced=KEEP)
    decisions = tuple((p, n, "offload" if (p, n) == (1, "h") else "recompute" if (p, n) == (2, "a") else d)
                      for p, n, d in plan.decisions)
    plan = dataclasses.replace(plan, decisions=decisions, release_at=((1, "h", -1),))
    with HostPool(1 << 20, device="cpu") as pool:
        engine = OffloadEngine(plan, pool=pool)
        _step(mlps, engine, x, dy)
    # the activation's op saves h only; fc2's op saves a and its weight (the weight goes through the hook)
    assert calls["pack"] == [(1, "h"), (2, "a")], calls
    # unpacked: h, fc2's weight, a (a recompute, which unpacks its source h: one call more)
    assert calls["unpack"] == 4 and calls["backward_hooks"] == LAYERS, calls


class _Ops(TorchDispatchMode):
    """Every ATen op that runs, by name, in order (forward, autograd's backward included)."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))


def _nodes(y):
    """The autograd graph under y, as node names in breadth-first order."""
    names, todo, seen = [], [y.grad_fn], set()
    while todo:
        node = todo.pop(0)
        if node is None or node in seen:
            continue
        seen.add(node)
        names.append(type(node).__name__)
        todo.extend(fn for fn, _ in node.next_functions)
    return names


def _traced(mlps, forward, x, dy):
    for m in mlps:
        m.zero_grad(set_to_none=True)
    with _Ops() as ops:
        y = x
        for i, m in enumerate(mlps):
            y = forward(i, m, y)
        nodes = _nodes(y)
        y.backward(dy)
    return ops.ops, nodes


@pytest.mark.parametrize("activation", ["swiglu", "gelu"])
def test_keeping_everything_runs_the_ops_and_nodes_of_the_plain_stack(activation):
    torch.manual_seed(0)
    mlps = [BenchMLP(H, F, activation=activation, device="cpu", dtype=torch.float32) for _ in range(LAYERS)]
    x, dy = torch.randn(M, H), torch.randn(M, H)
    plain_ops, plain_nodes = _traced(mlps, lambda i, m, y: m(y), x, dy)
    shape = MLPShape(hidden=H, ffn_hidden=F, m=M, dtype_bytes=4, num_layers=LAYERS, activation=activation)
    with HostPool(1 << 20, device="cpu") as pool:
        engine = OffloadEngine(plan_offload(shape, RATES, forced=KEEP), pool=pool)
        ops, nodes = _traced(mlps, engine.forward, x, dy)
    assert ops == plain_ops and nodes == plain_nodes, (ops, nodes)
    assert "SavedInputActivationBackward" not in nodes and ("SiluBackward0" in nodes) == (activation == "swiglu")
    # the check sees the engine's activation where a layer moves h: one node of its own per such layer
    plan = plan_offload(shape, RATES, forced=KEEP)
    plan = dataclasses.replace(plan, decisions=tuple((p, n, "recompute" if (p, n) == (1, "a") else d)
                                                     for p, n, d in plan.decisions))
    with HostPool(1 << 20, device="cpu") as pool:
        _, moved = _traced(mlps, OffloadEngine(plan, pool=pool).forward, x, dy)
    assert moved.count("SavedInputActivationBackward") == 1, moved



def test_recomputing_s_runs_the_engines_activation_with_the_plain_stacks_gradients():
    torch.manual_seed(0)
    mlps = _stack()
    x, dy = torch.randn(M, H), torch.randn(M, H)
    plan = plan_offload(_shape(), RATES, forced=KEEP)
    plan = dataclasses.replace(plan, decisions=tuple((p, n, "recompute" if n == "s" and p in (0, 2) else d)
                                                     for p, n, d in plan.decisions))

    def grads(forward):
        for p in (p for m in mlps for p in m.parameters()):
            p.grad = None
        x_req = x.clone().requires_grad_(True)
        y = x_req
        for i, m in enumerate(mlps):
            y = forward(i, m, y)
        y.backward(dy)
        return [x_req.grad] + [p.grad.clone() for m in mlps for p in m.parameters()]

    plain = grads(lambda i, m, y: m(y))
    with HostPool(1 << 20, device="cpu") as pool:
        engine = OffloadEngine(plan, pool=pool)
        _, nodes = _traced(mlps, engine.forward, x, dy)
        lean = grads(engine.forward)
        assert engine.stats()["kept"] == 2 * 3 * LAYERS  # two steps; s is not a saved tensor of the hooks
    assert nodes.count("SavedInputActivationBackward") == 2 and nodes.count("SiluBackward0") == LAYERS - 2
    assert all(torch.equal(a, b) for a, b in zip(lean, plain))


def microbenchmark(steps: int = 200, layers: int = 16) -> dict:
    """Median host microseconds per step of `layers` tiny MLPs (compute negligible), per variant."""
    torch.set_num_threads(1)
    mlps = [BenchMLP(H, F, device="cpu", dtype=torch.float32) for _ in range(layers)]
    params = [p for m in mlps for p in m.parameters()]
    x, dy = torch.randn(M, H), torch.randn(M, H)
    shape = MLPShape(hidden=H, ffn_hidden=F, m=M, dtype_bytes=4, num_layers=layers)
    with HostPool(1 << 20, device="cpu") as pool:
        engine = OffloadEngine(plan_offload(shape, RATES, forced=KEEP), pool=pool)
        forwards = {"none (plain module)": lambda i, m, y: m(y),
                    "engine's activation, no engine": lambda i, m, y: m.fc2(
                        SavedInputActivation.apply(m.fc1(y), m.activation)),
                    "engine keeping everything": engine.forward}
        times = {name: [] for name in forwards}
        for rep in range(steps + 3):
            for name, forward in forwards.items():
                t0 = time.perf_counter()
                for p in params:
                    p.grad = None
                y = x
                for i, m in enumerate(mlps):
                    y = forward(i, m, y)
                y.backward(dy)
                if rep >= 3:
                    times[name].append((time.perf_counter() - t0) * 1e6)
    return {name: statistics.median(v) for name, v in times.items()}


if __name__ == "__main__":
    result = microbenchmark(int(sys.argv[1]) if len(sys.argv) > 1 else 200)
    base = result["none (plain module)"]
    for name, us in result.items():
        print(f"{name:32s} {us:9.1f} us/step {us / 16:7.1f} us/layer {us - base:+8.1f} us/step vs none")
