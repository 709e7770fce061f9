"""OffloadEngine: saved activations of a stack of TP MLPs to pinned host slots and back, on copy-engine streams.

    plan = plan_offload(MLPShape(...), Rates(...), budget_bytes=...)     # overlap/offload/planner.py
    with HostPool(host_bytes(plan), device=dev) as pool:
        engine = enable_offload(mlps, plan, pool=pool)                   # mlps in forward order
        y = mlps[1](mlps[0](x)); y.backward(dy)                          # any number of steps
        disable_offload(mlps); engine.close()

Per layer p and saved tensor n (x: the column layer's gathered input, h: fc1's output, a: act(h), s:
swiglu's silu(gate); see overlap/config/offload.py), the plan says keep, offload or recompute. The op that
saves a tensor the plan moves runs under `torch.autograd.graph.saved_tensors_hooks` (the custom ops
`tp_overlap::column_forward` / `row_forward` and the activation save through it; weights and anything
that is not the expected tensor are kept as they are); an op whose tensor is kept runs without hooks,
and backward hooks exist only in plans that offload, so keeping costs no per-tensor work. A layer that moves h or a, or recomputes s, runs
the activation that saves h only (overlap/offload/activation.py: one kernel each way on CUDA); the others
run autograd's, so a plan that moves nothing runs the very ops of the stack without the engine.

Streams and events (CUDA; every dependency is an event, nothing synchronises the host):
* offload, at save time: the device-to-host stream (high priority) waits for the compute stream (the tensor
  is complete) and for the slot's last host-to-device read, copies into the slot, records `landed`.
* release, at the save point the plan names (or at the start of backward): the compute stream waits for
  `landed`, then the engine drops its reference, so the caching allocator frees the block in compute-stream
  order (no record_stream: the freed bytes are reusable at once, and inside a CUDA-graph capture too).
* prefetch, when backward reaches layer p (a hook on the layer's output): the tensors of layers p..p-depth
  get a device buffer allocated on the compute stream; the host-to-device stream waits for that point,
  copies, records `fetched`, which also becomes the slot's `last_read`.
* unpack, when autograd needs the tensor: the compute stream waits for `fetched` (without a prefetch the
  copy is issued then: a "demand fetch", counted). Outputs of unpack are valid on the compute stream.
* recompute of a: h is unpacked (kept or fetched) and a = act(h) is recomputed on the compute stream.
* end of backward (autograd's final callback): host bookkeeping only (slots, step count); every copy has
  been joined into the compute stream by a wait already.
Inside a CUDA-graph capture the same calls are captured: slots are static host addresses, prefetch
buffers come from the graph's private pool (fixed addresses for every replay). On CPU the copies are
memcpys and every event is absent; the bookkeeping is the same.
"""

from __future__ import annotations

import contextlib
import weakref

import torch

from .activation import SavedInputActivation, activation_forward, lean_activation_forward
from ..config.offload import CANDIDATES, SAVED
from .host_pool import HostPool, OffloadError
from .planner import OffloadPlan, tensor_bytes
from .records import Offloaded, Recomputed, identity_matcher

__all__ = ["OffloadEngine", "enable_offload", "disable_offload", "host_bytes"]

_SAVED_SET = frozenset(SAVED)
_LEAN_IF = frozenset(("h", "a", "s"))  # a layer moving any of these runs the activation that saves h only


