"""The TP linear layers as `torch.library` custom ops with fake impls and autograd formulas.

Four ops (namespace `tp_overlap`), each taking an int `layer_id` that names a `LayerOps` in a process-local
registry (op contexts hold pools and streams, which cannot be op arguments):

    column_forward(x [M/W, H], w [H, L], id)          -> y [M, L], saved [M, H] or [0, H], stamp int64 [1]
    column_backward(dy [M, L], saved, stamp, w, id)   -> dx [M/W, H] = RS(dy @ w^T), dw [H, L] = gathered^T @ dy
                                                         (role fc1_dgrad, bulk_wgrad: the RS overlaps the dw GEMM)
    row_forward(x [M, L], w [L, H], id)                -> y [M/W, H] = RS(x @ w)
    row_backward(dy [M/W, H], x, w, id)                -> dx [M, L] = AG(dy) @ w^T, dw [L, H] = x^T @ AG(dy)
                                                         (role fc2_dgrad, lead_wgrad: the AG overlaps the dw
                                                         GEMM of this rank's rows)

`H` is the model width (sequence-sharded side), `L` the rank-local width. Each layer owns one AllGather+GEMM
and one GEMM+ReduceScatter: column = AG in forward, RS in backward; row = RS in forward, AG in backward.
Every output is a fresh tensor on the input's device (no alias of an input or of pool memory, no CPU
tensor), which is what torch.compile's CUDA-graph trees (`mode="reduce-overhead"`) require; the ops are
opaque to torch.compile (fake impls give shapes). Outputs are valid on the caller's current stream when the
ops return (CUDA), or at once (CPU). Role settings (`by_m` included) are resolved per call from M.

The gathered input a column layer's weight grad needs: `save_gathered="view"` keeps it in the AgGemm's pool
region (no copy) and passes an empty `saved` tensor through autograd; it stays valid until the op's next
forward call. `stamp` receives the forward's number on the device (`AgGemm.version`, bumped by every
forward), and the backward compares them on the device before it reads the region: a backward that finds
it overwritten by a later forward raises OpInputError (on CPU at once; on CUDA at the next op call or
`check_errors()`, on every rank) instead of passing wrong gradients on silently. `save_gathered="copy"`
clones it (one [M, H] copy per forward) for schedules with several forwards pending (pipeline
micro-batches, recompute).
"""

from __future__ import annotations

import itertools

import torch
import torch.distributed as dist

from .validate import OpInputError
from .reference import ag_gemm_reference, gemm_rs_reference

__all__ = ["LayerOps", "OverlapLayerOps", "SharedOps", "NcclLayerOps", "TorchSymmLayerOps", "register_layer_ops",
           "unregister_layer_ops", "get_layer_ops", "SAVE_GATHERED"]

SAVE_GATHERED = ("view", "copy")
_REGISTRY: dict[int, "LayerOps"] = {}
_NEXT_ID = itertools.count(1)


class LayerOps:
    """The two communicating GEMMs of one layer on one backend: the four custom ops' implementations.

    Subclasses implement `ag_gemm(x, w)` -> (out [M, L], gathered [M, H]) and `gemm_rs(a, w)`; the default
    forms below compose them with plain GEMMs.
    """
    world_size: int
    name: str = "layer"  # the owning layer's name, for messages (set by the layer)

    def ag_gemm(self, x, w):
        raise NotImplementedError

    def gemm_rs(self, a, w):
        raise NotImplementedError

    def saved_rows(self, m: int) -> int:
        """Rows of the `saved` tensor column_forward returns for M = m (its fake impl needs them)."""
        return m

    def column_forward(self, x, w):
        out, gathered = self.ag_gemm(x, w)
        return out, gathered, x.new_zeros(1, dtype=torch.int64)  # no stamp to check: a constant

    def column_backward(self, dy, saved, stamp, w):
        return self.gemm_rs(dy, w.t()), torch.mm(saved.t(), dy)

    def row_forward(self, x, w):
        return self.gemm_rs(x, w)

    def row_backward(self, dy, x, w):
        grad_x, dy_full = self.ag_gemm(dy, w.t())
        return grad_x, torch.mm(x.t(), dy_full)

    def close(self) -> None:
        pass


