"""The numbers the offload planner needs, measured on this machine (CUDA events; host clock on CPU).

* copy bandwidth each way between a device buffer and a pinned host slot, on a high-priority side stream
  (a backlog of the step's tensor sizes, as the step queues them);
* k of the copy under the step's GEMM and of the GEMM under copies (copy alone vs beside the GEMM, both
  started together behind a short device hold so that both are queued before either starts; each rep
  pairs the two runs next to each other);
* the GPU's heat: how the step's GEMM slows at the power limit, heats, cools and sits beside memory-bound
  kernels (`measure_heat`, fitted by overlap/offload/power.py);
* the layer's own times on a mostly cool GPU: fc1 (with the gathered copy the column layer makes) and fc2 forward,
  their backward (dgrad and wgrad), the engine's activation forward (= the cost of recomputing a) and
  backward, and the plain module's (autograd's swiglu) forward and backward;
* the optimizer step (time outside the layers), and the peak device bytes of a step (CUDA: the caching
  allocator's counters; CPU: `LiveBytes`).
On CPU the copies are memcpys and nothing runs concurrently: k is reported as 1.0, marked unmeasured.
"""

from __future__ import annotations

import statistics
import time

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from tp_overlap.offload.activation import SavedInputActivation, activation_forward, lean_activation_forward
from tp_overlap.offload.planner import Rates
from tp_overlap.offload.power import NO_HEAT, fit_heat

HOLD_US = 2000            # device hold before a concurrent pair: both sides queued before either starts
SLEEP_CYCLES_PER_US = 2000


class LiveBytes(TorchDispatchMode):
    """Device bytes a stretch of code allocates and still holds, op by op: the CPU's max_memory_allocated.

        with LiveBytes() as live:
            ...; live.sample()      # bytes held now (also taken after every op)
        live.peak                   # the most held right after any op

    Counts the storage of every tensor an op creates (outputs that share an input's storage, views and
    in-place or out= results, are not new) while it is alive (weak references): what existed before, such
    as weights and inputs, is not counted. Autograd's backward runs its ops on this thread on CPU, so they
    count too. A temporary freed inside one op is invisible, as are copies into memory made elsewhere
    (the host pool)."""

    def __init__(self):
        super().__init__()
        self._live: dict = {}
        self.now = self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {StorageWeakRef(t.untyped_storage()).cdata for t in tree_flatten((args, kwargs))[0]
                  if isinstance(t, torch.Tensor)}
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                ref = StorageWeakRef(t.untyped_storage())
                held = self._live.get(ref.cdata)
                if ref.cdata not in inputs and (held is None or held[0].expired()):
                    self._live[ref.cdata] = (ref, t.untyped_storage().nbytes())
        self.sample()
        return out

    def sample(self) -> int:
        self._live = {k: v for k, v in self._live.items() if not v[0].expired()}
        self.now = sum(n for _, n in self._live.values())
        self.peak = max(self.peak, self.now)
        return self.now


class CopyRates(dict):
    """d2h_gbps, h2d_gbps (a backlog of the step's copies), k_copy_d2h, k_copy_h2d, k_gemm, copy_mb, backlog_mb,
    measured_concurrency."""


def _timed(fn, stream, reps: int, cuda: bool) -> list[float]:
    with torch.cuda.stream(stream) if cuda else _nothing():
        fn()  # warm-up: first-call costs (allocator, kernel selection) are not the steady state
    times = []
    for _ in range(reps):
        if cuda:
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(stream)
            with torch.cuda.stream(stream):
                fn()
            end.record(stream)
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return times


def _pair(gemm, gemm_times: int, copy, copy_times: int) -> tuple[float, float]:
    """(GEMM span, copy span) in ms with both started together on their own streams."""
    compute, side = torch.cuda.current_stream(), _side_stream()
    torch.cuda.synchronize()
    torch.cuda._sleep(HOLD_US * SLEEP_CYCLES_PER_US)
    go = torch.cuda.Event()
    go.record(compute)
    side.wait_event(go)
    marks = [torch.cuda.Event(enable_timing=True) for _ in range(4)]
    marks[0].record(compute)
    for _ in range(gemm_times):
        gemm()
    marks[1].record(compute)
    marks[2].record(side)
    with torch.cuda.stream(side):
        for _ in range(copy_times):
            copy()
    marks[3].record(side)
    torch.cuda.synchronize()
    return marks[0].elapsed_time(marks[1]), marks[2].elapsed_time(marks[3])