def host_bytes(plan: OffloadPlan) -> int:
    """Host pool bytes the plan's offloaded tensors need (one slot each, page-aligned)."""
    sizes = tensor_bytes(plan.shape)
    return sum(-(-sizes[n] // 4096) * 4096 for _, n, d in plan.decisions if d == "offload") or 4096


class OffloadEngine:
    """Runs `plan` for the MLPs given to `enable_offload`, with slots in `pool` (see the module doc).

    Counters (`stats()`): records offloaded / recomputed / kept per step, bytes copied each way, demand
    fetches (copies issued at unpack, i.e. not prefetched), and saved tensors that matched no candidate.
    """

    def __init__(self, plan: OffloadPlan, *, pool: HostPool, device: torch.device | str | None = None,
                 activation: str | None = None, name: str = "offload"):
        self.plan, self.pool, self.name = plan, pool, name
        self.device = torch.device(device) if device is not None else pool.device
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        if self.device != pool.device:
            raise OffloadError(f"engine on {self.device}, host pool for {pool.device}")
        self.activation = activation or plan.shape.activation
        self.num_layers = plan.shape.num_layers
        self._decision = {(p, n): d for p, n, d in plan.decisions}
        self._moves = [frozenset(n for n in CANDIDATES if self._decision.get((p, n), "keep") != "keep")
                       for p in range(self.num_layers)]
        self._offloads = any(d == "offload" for d in self._decision.values())
        self._release_at = {(p, n): i for p, n, i in plan.release_at}
        sizes = tensor_bytes(plan.shape)
        self._slots = {key: pool.slot(f"{name}.L{key[0]}.{key[1]}", sizes[key[1]])
                       for key, d in self._decision.items() if d == "offload"}
        cuda = self.device.type == "cuda"
        self._d2h = torch.cuda.Stream(self.device, priority=-1) if cuda else None
        self._h2d = torch.cuda.Stream(self.device, priority=-1) if cuda else None
        self._params: set[int] = set()
        self.steps = 0
        self._records: dict[tuple, weakref.ref] = {}
        self._pending: list = []    # offloaded records not yet released (weak)
        self._deferred: list = []   # (due save point, record) copies held back by pacing
        self._prefetched: set[int] = set()
        self._in_backward = False
        self._unjoined: list = []   # (event, buffer) of prefetches no unpack waited for (see _end_backward)
        self._capturing = False
        self._closed = False
        self.counters = dict.fromkeys(("offloaded", "recomputed", "kept", "unmatched", "d2h_bytes", "h2d_bytes",
                                       "prefetches", "demand_fetches", "released_in_forward",
                                       "released_at_backward"), 0)

    # ----- forward ---------------------------------------------------------------------------------
    def forward(self, layer: int, mlp, x: torch.Tensor) -> torch.Tensor:
        """TPMLP.forward of `mlp` at position `layer`, its saved tensors handled per the plan.

        An op whose saved tensor the plan keeps runs without hooks (autograd saves as it always does), and a
        layer that moves neither h nor a (nor recomputes s) runs autograd's activation: a layer that keeps
        everything runs the plain layer's ops plus one call. A backward hook is installed only where
        backward has something to do (releases, prefetches: plans that offload)."""
        if self._closed:
            raise OffloadError(f"{self.name}: the engine is closed")
        if not torch.is_grad_enabled():  # nothing is saved: the plain math
            return mlp.fc2(activation_forward(mlp.fc1(x), self.activation))
        if self._in_backward:
            if torch._C._current_autograd_node() is not None:  # e.g. activation checkpointing re-running it
                raise OffloadError(f"{self.name}: a forward ran inside a backward of this engine's layers "
                                   f"(recompute by checkpointing is not supported on an offloaded stack)")
            self.reset()  # the previous backward raised before its final callback: start afresh
        moves = self._moves[layer]
        self.counters["kept"] += len(SAVED) - len(moves & _SAVED_SET)
        if self._offloads:
            self._check_capture()
            self._join_leftovers()
        if not moves and not self._pending and not self._deferred:
            y = mlp.fc2(activation_forward(mlp.fc1(x), self.activation))  # the plain layer's ops, no more
        else:
            y = self._forward_moving(layer, mlp, x, moves)
        if self._offloads and y.requires_grad:
            y.register_hook(lambda grad, layer=layer: self._backward_begins(layer))
        return y

    def _forward_moving(self, layer: int, mlp, x: torch.Tensor, moves: frozenset) -> torch.Tensor:
        if moves:
            self._params.update(p.untyped_storage().data_ptr() for p in mlp.parameters())
        rows = x.shape[0] * mlp.world_size
        if rows > self.plan.shape.m and any(self._decision.get((layer, n)) == "offload" for n in CANDIDATES):
            raise OffloadError(f"{self.name}: M={rows} exceeds the plan's M={self.plan.shape.m} (its host slots "
                               f"are sized for it); plan for the largest M")
        # matchers hold no tensor (see identity_matcher): autograd keeps them as long as the graph
        self._save_point(3 * layer)
        gathered = (rows, x.shape[1])
        with self._saving(layer, "x", lambda t: tuple(t.shape) == gathered, moves):
            h = mlp.fc1(x)
        self._save_point(3 * layer + 1)
        with self._saving(layer, "h", identity_matcher(h), moves):
            # the engine's activation (saves h only) where h or a moves or s is recomputed, else autograd's
            lean = bool(moves & _LEAN_IF)
            a = SavedInputActivation.apply(h, self.activation) if lean else activation_forward(h, self.activation)
        if "h" not in moves:
            self._records[(layer, "h")] = weakref.ref(h)  # a recompute of a starts from it
        del h  # from here the saved record (or the autograd graph) owns it
        self._save_point(3 * layer + 2)
        with self._saving(layer, "a", identity_matcher(a), moves):
            y = mlp.fc2(a)
        return y

    def _check_capture(self) -> None:
        capturing = self.device.type == "cuda" and torch.cuda.is_current_stream_capturing()
        if capturing != self._capturing:
            # events of the other mode are not waited on: torch.cuda.graph synchronised before capturing,
            # and eager calls after replays are ordered behind them on the same compute stream
            for slot in self._slots.values():
                slot.last_read = None
            self._unjoined.clear()
            self._capturing = capturing

    def _saving(self, layer: int, name: str, matches, moves):
        if name not in moves:
            return contextlib.nullcontext()  # kept: autograd saves it as it always does
        engine, seen = self, []

        def pack(t: torch.Tensor):
            if t.numel() == 0 or t.untyped_storage().data_ptr() in engine._params:
                return t  # parameters, and the empty stand-in of a gathered input kept in the pool
            if seen or not matches(t):
                if t.is_floating_point():  # a saved activation the plan does not know about
                    engine.counters["unmatched"] += 1
                return t
            seen.append(True)
            return engine._pack(layer, name, t)

        return torch.autograd.graph.saved_tensors_hooks(pack, self._unpack)

    def _pack(self, layer: int, name: str, t: torch.Tensor):
        decision = self._decision.get((layer, name), "keep")
        if decision == "keep":
            self.counters["kept"] += 1
            packed = t
        elif decision == "recompute":
            ref = self._records.get((layer, "h"))
            source = ref() if ref is not None else None
            if source is None:
                raise OffloadError(f"{self.name}: L{layer}.a is to be recomputed but h was not saved")
            self.counters["recomputed"] += 1
            packed = Recomputed(source, self.activation)
        else:
            if not t.is_contiguous():
                raise OffloadError(f"{self.name}: L{layer}.{name} is not contiguous (strides {t.stride()})")
            packed = Offloaded(self, layer, name, t, self._slots[(layer, name)])
            self.counters["offloaded"] += 1
            self._pending.append(weakref.ref(packed))
            offset = self.plan.pacing_offset
            due = 3 * layer + SAVED.index(name) + offset
            if offset:
                self._deferred.append((due, weakref.ref(packed)))
            else:
                self._copy_out(packed)
        self._records[(layer, name)] = weakref.ref(packed)  # the autograd graph owns it, not the engine
        return packed

    def _save_point(self, index: int) -> None:
        """Save point `index` (3 * layer + candidate): release landed copies due here, issue paced ones."""
        if not self._pending and not self._deferred:
            return
        for rec in [r() for r in self._pending]:
            if rec is not None and rec.device is not None and 0 <= self._release_at.get(
                    (rec.layer, rec.name), -1) <= index:
                self._release(rec)
                self.counters["released_in_forward"] += 1
        self._pending = [r for r in self._pending if r() is not None and r().device is not None]
        for due, ref in [d for d in self._deferred if d[0] <= index]:
            self._deferred.remove((due, ref))
            if ref() is not None:
                self._copy_out(ref())

    @torch.no_grad()
    def _copy_out(self, rec: Offloaded) -> None:
        self.counters["d2h_bytes"] += rec.host.numel() * rec.host.element_size()
        if self._d2h is None:
            rec.host.copy_(rec.device)
            return
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(self.device))
        self._d2h.wait_event(ready)
        if rec.slot.last_read is not None:  # the slot's previous contents have been read back
            self._d2h.wait_event(rec.slot.last_read)
        with torch.cuda.stream(self._d2h):
            rec.host.copy_(rec.device, non_blocking=True)
            rec.landed = torch.cuda.Event()
            rec.landed.record(self._d2h)

    def _release(self, rec: Offloaded) -> None:
        if rec.landed is not None:
            torch.cuda.current_stream(self.device).wait_event(rec.landed)
        rec.device = None

    # ----- backward --------------------------------------------------------------------------------
    def _backward_begins(self, layer: int) -> None:
        if not self._in_backward:
            self._in_backward = True
            for _, ref in self._deferred:
                if ref() is not None:
                    self._copy_out(ref())
            self._deferred.clear()
            for rec in [r() for r in self._pending]:
                if rec is not None and rec.device is not None:
                    self._release(rec)
                    self.counters["released_at_backward"] += 1
            self._pending.clear()
            torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)
        for q in range(layer, layer - self.plan.prefetch_depth - 1, -1):
            if q >= 0 and q not in self._prefetched:
                self._prefetched.add(q)
                for name in ("a", "h", "x"):  # the order backward needs them in
                    ref = self._records.get((q, name))
                    rec = ref() if ref is not None else None
                    if isinstance(rec, Offloaded) and rec.fetched is None and rec.consumers > 0:
                        self._fetch(rec)
                        self.counters["prefetches"] += 1

    @torch.no_grad()
    def _fetch(self, rec: Offloaded) -> None:
        rec.slot.check(rec.generation, rec.owner)
        if rec.device is not None:  # never released (e.g. no backward hook ran first)
            self._release(rec)
        out = torch.empty(rec.shape, dtype=rec.dtype, device=self.device)
        self.counters["h2d_bytes"] += out.numel() * out.element_size()
        if self._h2d is None:
            out.copy_(rec.host)
        else:
            # the buffer was allocated on the compute stream: copy only once that stream got here
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(self.device))
            self._h2d.wait_event(ready)
            with torch.cuda.stream(self._h2d):
                out.copy_(rec.host, non_blocking=True)
                rec.fetched_event = torch.cuda.Event()
                rec.fetched_event.record(self._h2d)
            rec.slot.last_read = rec.fetched_event
        rec.fetched = out
        rec.slot.release(rec.owner)  # later writers of the slot wait for `last_read`

    def _unpack(self, packed):
        if isinstance(packed, torch.Tensor):
            return packed
        if isinstance(packed, Recomputed):
            with torch.no_grad():
                return lean_activation_forward(self._unpack(packed.source), packed.activation)
        if packed.fetched is None:
            self.counters["demand_fetches"] += 1
            self._fetch(packed)
        if packed.fetched_event is not None:
            torch.cuda.current_stream(self.device).wait_event(packed.fetched_event)
        out = packed.fetched
        packed.consumers -= 1
        if packed.consumers <= 0:
            packed.fetched = None
        return out

    def _end_backward(self) -> None:
        """Autograd's final callback of a backward that ran through this engine's layers.

        Host bookkeeping only: autograd may run it on one of its device threads, whose current stream is
        not the step's. Every side-stream copy is already joined into the compute stream by a wait (a
        device-to-host copy at its release, a host-to-device copy at its unpack); a prefetch that no unpack
        waited for keeps its buffer until the next forward joins it (`_join_leftovers`)."""
        for ref in self._records.values():
            rec = ref()
            if isinstance(rec, Offloaded) and rec.fetched is not None and rec.fetched_event is not None:
                self._unjoined.append((rec.fetched_event, rec.fetched))
        self.reset()
        self.steps += 1

    def _join_leftovers(self) -> None:
        if self._unjoined:
            compute = torch.cuda.current_stream(self.device)
            for event, _ in self._unjoined:
                compute.wait_event(event)
            self._unjoined.clear()

    def reset(self) -> None:
        """Forget the current step (after a backward, or after one that raised): slots its records still
        hold are released; nothing is synchronised."""
        for ref in self._records.values():
            rec = ref()
            if isinstance(rec, Offloaded) and rec.slot.owner == rec.owner:
                rec.slot.release(rec.owner)  # its backward never asked for it
        self._records.clear()
        self._pending.clear()
        self._deferred.clear()
        self._prefetched.clear()
        self._in_backward = False

    # ----- lifecycle -------------------------------------------------------------------------------
    def stats(self) -> dict:
        return {"steps": self.steps, **self.counters, "host_slots": len(self._slots),
                "slots_in_use": sum(s.owner is not None for s in self._slots.values())}

    def close(self) -> None:
        """Drop the per-step state (the pool is the caller's; the streams are torch's pooled ones).
        Idempotent; a closed engine refuses to run."""
        if not self._closed:
            self.reset()
        self._closed = True