class OverlapLayerOps(LayerOps):
    """Our AgGemm + GemmRs contexts (pool regions `<ag_name>.a`, `<rs_name>.partials`) and the layer's role
    settings (`bulk_wgrad` of a column layer's fc1_dgrad, `lead_wgrad` of a row layer's fc2_dgrad), each
    resolved per call from M (`by_m`)."""

    def __init__(self, *, group, pool, max_m: int, hidden: int, local: int, dtype: torch.dtype, config,
                 ag_name: str, rs_name: str, role: str, save_gathered: str = "view", fp8: bool = False,
                 shared: "SharedOps | None" = None):
        if save_gathered not in SAVE_GATHERED:
            raise OpInputError(f"save_gathered={save_gathered!r}; allowed: {' | '.join(SAVE_GATHERED)}")
        if shared is not None and save_gathered != "copy":
            raise OpInputError(f"{ag_name}: layers that share their op contexts (SharedOps) keep their own copy of "
                               f"the gathered input: save_gathered='copy' (the shared region is overwritten by the "
                               f"next layer's AllGather before this layer's backward)")
        self.role, self.config = role, config
        self.world_size = dist.get_world_size(group)
        self.save_gathered, self.fp8 = save_gathered, fp8
        self._stale_code = None
        self._owned = shared is None
        if shared is not None:
            self.ag, self.rs = shared.ag, shared.rs
            return
        from .ag_gemm import AgGemm
        from .gemm_rs import GemmRs

        bulk = _needs_bulk(config, max_m, role)
        self.ag = AgGemm(group=group, pool=pool, max_m=max_m, k=hidden, n_local=local, dtype=dtype,
                         config=config.ag_gemm, name=ag_name, fp8=fp8)
        try:
            self.rs = GemmRs(group=group, pool=pool, max_m=max_m, k_local=local, n=hidden, dtype=dtype,
                             config=config.gemm_rs, name=rs_name, fp8=fp8, bulk=bulk)
        except BaseException:
            self.ag.close()
            raise

    def saved_rows(self, m: int) -> int:
        return m if self.save_gathered == "copy" else 0

    def column_forward(self, x, w):
        stamp = torch.empty(1, dtype=torch.int64, device=x.device)
        out = self.ag._run(x, w, stamp=stamp)   # the layer validated x; w is its own parameter
        if self.save_gathered == "copy":  # fp8: the dequantised gathered input (already a new tensor)
            gathered = self.ag.gathered_bf16(out.shape[0])
            return out, gathered if self.fp8 else gathered.clone(), stamp
        return out, x.new_empty(0, x.shape[1]), stamp

    def column_backward(self, dy, saved, stamp, w):
        m = dy.shape[0]
        check = None
        if self.save_gathered == "copy":
            gathered = saved
        else:
            check = self._stamp_check(stamp)
            gathered = self.ag.gathered_bf16(m)
        # autograd hands back grads of the forward's shapes: no second validation
        if self.config.role("fc1_dgrad", m).bulk_wgrad:
            return self.rs._bulk_call(dy, w.t(), None, gathered, check)
        return self.rs._call(m, "op", dy, w.t(), gathered, None, check)

    def _stamp_check(self, stamp: torch.Tensor):
        """CPU: compare now; CUDA: (stamp, version, code) for the backward op's plan to compare on the device."""
        version = self.ag.version
        if not version.is_cuda:
            later = int(version) - int(stamp)
            if later:
                raise OpInputError(_stale_message(self.name, later))
            return None
        if self._stale_code is None:
            self._stale_code = self.ag.pool.failure_code(_stale_message(self.name, None))
        return stamp, version, self._stale_code

    def row_forward(self, x, w):
        return self.rs._call(x.shape[0], "op", x, w, None, None, None)

    def row_backward(self, dy, x, w):
        # AllGather of dy overlapped with the GEMM producing dx (with lead_wgrad: with the weight-grad GEMM of
        # this rank's rows); the weight grad of the gathered rows follows in the same call
        m = dy.shape[0] * self.world_size
        return self.ag._run(dy, w.t(), wgrad_of=x, lead_wgrad=self.config.role("fc2_dgrad", m).lead_wgrad)

    def check_errors(self) -> None:
        self.ag.check_errors()

    def close(self) -> None:
        if self._owned:
            self.ag.close()
            self.rs.close()


