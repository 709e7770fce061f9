"""The TP linear layers as `torch.library` custom ops with fake impls and autograd formulas.

Four ops (namespace `tp_overlap`), each taking an int `layer_id` that names a `LayerOps` in a process-local
registry (op contexts hold pools and streams, which cannot be op arguments):

    column_forward(x [M/W, H], w [H, L], id)          -> y [M, L], saved [M, H] or [0, H], stamp (int64 CPU scalar)
    column_backward(dy [M, L], saved, stamp, w, id)   -> dx [M/W, H] = RS(dy @ w^T), dw [H, L] = gathered^T @ dy
                                                         (role fc1_dgrad, bulk_wgrad: the RS overlaps the dw GEMM)
    row_forward(x [M, L], w [L, H], id)                -> y [M/W, H] = RS(x @ w)
    row_backward(dy [M/W, H], x, w, id)                -> dx [M, L] = AG(dy) @ w^T, dw [L, H] = x^T @ AG(dy)
                                                         (role fc2_dgrad, lead_wgrad: the AG overlaps the dw
                                                         GEMM of this rank's rows)

`H` is the model width (sequence-sharded side), `L` the rank-local width. Each layer owns one AllGather+GEMM
and one GEMM+ReduceScatter: column = AG in forward, RS in backward; row = RS in forward, AG in backward.
The ops are opaque to torch.compile (fake impls give shapes), so `torch.compile(..., fullgraph=True)` works,
and their outputs are valid on the caller's current stream when they return (CUDA), or at once (CPU).

The gathered input a column layer's weight grad needs: `save_gathered="view"` keeps it in the AgGemm's pool
region (no copy) and passes an empty `saved` tensor through autograd, so no output of an op aliases pool
memory (what CUDA-graph trees, `torch.compile(mode="reduce-overhead")`, require); it stays valid until the
op's next forward call, and `stamp` (the forward's call number) makes a backward that finds it overwritten
raise instead of producing wrong gradients. `save_gathered="copy"` clones it (one [M, H] copy per forward)
for schedules with several forwards pending (pipeline micro-batches, recompute).
"""

from __future__ import annotations

import itertools

import torch
import torch.distributed as dist

from ._validate import OpInputError
from .reference import ag_gemm_reference, gemm_rs_reference

__all__ = ["LayerOps", "OverlapLayerOps", "NcclLayerOps", "TorchSymmLayerOps", "register_layer_ops",
           "unregister_layer_ops", "get_layer_ops", "SAVE_GATHERED"]

SAVE_GATHERED = ("view", "copy")
_REGISTRY: dict[int, "LayerOps"] = {}
_NEXT_ID = itertools.count(1)


class LayerOps:
    """The two communicating GEMMs of one layer on one backend; subclasses implement `ag_gemm`/`gemm_rs`.

    ag_gemm(x [M/W, H], w [H, L]) -> (out [M, L], saved [M, H] or [0, H], stamp); gemm_rs(a [M, L], w [L, H]).
    """
    world_size: int
    name: str = "layer"  # the owning layer's name, for messages (set by the layer)

    def ag_gemm(self, x, w, *, keep: bool):
        raise NotImplementedError

    def gemm_rs(self, a, w):
        raise NotImplementedError

    def gathered(self, saved: torch.Tensor, stamp: int, m: int) -> torch.Tensor:
        """The gathered input [m, H] of the forward that returned (saved, stamp)."""
        return saved

    def saved_rows(self, m: int) -> int:
        """Rows of the `saved` tensor column_forward returns for M = m (its fake impl needs them)."""
        return m

    def gemm_rs_bulk(self, a, w, work):
        """(gemm_rs(a, w), work()): backends that can overlap the reduce-scatter with `work` do."""
        return self.gemm_rs(a, w), work()

    def ag_gemm_wgrad(self, dy, w, x):
        """A row layer's backward: (AG(dy) @ w [M, L], x^T @ AG(dy) [L, H]) for dy [M/W, H], x [M, L]."""
        grad_x, dy_full, _ = self.ag_gemm(dy, w, keep=False)
        return grad_x, torch.mm(x.t(), dy_full)

    def close(self) -> None:
        pass