_SIDE = {}


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _side_stream() -> torch.cuda.Stream:
    device = torch.cuda.current_device()
    if device not in _SIDE:
        _SIDE[device] = torch.cuda.Stream(priority=-1)
    return _SIDE[device]


def _backlog(dst: torch.Tensor, src: torch.Tensor, sizes: list[int], cuda: bool):
    """Copies of the first `size` bytes of src into dst for each size, twice over, queued back to back."""
    def run():
        for size in sizes + sizes:
            dst[:size].copy_(src[:size], non_blocking=cuda)
    return run


def measure_copies(host: torch.Tensor, device_buf: torch.Tensor, gemm=None, *, sizes: list[int] | None = None,
                   reps: int = 7) -> CopyRates:
    """Copy `host` <-> `device_buf` (uint8, same bytes; host pinned on CUDA) alone, and beside `gemm()` (a
    callable running the step's largest GEMM on the current stream). The bandwidth is a backlog's: copies
    of `sizes` bytes (the step's tensors, capped at the buffer; default the buffer) queued back to back,
    as the step queues them; k compares one buffer-sized copy beside the GEMM with the same copy alone."""
    cuda = device_buf.is_cuda
    nbytes = device_buf.numel() * device_buf.element_size()
    sizes = [min(int(s), nbytes) for s in (sizes or [nbytes]) if s > 0] or [nbytes]
    stream = _side_stream() if cuda else None
    d2h = lambda: host.copy_(device_buf, non_blocking=cuda)  # noqa: E731
    h2d = lambda: device_buf.copy_(host, non_blocking=cuda)  # noqa: E731
    out = CopyRates(copy_mb=nbytes / 2**20, backlog_mb=[s / 2**20 for s in sizes], measured_concurrency=False,
                    k_copy_d2h=1.0, k_copy_h2d=1.0, k_gemm=1.0)
    backlog_bytes = 2 * sum(sizes)
    for name, run in (("d2h", _backlog(host, device_buf, sizes, cuda)),
                      ("h2d", _backlog(device_buf, host, sizes, cuda))):
        out[f"{name}_gbps"] = backlog_bytes / statistics.median(_timed(run, stream, reps, cuda)) / 1e6
    d2h_ms = statistics.median(_timed(d2h, stream, reps, cuda))
    h2d_ms = statistics.median(_timed(h2d, stream, reps, cuda))
    out["d2h_ms"], out["h2d_ms"] = d2h_ms, h2d_ms
    if not cuda or gemm is None:
        return out
    _pair(gemm, 1, d2h, 0)  # warm-up
    gemm_ms = statistics.median(_pair(gemm, 1, d2h, 0)[0] for _ in range(reps))
    out["gemm_ms"] = gemm_ms
    # each ratio compares a pair of runs next to each other, queued behind the same hold: the GPU's heat
    # drifts over the probe, and a k measured against an earlier batch would carry that drift
    for name, copy, alone in (("d2h", d2h, d2h_ms), ("h2d", h2d, h2d_ms)):
        n_gemm = max(1, int(1.5 * alone / gemm_ms) + 1)   # GEMMs that outlast the copy by half
        n_copy = max(1, int(1.5 * gemm_ms / alone) + 1)   # copies that outlast one GEMM by half
        k_copy, k_gemm = [], []
        for _ in range(reps):
            k_copy.append(_pair(gemm, n_gemm, copy, 1)[1] / _pair(gemm, 0, copy, 1)[1])
            k_gemm.append(_pair(gemm, 1, copy, n_copy)[0] / _pair(gemm, 1, copy, 0)[0])
        out[f"k_copy_{name}"], out[f"k_gemm_{name}"] = statistics.median(k_copy), statistics.median(k_gemm)
    out["k_gemm"] = max(out["k_gemm_d2h"], out["k_gemm_h2d"])
    out["measured_concurrency"] = True
    return out