class SharedOps:
    """One AgGemm and one GemmRs of width `hidden` that every layer of a model uses in turn (regions
    `<name>.ag.a` and `<name>.rs.partials`): blocks run one after another on a stream, so the pool holds one
    region per op whatever the model's depth (`pool_requirements(..., num_layers=1)`). Each call brings its
    own weight width (the ops are built with n_local / k_local None). Layers built with `shared=` keep a copy
    of the gathered input for their backward. Close it after the layers; the pool is the caller's."""

    def __init__(self, *, group, pool, max_m: int, hidden: int, dtype: torch.dtype, config, fp8: bool = False,
                 name: str = "model"):
        from .ag_gemm import AgGemm
        from .gemm_rs import GemmRs

        bulk = _needs_bulk(config, max_m, "fc1_dgrad") | _needs_bulk(config, max_m, "fc2_dgrad")
        self.pool, self.config, self.max_m, self.hidden, self.dtype, self.fp8 = pool, config, max_m, hidden, dtype, fp8
        self.ag = AgGemm(group=group, pool=pool, max_m=max_m, k=hidden, n_local=None, dtype=dtype,
                         config=config.ag_gemm, name=f"{name}.ag", fp8=fp8)
        try:
            self.rs = GemmRs(group=group, pool=pool, max_m=max_m, k_local=None, n=hidden, dtype=dtype,
                             config=config.gemm_rs, name=f"{name}.rs", fp8=fp8, bulk=bulk)
        except BaseException:
            self.ag.close()
            raise

    def check_errors(self) -> None:
        self.ag.check_errors()
        self.rs.check_errors()

    def close(self) -> None:
        self.ag.close()
        self.rs.close()


def _needs_bulk(config, max_m: int, role: str) -> bool:
    """Whether the GemmRs of `role` needs bulk staging, after refusing role settings no call could run."""
    if role == "fc2_dgrad":
        for m in _bucket_ms(config, max_m):
            method = config.op_config("ag_gemm", m).method
            if config.role(role, m).lead_wgrad and method != "decomposed":
                raise OpInputError(f"roles.fc2_dgrad.lead_wgrad needs ops.ag_gemm.method decomposed (the lead "
                                   f"runs in place of its lead GEMM); at M = {m} this preset has {method}")
        return False
    return any(config.role(role, m).bulk_wgrad for m in _bucket_ms(config, max_m))


def _stale_message(name: str, later: int | None) -> str:
    count = f"{later} later forward(s)" if later is not None else "a later forward"
    return (f"{name}: the gathered input saved by a forward was overwritten by {count} before its backward ran "
            f"(the pool keeps one); build the layer with save_gathered='copy' for schedules with several forwards "
            f"pending")


def _bucket_ms(config, max_m: int) -> list[int]:
    """One M per distinct setting a layer of max_m can run: each by_m bucket's bound below max_m, and max_m."""
    bounds = {m_max for preset in (config.ag_gemm, config.gemm_rs, *config.roles.values())
              for m_max, _ in preset.by_m if m_max < max_m}
    return sorted(bounds) + [max_m]


class NcclLayerOps(LayerOps):
    """The baseline: plain collectives (NCCL / gloo) then torch.mm, no overlap (overlap/ops/reference.py)."""

    def __init__(self, *, group):
        self.group, self.world_size = group, dist.get_world_size(group)

    def ag_gemm(self, x, w):
        return ag_gemm_reference(x, w, group=self.group)

    def gemm_rs(self, a, w):
        return gemm_rs_reference(a, w, group=self.group)


class TorchSymmLayerOps(LayerOps):
    """PyTorch's async-TP fused ops (`torch.ops.symm_mem`), CUDA only: the other baseline."""

    def __init__(self, *, group, device: torch.device):
        if device.type != "cuda":
            raise OpInputError("baseline='torch_symm' needs CUDA (torch.ops.symm_mem); use 'nccl' on CPU")
        import torch.distributed._symmetric_memory as symm

        self.world_size = dist.get_world_size(group)
        self.group_name = group.group_name
        if hasattr(symm, "enable_symm_mem_for_group"):  # required by torch <= 2.11, deprecated later
            import warnings
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                symm.enable_symm_mem_for_group(self.group_name)

    def ag_gemm(self, x, w):
        gathered, outs = torch.ops.symm_mem.fused_all_gather_matmul(x, [w], 0, self.group_name)
        return outs[0], gathered

    def gemm_rs(self, a, w):
        return torch.ops.symm_mem.fused_matmul_reduce_scatter(a, w, "sum", 0, self.group_name)