class OverlapLayerOps(LayerOps):
    """Our AgGemm + GemmRs contexts (pool regions `<ag_name>.a`, `<rs_name>.partials`) and the layer's role
    settings (`bulk_wgrad` of a column layer's fc1_dgrad, `lead_wgrad` of a row layer's fc2_dgrad)."""

    def __init__(self, *, group, pool, max_m: int, hidden: int, local: int, dtype: torch.dtype, config,
                 ag_name: str, rs_name: str, save_gathered: str = "view", bulk_wgrad: bool = False,
                 lead_wgrad: bool = False, fp8: bool = False):
        from .ag_gemm import AgGemm
        from .gemm_rs import GemmRs

        if save_gathered not in SAVE_GATHERED:
            raise OpInputError(f"save_gathered={save_gathered!r}; allowed: {' | '.join(SAVE_GATHERED)}")
        ag_config = config.op_config("ag_gemm", max_m)
        if lead_wgrad and ag_config.method != "decomposed":
            raise OpInputError(f"roles.fc2_dgrad.lead_wgrad needs ops.ag_gemm.method decomposed (the lead runs in "
                               f"place of its lead GEMM); this preset has {ag_config.method}")
        self.world_size = dist.get_world_size(group)
        self.save_gathered, self.bulk_wgrad, self.lead_wgrad = save_gathered, bulk_wgrad, lead_wgrad
        self.fp8 = fp8
        self.ag = AgGemm(group=group, pool=pool, max_m=max_m, k=hidden, n_local=local, dtype=dtype,
                         config=ag_config, name=ag_name, fp8=fp8)
        try:
            self.rs = GemmRs(group=group, pool=pool, max_m=max_m, k_local=local, n=hidden, dtype=dtype,
                             config=config.op_config("gemm_rs", max_m), name=rs_name, fp8=fp8, bulk=bulk_wgrad)
        except BaseException:
            self.ag.close()
            raise

    def ag_gemm(self, x, w, *, keep: bool):
        out = self.ag(x, w)
        m = out.shape[0]
        if keep and self.save_gathered == "copy":  # fp8: the dequantised gathered input (already a new tensor)
            gathered = self.ag.gathered_bf16(m)
            return out, gathered if self.fp8 else gathered.clone(), self.ag.calls
        if keep:
            return out, x.new_empty(0, x.shape[1]), self.ag.calls
        return out, self.ag.gathered_bf16(m), self.ag.calls

    def saved_rows(self, m: int) -> int:
        return m if self.save_gathered == "copy" else 0

    def gathered(self, saved: torch.Tensor, stamp: int, m: int) -> torch.Tensor:
        if self.save_gathered == "copy":
            return saved
        later = self.ag.calls - stamp
        if later:
            raise OpInputError(
                f"{self.name}: the gathered input saved by a forward was overwritten by {later} later forward(s) "
                f"before its backward ran (the pool keeps one); build the layer with save_gathered='copy' for "
                f"schedules with several forwards pending")
        return self.ag.gathered_bf16(m)

    def gemm_rs(self, a, w):
        return self.rs(a, w)

    def gemm_rs_bulk(self, a, w, work):
        if self.bulk_wgrad:
            return self.rs.bulk(a, w, work)
        return super().gemm_rs_bulk(a, w, work)

    def ag_gemm_wgrad(self, dy, w, x):
        if not self.lead_wgrad:
            return super().ag_gemm_wgrad(dy, w, x)
        # lead_wgrad: the weight grad of this rank's rows of dy overlaps the pulls, the input-grad GEMM runs
        # whole (cuBLAS's fast kernel for all M rows), the other rows' weight grad is accumulated onto the
        # lead's in the GEMM epilogue (beta = 1, in place: no extra pass over dw)
        rows = dy.shape[0]
        lo, m = self.ag.rank * rows, rows * self.world_size
        grad_w = torch.empty(x.shape[1], dy.shape[1], dtype=dy.dtype, device=dy.device)
        grad_x = self.ag(dy, w, lead=lambda: torch.mm(x[lo:lo + rows].t(), dy, out=grad_w))
        dy_full = self.ag.gathered_bf16(m)  # fp8: dequantised (the weight grad runs in bf16)
        for first, end in ((0, lo), (lo + rows, m)):
            if end > first:
                grad_w.addmm_(x[first:end].t(), dy_full[first:end])
        return grad_x, grad_w

    def check_errors(self) -> None:
        self.ag.check_errors()

    def close(self) -> None:
        self.ag.close()
        self.rs.close()