HEAT_RUN_MS = 400.0      # back-to-back GEMMs from a cool GPU: long enough to reach the power limit
HEAT_GAPS_MS = (2.0, 5.0, 15.0, 40.0)   # nominal (a spin of 2000 cycles per us): the fit takes the measured gap
HOT_RUN_MS = 80.0
AFTER_GAP = 6            # GEMMs timed after each gap
COOL_S = 0.25            # a pause that cools the GPU completely
PIECE_COOL_S = 0.05      # before each layer piece: a mostly cool GPU (the model adds the heat; the calibration
                         # on the measured plain step absorbs what a 50 ms pause leaves)


def _each_timed(calls: list) -> list[float]:
    """ms of each call, queued back to back behind a short device hold (the host's launch cost hidden)."""
    marks = [torch.cuda.Event(enable_timing=True) for _ in range(len(calls) + 1)]
    torch.cuda._sleep(HOLD_US * SLEEP_CYCLES_PER_US)
    marks[0].record()
    for call, mark in zip(calls, marks[1:]):
        call()
        mark.record()
    torch.cuda.synchronize()
    return [a.elapsed_time(b) for a, b in zip(marks, marks[1:])]


def _idle(ms: float):
    """A device-side pause: one thread spins, the SMs idle (as under a stream waiting on a copy)."""
    return lambda: torch.cuda._sleep(int(ms * 1e3 * SLEEP_CYCLES_PER_US))