# ----- registry --------------------------------------------------------------------------------------
def register_layer_ops(ops: LayerOps) -> int:
    """Make `ops` reachable from the custom ops; returns the int id to pass as `layer_id`."""
    layer_id = next(_NEXT_ID)
    _REGISTRY[layer_id] = ops
    return layer_id


def unregister_layer_ops(layer_id: int) -> None:
    _REGISTRY.pop(layer_id, None)


def get_layer_ops(layer_id: int) -> LayerOps:
    try:
        return _REGISTRY[layer_id]
    except KeyError:
        raise OpInputError(f"no layer ops with id {layer_id} (closed, or built in another process)") from None


# ----- custom ops ------------------------------------------------------------------------------------
@torch.library.custom_op("tp_overlap::column_forward", mutates_args=())
def column_forward(x: torch.Tensor, w: torch.Tensor, layer_id: int) -> tuple[torch.Tensor, torch.Tensor,
                                                                            torch.Tensor]:
    return get_layer_ops(layer_id).column_forward(x, w)


@column_forward.register_fake
def _(x, w, layer_id):
    ops = get_layer_ops(layer_id)
    m = x.shape[0] * ops.world_size
    return x.new_empty(m, w.shape[1]), x.new_empty(ops.saved_rows(m), x.shape[1]), x.new_empty(1, dtype=torch.int64)


@torch.library.custom_op("tp_overlap::column_backward", mutates_args=())
def column_backward(grad_y: torch.Tensor, saved: torch.Tensor, stamp: torch.Tensor, w: torch.Tensor,
                    layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    # w.t() is a view: every backend reads it in place. The weight grad uses the forward's gathered
    # input (no second AllGather) and is independent of grad_x: with bulk_wgrad it hides the RS.
    return get_layer_ops(layer_id).column_backward(grad_y.contiguous(), saved, stamp, w)


@column_backward.register_fake
def _(grad_y, saved, stamp, w, layer_id):
    m_shard = grad_y.shape[0] // get_layer_ops(layer_id).world_size
    return grad_y.new_empty(m_shard, w.shape[0]), w.new_empty(w.shape)


@torch.library.custom_op("tp_overlap::row_forward", mutates_args=())
def row_forward(x: torch.Tensor, w: torch.Tensor, layer_id: int) -> torch.Tensor:
    return get_layer_ops(layer_id).row_forward(x, w)


@row_forward.register_fake
def _(x, w, layer_id):
    return x.new_empty(x.shape[0] // get_layer_ops(layer_id).world_size, w.shape[1])


@torch.library.custom_op("tp_overlap::row_backward", mutates_args=())
def row_backward(grad_y: torch.Tensor, x: torch.Tensor, w: torch.Tensor,
                 layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    return get_layer_ops(layer_id).row_backward(grad_y.contiguous(), x, w)


@row_backward.register_fake
def _(grad_y, x, w, layer_id):
    return x.new_empty(x.shape), w.new_empty(w.shape)


def _column_setup(ctx, inputs, output):
    _, w, layer_id = inputs
    _, saved, stamp = output
    ctx.save_for_backward(saved, stamp, w)
    ctx.layer_id = layer_id


def _column_grad(ctx, grad_y, _grad_saved, _grad_stamp):
    saved, stamp, w = ctx.saved_tensors
    grad_x, grad_w = torch.ops.tp_overlap.column_backward(grad_y, saved, stamp, w, ctx.layer_id)
    return grad_x, grad_w, None


def _row_setup(ctx, inputs, output):
    x, w, layer_id = inputs
    ctx.save_for_backward(x, w)
    ctx.layer_id = layer_id


def _row_grad(ctx, grad_y):
    x, w = ctx.saved_tensors
    grad_x, grad_w = torch.ops.tp_overlap.row_backward(grad_y, x, w, ctx.layer_id)
    return grad_x, grad_w, None


column_forward.register_autograd(_column_grad, setup_context=_column_setup)
row_forward.register_autograd(_row_grad, setup_context=_row_setup)
