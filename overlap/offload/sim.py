"""The step model behind the offload planner: shapes, measured rates, and a simulation of one training step.

A stack of L TP MLPs, forward 0..L-1 then backward L-1..0, on one compute stream with one device-to-host
and one host-to-device copy queue (see overlap/offload/planner.py for how the planner uses it). Pure functions:
no torch, no device.

Time: the pieces of a layer (measured, or derived from the GEMM rate and HBM bandwidth; times
`Rates.compute_scale`, see `calibrate`) run one after the other; a GEMM's time also grows with the GPU's
heat (its power limit, overlap/offload/power.py: back-to-back GEMMs heat it, memory-bound kernels hold it,
stalls cool it). A GEMM that runs while a copy queue is busy takes k_gemm (k_gemm_h2d under a host-to-device
copy) times longer for the overlapping part (k below 1 is measurement noise: copies never speed a GEMM up).
A device-to-host copy starts when its tensor is complete (the op that saves it has run: x after fc1, h
after the activation, a after fc2) and its queue is free, and lasts bytes / bandwidth, k_copy times longer
for the part that runs beside a GEMM (the queue behind it moves back as much). Its device memory is
released at the first later save point the copy has landed by (plus a margin), else at the start of
backward, which waits for it. Backward of layer p
brings back the offloaded tensors of layers p..p-depth; a tensor's unpack waits for its copy.

Memory: every device tensor the step allocates, in program order (the op sequence of
`launch/measure/bench_mlp.py`'s BenchMLP, which is TPMLP's at W = 1; the engine's activation in layers that move h or
a, autograd's in the others): saved tensors while
resident, the layer output, the activation's temporary, the backward's da, dh, dx and its temporaries,
prefetch buffers, and the weight gradients. `MLPShape.grads` says when the gradients exist:
"step" (torch's `zero_grad(set_to_none=True)`: each layer's backward allocates them, held to the end of the
step) or "resident" (held across the step, e.g. accumulated over micro-batches: counted in `fixed_bytes`,
the backward only adds a transient). `fixed_bytes` is what exists before the step starts (weights, inputs,
optimizer state, resident gradients). Two peaks come out: `peak_bytes` in the shape's mode, and
`act_peak_bytes`, the peak of everything but weights, gradients and inputs (the "resident" count).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from ._step_inputs import (RELEASE_MARGIN, SAVE_POINTS_PER_LAYER, MLPShape, OffloadPlanError, Rates, grad_bytes,
                      layer_times, tensor_bytes)
from ..config.offload import CANDIDATES
from .power import Heat

__all__: list[str] = []  # the planner re-exports what others use

@dataclass(frozen=True)
class SimResult:
    step_ms: float
    peak_bytes: int           # fixed_bytes + the step's peak in the shape's grads mode
    act_peak_bytes: int       # the peak without weights, gradients and inputs (grads "resident")
    boundary_bytes: int       # allocated by the step at the start of backward (releases and first prefetch done)
    moved_bytes: int
    release_at: dict          # (layer, tensor) -> save-point index of its release, or -1: start of backward
    stall_ms: float
    at_peak: frozenset        # (layer, tensor) resident on the device at the peak
    windows: dict             # offloaded (layer, tensor) -> (saved, landed, released, fetched, needed) in ms
    peak_where: str           # "forward L<p>" | "backward L<p>": where the peak (shape's mode) is reached


class _Queue:
    """One copy engine: FIFO busy spans [start, end, key] in time order, how much of an interval they
    cover, and their stretch under a GEMM (k_copy applies only while a GEMM runs beside the copy)."""

    def __init__(self, k_copy: float, done: dict):
        self.spans: list = []
        self.free_at = 0.0
        self._first = 0
        self.k, self.done = k_copy, done  # done: key -> end of its span, kept up to date

    def issue(self, ready: float, ms: float, key) -> float:
        start = max(ready, self.free_at)
        self.free_at = start + ms
        self.spans.append([start, self.free_at, key])
        self.done[key] = self.free_at
        return self.free_at

    def _from(self, a: float) -> int:
        spans, i = self.spans, self._first
        while i < len(spans) and spans[i][1] <= a:
            i += 1
        self._first = i
        return i

    def covered(self, a: float, b: float) -> float:
        spans, i = self.spans, self._from(a)
        total = 0.0
        while i < len(spans) and spans[i][0] < b:
            total += min(b, spans[i][1]) - max(a, spans[i][0])
            i += 1
        return total

    def under_gemm(self, a: float, b: float) -> None:
        """A GEMM ran over [a, b]: the copies beside it progressed at 1/k of their speed for that part (k as
        measured: a copy wholly beside GEMMs takes k times longer), and the queue behind them starts later."""
        if self.k <= 1.0:
            return
        prev_end = -math.inf
        for span in self.spans[self._from(a):]:
            start, end = span[0], span[1]
            if start >= b and prev_end <= start:
                break                          # past the GEMM and not pushed back: the rest stays
            new_start = max(start, prev_end)
            span[0], span[1] = new_start, self._end(new_start, end - start, a, b)
            self.done[span[2]] = prev_end = span[1]
        self.free_at = max(self.free_at, prev_end)

    def _end(self, start: float, ms: float, a: float, b: float) -> float:
        """When a copy of `ms` (at full speed) that starts at `start` ends, slowed k times inside [a, b]."""
        if start >= b or start + ms <= a:
            return start + ms
        before = max(0.0, a - start)
        inside_from, rest = max(start, a), ms - before
        room = (b - inside_from) / self.k     # full-speed work done inside [a, b]
        return inside_from + rest * self.k if rest <= room else b + rest - room


def simulate(shape: MLPShape, rates: Rates, decisions: dict, depth: int, *, fixed_bytes: int = 0,
             pacing_offset: int = 0) -> SimResult:
    """One step under `decisions` {(layer, tensor): keep|offload|recompute} (missing: keep).

    A layer that moves h or a, or recomputes s, runs the engine's activation, which saves h only (its
    forward takes `act_ms`, its backward `act_bwd_ms`; with `shape.fused_activation` neither allocates an
    [M, F] temporary). The others run autograd's, as the stack without the engine does (swiglu also saves
    s = silu(gate); forward `act_plain_ms`, backward `act_bwd_plain_ms` with its own temporaries). Keeping
    everything is the plain stack."""
    return _Step(shape, rates, decisions, depth, pacing_offset).run(fixed_bytes)


def calibrate(shape: MLPShape, rates: Rates, measured_step_ms: float) -> Rates:
    """`rates` with compute_scale set so that the step without moves (the plain stack) comes out at
    `measured_step_ms`, that step measured at the same point: every compute term scales, copies keep their
    measured bandwidth."""
    if not (isinstance(measured_step_ms, (int, float)) and measured_step_ms > 0):
        raise OffloadPlanError(f"calibrate: measured_step_ms={measured_step_ms!r}; allowed: a positive number")
    for _ in range(8):  # the GEMMs' heat depends on their times: a few rounds settle it
        ratio = measured_step_ms / simulate(shape, rates, {}, 1).step_ms
        rates = dataclasses.replace(rates, compute_scale=rates.compute_scale * ratio)
        if abs(ratio - 1.0) < 1e-6:
            break
    return rates


class _Step:
    def __init__(self, shape, rates, decisions, depth, pacing_offset):
        self.L, self.t, self.b = shape.num_layers, layer_times(shape, rates), tensor_bytes(shape)
        if shape.gathered_is_view:
            self.b["x"] = 0
        self.swiglu, self.grads = shape.activation == "swiglu", shape.grads
        self.temporary = self.swiglu and not shape.fused_activation  # the engine's swiglu's [M, F] scratch
        self.out = shape.m * shape.hidden * shape.dtype_bytes // shape.world_size  # a layer's output, dx
        self.dw = grad_bytes(shape)
        self.dec = {k: v for k, v in decisions.items() if v != "keep"}
        self.depth, self.offset = depth, pacing_offset
        kc = max(1.0, rates.k_copy)
        self.kg = max(1.0, rates.k_gemm)
        self.kg_h2d = max(1.0, rates.k_gemm_h2d if rates.k_gemm_h2d is not None else rates.k_gemm)
        self.d2h_ms = {n: self.b[n] / (rates.d2h_gbps * 1e9) * 1e3 for n in CANDIDATES}
        self.h2d_ms = {n: self.b[n] / (rates.h2d_gbps * 1e9) * 1e3 for n in CANDIDATES}
        self.landed, self.fetched_done = {}, {}
        self.d2h, self.h2d = _Queue(kc, self.landed), _Queue(kc, self.fetched_done)
        self.now = self.stall = 0.0
        self.heat = Heat(rates.gemm_heat, rates.heat_ms, rates.cool_ms, rates.mem_heat)
        self.run_step = self.run_res = self.peak_step = self.peak_res = 0
        self.where = self.where_step = self.where_res = ""
        self.i_step = self.i_res = 0
        self.keyed: list = []     # ((layer, tensor), allocated?): the saved tensors' events, in order

    # ----- memory and time primitives
    def _add(self, step: int, resident: int, key=None):
        self.run_step += step
        self.run_res += resident
        if key is not None:
            self.keyed.append((key, step > 0))
        if self.run_step > self.peak_step:
            self.peak_step, self.where_step, self.i_step = self.run_step, self.where, len(self.keyed)
        if self.run_res > self.peak_res:
            self.peak_res, self.where_res, self.i_res = self.run_res, self.where, len(self.keyed)

    def alloc(self, nbytes, key=None):
        self._add(nbytes, nbytes, key)

    def free(self, nbytes, key=None):
        self._add(-nbytes, -nbytes, key)

    def grad(self, nbytes):
        self._add(nbytes, nbytes)   # "step": held to the end of the step; "resident": until grad_done

    def grad_done(self, nbytes):
        self._add(0, -nbytes)       # accumulated into the resident gradient, then freed

    def gemm(self, ms):
        ms = self.heat.gemm(ms)
        end = self.now + ms
        out, back = self.d2h.covered(self.now, end), self.h2d.covered(self.now, end)
        both = max(1.0, (out + back) / ms) if ms > 0 else 1.0  # both queues busy: one slowdown at a time
        self.now = end + ((self.kg - 1.0) * out + (self.kg_h2d - 1.0) * back) / both
        if out:
            self.d2h.under_gemm(end - ms, self.now)
        if back:
            self.h2d.under_gemm(end - ms, self.now)

    def memory_bound(self, ms):
        self.heat.memory_bound(ms)
        self.now += ms

    def wait_until(self, t):
        """The compute stream idles until t (a copy it needs); the GPU cools meanwhile."""
        if t > self.now:
            self.stall += t - self.now
            self.heat.idle(t - self.now)
            self.now = t

    def d(self, p, n):
        return self.dec.get((p, n), "keep")

    def lean(self, p):
        """Whether layer p runs the engine's activation (saves h only): it moves h or a, or recomputes s."""
        return self.d(p, "h") != "keep" or self.d(p, "a") != "keep" or self.d(p, "s") != "keep"

    # ----- the step
    def run(self, fixed_bytes) -> SimResult:
        self.saved_at, self.release, self.release_at = {}, {}, {}
        self.deferred = []  # (due save point, key)
        self.pending = []   # offloaded, not yet released
        for p in range(self.L):
            self.forward(p)
        self.backward_begins()
        self.needed, self.issued = {}, set()
        self.boundary = None
        for p in reversed(range(self.L)):
            self.backward(p)
        self.free(self.out)  # the stack's output, held by the caller through backward
        self.memory_bound(self.t.extra)
        return self.result(fixed_bytes)

    def save_point(self, k):
        if self.pending:
            done = [key for key in self.pending if self.now >= self.landed[key] + RELEASE_MARGIN * self.d2h_ms[key[1]]]
            for key in done:
                self.pending.remove(key)
                self.release[key], self.release_at[key] = self.now, k
                self.free(self.b[key[1]], key)
        if self.deferred:
            for due, key in [d for d in self.deferred if d[0] <= k]:
                self.deferred.remove((due, key))
                self.copy_out(key)

    def copy_out(self, key):
        self.d2h.issue(self.now, self.d2h_ms[key[1]], key)
        self.pending.append(key)

    def saved(self, p, n, k):
        """(p, n) was packed after its op ran: offloaded ones start their copy (or wait for their phase)."""
        self.saved_at[(p, n)] = self.now
        if self.d(p, n) == "offload":
            if self.offset:
                self.deferred.append((min(k + self.offset, SAVE_POINTS_PER_LAYER * self.L), (p, n)))
            else:
                self.copy_out((p, n))

    def forward(self, p):
        b, t, k = self.b, self.t, SAVE_POINTS_PER_LAYER * p
        self.where = f"forward L{p}"
        self.save_point(k)
        self.alloc(b["x"], (p, "x"))          # the gathered copy the column layer saves
        self.alloc(b["h"], (p, "h"))
        self.gemm(t.fc1)
        self.saved(p, "x", k)
        self.save_point(k + 1)
        lean = self.lean(p)
        if self.swiglu and not lean:          # autograd's: silu(gate), kept for mul's backward, then a
            self.alloc(b["s"], (p, "s"))
        elif self.temporary:                  # the engine's unfused: silu(gate) lives until a is made
            self.alloc(b["a"])
        self.alloc(b["a"], (p, "a"))
        if self.temporary and lean:
            self.free(b["a"])
        self.memory_bound(t.act if lean else t.act_plain)
        self.saved(p, "h", k + 1)
        self.save_point(k + 2)
        self.alloc(self.out)
        self.gemm(t.fc2)
        self.saved(p, "a", k + 2)
        if p:
            self.free(self.out)               # the previous layer's output, this layer's input
        if self.d(p, "a") == "recompute":
            self.free(b["a"], (p, "a"))       # only fc2's forward needed it

    def backward_begins(self):
        for _, key in self.deferred:
            self.copy_out(key)
        self.deferred = []
        self.where = f"backward L{self.L - 1}"
        unreleased, self.pending = self.pending, []
        if unreleased:
            self.wait_until(max(self.landed[key] for key in unreleased))
            for key in unreleased:
                self.release[key], self.release_at[key] = self.now, -1
                self.free(self.b[key[1]], key)

    def need(self, p, n):
        self.needed.setdefault((p, n), self.now)
        if self.d(p, n) == "offload":
            self.wait_until(self.fetched_done[(p, n)])

    def backward(self, p):
        b, t, L = self.b, self.t, self.L
        self.where = f"backward L{p}"
        b0 = self.now
        for q in range(p, p - self.depth - 1, -1):
            if q >= 0 and q not in self.issued:
                self.issued.add(q)
                for n in ("a", "h", "x"):     # the order backward needs them in
                    if self.d(q, n) == "offload":
                        self.alloc(b[n], (q, n))
                        ready = max(b0, self.landed[(q, n)])
                        self.h2d.issue(ready, self.h2d_ms[n], (q, n))
        if self.boundary is None:
            self.boundary = self.run_step
        dw1, dw2 = self.dw
        # fc2's backward: a (kept, fetched or recomputed from h), da, dw2
        if self.d(p, "a") == "recompute":
            self.need(p, "h")
            if self.temporary:
                self.alloc(b["a"])
            self.alloc(b["a"], (p, "a"))
            if self.temporary:
                self.free(b["a"])
            self.memory_bound(t.recompute)
        else:
            self.need(p, "a")
        self.alloc(b["a"])                    # da
        self.gemm(t.fc2_bwd / 2)
        self.grad(dw2)
        self.gemm(t.fc2_bwd / 2)
        self.free(b["a"], (p, "a"))
        if p < L - 1:
            self.free(self.out)               # this layer's output grad: the next layer's dx
        self.grad_done(dw2)
        if self.swiglu and not self.lean(p):
            self.plain_act_backward(p)
        else:                                 # dh (and one [M, F] scratch unfused), then h and da go
            self.need(p, "h")
            self.alloc(b["h"])
            if self.temporary:
                self.alloc(b["a"])
                self.free(b["a"])
            self.memory_bound(t.act_bwd if self.lean(p) else t.act_bwd_plain)  # gelu: h only either way
            self.free(b["h"], (p, "h"))
            self.free(b["a"])                 # da
        # fc1's backward: x, dx, dw1
        self.need(p, "x")
        self.alloc(self.out)                  # dx
        self.gemm(t.fc1_bwd / 2)
        self.grad(dw1)
        self.gemm(t.fc1_bwd / 2)
        self.free(b["x"], (p, "x"))
        self.free(b["h"])                     # dh
        self.grad_done(dw1)
        if p == 0:
            self.free(self.out)               # the stack input's grad: nobody takes it here

    def plain_act_backward(self, p):
        """autograd's silu(gate) * up: mul's grads, silu's, then split's (a new dh) once h is gone."""
        f = self.b["a"]
        self.alloc(f)                         # d up = da * silu(gate)
        self.alloc(f)                         # d silu = da * up
        self.free(f)                          # da
        self.free(f, (p, "s"))                # silu(gate), saved by mul
        self.alloc(f)                         # d gate = silu_backward(d silu, gate)
        self.free(f)                          # d silu
        self.free(self.b["h"], (p, "h"))      # gate and up, views of h, were the last holders
        self.alloc(self.b["h"])               # dh = cat(d gate, d up)
        self.free(f)
        self.free(f)
        self.memory_bound(self.t.act_bwd_plain)

    def result(self, fixed_bytes) -> SimResult:
        step = self.grads == "step"
        peak, upto, where = ((self.peak_step, self.i_step, self.where_step) if step else
                             (self.peak_res, self.i_res, self.where_res))
        live: dict = {}
        for key, allocated in self.keyed[:upto]:
            live[key] = live.get(key, 0) + (1 if allocated else -1)
        at_peak = frozenset(k for k, v in live.items() if v > 0 and self.b[k[1]] > 0)
        moved = sum(self.b[n] for (p, n), d in self.dec.items() if d == "offload")
        windows = {key: (self.saved_at[key], self.landed[key], self.release[key], self.fetched_done[key],
                         self.needed.get(key, self.now)) for key in self.landed if key in self.fetched_done}
        return SimResult(self.now, fixed_bytes + peak, self.peak_res, self.boundary or 0, moved, self.release_at,
                         self.stall, at_peak, windows, where)