def measure_heat(gemm, memory_bound, *, cuda: bool) -> dict:
    """How the step's GEMM slows as the GPU reaches its power limit (see overlap/offload/power.py): per-GEMM
    times back to back from a cool GPU, after device-side idle gaps on a hot one, and alternating with the
    step's memory-bound kernel; returns `fit_heat`'s numbers plus the samples. CPU: gemm_heat 0, unmeasured."""
    if not cuda:
        return {**NO_HEAT, "measured": False}
    gemm_ms = statistics.median(_each_timed([gemm] * 5))
    n_heat, n_hot = max(20, int(HEAT_RUN_MS / gemm_ms)), max(4, int(HOT_RUN_MS / gemm_ms))
    time.sleep(COOL_S)
    heating = _each_timed([gemm] * n_heat)
    cooling = []
    for gap in HEAT_GAPS_MS:
        times = _each_timed([gemm] * n_hot + [_idle(gap)] + [gemm] * AFTER_GAP)
        cooling.append((times[n_hot - 1], times[n_hot], times[n_hot + 1:]))
    pairs = _each_timed([gemm] * n_hot + [gemm, memory_bound] * n_heat)[n_hot:]
    out = fit_heat(heating, cooling, list(zip(pairs[0::2], pairs[1::2])))
    out.update(measured=True, heating_ms=[round(t, 4) for t in heating[::max(1, n_heat // 40)]],
               cooling=[[round(last, 4), round(gap, 4), [round(t, 4) for t in after]] for last, gap, after in cooling],
               alternating_ms=[round(t, 4) for t in pairs[-8:]])
    return out


def _cool_median(fn, reps: int) -> float:
    """Median ms of `fn` called `reps` times back to back on a cool GPU, the host's launch cost hidden."""
    time.sleep(PIECE_COOL_S)
    return statistics.median(_each_timed([fn] * reps))


def measure_layer_times(mlp, x: torch.Tensor, *, reps: int = 5) -> dict:
    """Medians (ms) of one layer's pieces at this x: fc1 (gathered copy + GEMM) and fc2 GEMMs forward, their
    backward (dgrad + wgrad), the engine's activation forward and backward, autograd's forward and backward.
    CUDA: each piece back to back behind a device hold after a 50 ms pause (the step model adds the heat)."""
    cuda = x.is_cuda
    stream = torch.cuda.current_stream() if cuda else None
    w1, w2 = mlp.fc1.weight.detach(), mlp.fc2.weight.detach()
    with torch.no_grad():
        h = x @ w1
        a = activation_forward(h, mlp.activation)
        dy = torch.randn_like(x)
    h_req = h.detach().requires_grad_(True)
    a_graph = SavedInputActivation.apply(h_req, mlp.activation)
    a_plain = activation_forward(h_req, mlp.activation)
    da = torch.randn_like(a)
    dh = torch.randn_like(h)
    pieces = {
        "fc1_ms": lambda: torch.mm(x.clone(), w1),
        "act_ms": lambda: lean_activation_forward(h, mlp.activation),
        "act_plain_ms": lambda: activation_forward(h, mlp.activation),
        "fc2_ms": lambda: torch.mm(a, w2),
        "fc2_bwd_ms": lambda: (torch.mm(dy, w2.t()), torch.mm(a.t(), dy)),
        "fc1_bwd_ms": lambda: (torch.mm(dh, w1.t()), torch.mm(x.t(), dh)),
        "act_bwd_ms": lambda: torch.autograd.grad(a_graph, h_req, da, retain_graph=True),
        "act_bwd_plain_ms": lambda: torch.autograd.grad(a_plain, h_req, da, retain_graph=True),
    }
    out = {}
    for name, fn in pieces.items():
        with torch.enable_grad() if name.startswith("act_bwd") else torch.no_grad():
            if cuda:
                fn()  # warm-up (`_timed` does its own)
                out[name] = _cool_median(fn, reps)
            else:
                out[name] = statistics.median(_timed(fn, stream, reps, cuda))
    return out


def measure_ms(fn, device: torch.device, *, reps: int = 3) -> float:
    """Median ms of `fn()` on the current stream (e.g. the optimizer step: the step's time outside the layers)."""
    cuda = device.type == "cuda"
    return statistics.median(_timed(fn, torch.cuda.current_stream(device) if cuda else None, reps, cuda))


def peak_of(step, device: torch.device, prepare=None) -> tuple[int, int]:
    """(peak bytes above what existed when it started, bytes that existed) of the second of two calls of
    `step` (the first warms up allocator, slots and kernels); `prepare()` runs before each (e.g. dropping or
    allocating the gradients, which sets what exists at the start). CUDA: max_memory_allocated; CPU:
    LiveBytes, which counts only what the step allocates (what existed is reported as 0)."""
    prepare = prepare or (lambda: None)
    prepare()
    step()
    prepare()
    if device.type != "cuda":
        with LiveBytes() as live:
            step()
        return live.peak, 0
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    step()
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) - before, before


def rates_from(copies: CopyRates, times: dict, *, step_extra_ms: float = 0.0, heat: dict | None = None) -> Rates:
    """Planner input: measured bandwidths, k (at least 1: below is noise; the GEMM's per copy direction) and
    layer times (recompute of a = the activation forward), the step's time outside the layers, and the
    GPU's heat (`measure_heat`; default none)."""
    return Rates(**{name: (heat or NO_HEAT)[name] for name in NO_HEAT},
                 d2h_gbps=copies["d2h_gbps"], h2d_gbps=copies["h2d_gbps"],
                 k_copy=max(1.0, copies["k_copy_d2h"], copies["k_copy_h2d"]),
                 k_gemm=max(1.0, copies.get("k_gemm_d2h", copies["k_gemm"])),
                 k_gemm_h2d=max(1.0, copies.get("k_gemm_h2d", copies["k_gemm"])),
                 fc1_ms=times["fc1_ms"], fc2_ms=times["fc2_ms"], act_ms=times["act_ms"],
                 act_plain_ms=times.get("act_plain_ms"), act_bwd_ms=times["act_bwd_ms"], recompute_ms=times["act_ms"],
                 act_bwd_plain_ms=times.get("act_bwd_plain_ms"), fc1_bwd_ms=times.get("fc1_bwd_ms"),
                 fc2_bwd_ms=times.get("fc2_bwd_ms"), step_extra_ms=step_extra_ms)