def enable_offload(mlps, plan: OffloadPlan, *, pool: HostPool, name: str = "offload") -> OffloadEngine:
    """Route the forward of every MLP in `mlps` (forward order: position = list index) through one engine.

    A module with an `offload` attribute that is None (the optional hook in TPMLP.forward, docs/API.md) gets
    `offload = (engine, position)`; any other module (TPMLP as it is) gets an instance `forward` that calls
    the engine. Undo with disable_offload. The MLPs need fc1, fc2, activation and world_size."""
    mlps = list(mlps)
    if len(mlps) != plan.shape.num_layers:
        raise OffloadError(f"the plan is for {plan.shape.num_layers} layers, got {len(mlps)} MLPs")
    for mlp in mlps:
        view = getattr(getattr(mlp.fc1, "ops", None), "save_gathered", "copy") == "view"
        if view and any(n == "x" and d == "offload" for _, n, d in plan.decisions):
            raise OffloadError("the plan offloads x, but the column layer keeps a pool view of it "
                               "(save_gathered='view'); plan with gathered_is_view=True")
    engine = OffloadEngine(plan, pool=pool, device=mlps[0].fc1.weight.device, activation=mlps[0].activation,
                           name=name)
    for position, mlp in enumerate(mlps):
        if getattr(mlp, "offload", "absent") is None:
            mlp.offload = (engine, position)
        else:
            mlp.forward = lambda x, mlp=mlp, position=position: engine.forward(position, mlp, x)
    return engine


def disable_offload(mlps) -> None:
    """Give every MLP its plain forward back."""
    for mlp in mlps:
        if isinstance(getattr(mlp, "offload", None), tuple):
            mlp.offload = None
        mlp.__dict__.pop("forward", None)