class NcclLayerOps(LayerOps):
    """The baseline: plain collectives (NCCL / gloo) then torch.mm, no overlap (overlap/reference.py)."""

    def __init__(self, *, group):
        self.group, self.world_size = group, dist.get_world_size(group)

    def ag_gemm(self, x, w, *, keep: bool):
        out, gathered = ag_gemm_reference(x, w, group=self.group)
        return out, gathered, 0

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

    def ag_gemm(self, x, w, *, keep: bool):
        gathered, outs = torch.ops.symm_mem.fused_all_gather_matmul(x, [w], 0, self.group_name)
        return outs[0], gathered, 0

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
    y, saved, stamp = get_layer_ops(layer_id).ag_gemm(x, w, keep=True)
    return y, saved, torch.tensor(stamp, dtype=torch.int64)


@column_forward.register_fake
def _(x, w, layer_id):
    ops = get_layer_ops(layer_id)
    m = x.shape[0] * ops.world_size
    return (x.new_empty(m, w.shape[1]), x.new_empty(ops.saved_rows(m), x.shape[1]),
            torch.empty((), dtype=torch.int64, device="cpu"))


@torch.library.custom_op("tp_overlap::column_backward", mutates_args=())
def column_backward(grad_y: torch.Tensor, saved: torch.Tensor, stamp: torch.Tensor, w: torch.Tensor,
                    layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    ops = get_layer_ops(layer_id)
    gathered = ops.gathered(saved, int(stamp), grad_y.shape[0])
    grad_y = grad_y.contiguous()
    # w.t() is a view: every backend reads it in place. The weight grad uses the forward's gathered
    # input (no second AllGather) and is independent of grad_x: with bulk_wgrad it hides the RS.
    return ops.gemm_rs_bulk(grad_y, w.t(), lambda: torch.mm(gathered.t(), grad_y))


@column_backward.register_fake
def _(grad_y, saved, stamp, w, layer_id):
    m_shard = grad_y.shape[0] // get_layer_ops(layer_id).world_size
    return grad_y.new_empty(m_shard, w.shape[0]), w.new_empty(w.shape)


@torch.library.custom_op("tp_overlap::row_forward", mutates_args=())
def row_forward(x: torch.Tensor, w: torch.Tensor, layer_id: int) -> torch.Tensor:
    return get_layer_ops(layer_id).gemm_rs(x, w)


@row_forward.register_fake
def _(x, w, layer_id):
    return x.new_empty(x.shape[0] // get_layer_ops(layer_id).world_size, w.shape[1])


@torch.library.custom_op("tp_overlap::row_backward", mutates_args=())
def row_backward(grad_y: torch.Tensor, x: torch.Tensor, w: torch.Tensor,
                 layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    # AllGather of dy overlapped with the GEMM producing dx (with ag_gemm.lead_wgrad: with the weight-grad
    # GEMM of this rank's rows); the gathered dy, a pool view that a later call of this op overwrites, is
    # consumed at once by the weight-grad GEMM
    return get_layer_ops(layer_id).ag_gemm_wgrad(grad_y.contiguous(), w.t(), x)


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
