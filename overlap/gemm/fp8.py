"""FP8 (e4m3) GEMM with fine-grained scales (DeepSeek-V3 recipe): quantisers, a weight cache, the
persistent Triton GEMM and its reference.

Layouts (those of cuBLAS's blockwise `torch._scaled_mm`, so one set of tensors feeds both):

* an activation x [M, K] becomes x8 [M, K] e4m3 and `x_scales` [M, cdiv(K, 128)] fp32 -- one scale per
  row per 128-wide K group, stored group-major: a view with strides (1, M) of a [cdiv(K, 128), M] tensor
  (`scale_a` of `torch._scaled_mm` as is);
* a weight w [N, K] (nn.Linear) becomes w8 [N, K] e4m3 and `w_scales` [cdiv(N, 128), cdiv(K, 128)] fp32,
  row-major with rows padded to a multiple of 4 scales (16 bytes, for TMA) -- one scale per 128x128 block
  (`scale_b` is `w_scales.t()`, next to `w8.t()`).

    x8, x_scales = quantize_activation(x)
    w8, w_scales = cache.get(weight)                     # Fp8WeightCache: once per optimizer step
    y = fp8_gemm(a8=x8, a_scales=x_scales, w8=w8, w_scales=w_scales)          # [M, N] bf16 = x @ w.T
    ref = scaled_mm_reference(a8=x8, a_scales=x_scales, w8=w8, w_scales=w_scales)  # cuBLAS / CPU fp32

Every output is written on the current stream and valid there (no other stream or event is involved).
Quantisation: `scale = max(amax, 2**-64) / 448`, values rounded to nearest e4m3 (kernels/quant_fp8.py).
Accuracy (docs/MEASUREMENT.md): fp8_gemm matches the fp32 product of the dequantised operands up to
the bf16 rounding of its output; against the unquantised bf16 product, e4m3 operands give ~4e-2 relative
Frobenius error on Gaussian data.
"""

from __future__ import annotations

import weakref

import torch

from tp_overlap.kernels.constants import SCALE_GROUP

from .blocks import DEFAULT_GPU, GemmBlocks, load_block_table
from .fp8_gluon_launch import gluon_block_problems, gluon_operand_problems, launch_fp8_gluon_gemm
from .fp8_launch import ChunkWait, launch_fp8_gemm, launch_quantize_activation, launch_quantize_weight
from .triton_gemm import gpu_name

SCALE_ROW_ALIGN = 4  # stored rows of fp32 scales are padded to 16 bytes: the Gluon GEMM reads them with TMA

__all__ = ["FP8_DTYPE", "SCALE_GROUP", "ChunkWait", "Fp8WeightCache", "scale_groups", "padded_scale_groups",
           "quantize_activation", "quantize_weight", "fp8_gemm", "choose_fp8_blocks", "fp8_default_blocks",
           "scaled_mm_reference", "quantize_activation_reference", "quantize_weight_reference", "dequantize_activation",
           "dequantize_weight"]

FP8_DTYPE = torch.float8_e4m3fn
FP8_HEURISTIC = "128x128x128w4s4gl"  # a GPU without an FP8 table: the Gluon FP8 kernel
_FLOAT_INPUTS = (torch.bfloat16, torch.float16, torch.float32)
_OUTPUTS = (torch.bfloat16, torch.float16, torch.float32)


def scale_groups(size: int) -> int:
    """Scale groups of `size` elements (one per 128, the last possibly partial)."""
    return -(-size // SCALE_GROUP)


def padded_scale_groups(size: int) -> int:
    """`scale_groups(size)` rounded up to SCALE_ROW_ALIGN: the row stride of stored scale rows (16 bytes)."""
    return -(-scale_groups(size) // SCALE_ROW_ALIGN) * SCALE_ROW_ALIGN


def _check_matrix(name: str, t: torch.Tensor, dtypes) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a tensor, got {type(t).__name__}")
    if t.dim() != 2:
        raise ValueError(f"{name}: expected a 2-D tensor, got shape {tuple(t.shape)}")
    if t.dtype not in dtypes:
        raise TypeError(f"{name}: dtype {t.dtype} not in {tuple(str(d) for d in dtypes)}")
    if t.stride(1) != 1 and t.shape[1] > 1:
        raise ValueError(f"{name}: the last dimension must be contiguous (strides {tuple(t.stride())})")


def quantize_activation(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (bf16, fp16 or fp32, rows contiguous) -> (x8 [M, K] float8_e4m3fn, x_scales [M, cdiv(K, 128)]
    float32 with strides (1, M)), one pass over x, valid on the current stream."""
    _check_matrix("quantize_activation: x", x, _FLOAT_INPUTS)
    m, k = x.shape
    q = torch.empty(m, k, dtype=FP8_DTYPE, device=x.device)
    scales = torch.empty(scale_groups(k), m, dtype=torch.float32, device=x.device).t()
    if m and k:
        launch_quantize_activation(x=x, q=q, scales=scales)
    return q, scales


def quantize_weight(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] (the nn.Linear layout; bf16, fp16 or fp32, rows contiguous) -> (w8 [N, K] float8_e4m3fn,
    w_scales [cdiv(N, 128), cdiv(K, 128)] float32, rows contiguous and 16-byte aligned: the row stride is
    cdiv(K, 128) rounded up to a multiple of 4, which TMA loads need), valid on the current stream."""
    _check_matrix("quantize_weight: w", w, _FLOAT_INPUTS)
    n, k = w.shape
    q = torch.empty(n, k, dtype=FP8_DTYPE, device=w.device)
    scales = torch.zeros(scale_groups(n), padded_scale_groups(k), dtype=torch.float32,
                         device=w.device)[:, :scale_groups(k)]
    if n and k:
        launch_quantize_weight(w=w, q=q, scales=scales)
    return q, scales


class Fp8WeightCache:
    """Quantised weights, recomputed only when a weight changes. Keyed on the tensor that owns the memory
    (`weight._base` for a view such as an op's `w.t()`, held by weak reference: a new tensor that the allocator
    puts at a freed weight's address is not that weight) and on the view's data_ptr, shape, strides, dtype and
    `_version` (shared with its base, bumped by every in-place update, e.g. an optimizer step). Writes through
    `weight.data` do not bump `_version`: call `invalidate()` after them. One entry per owner; `hits` / `misses`
    count lookups (one miss per weight per optimizer step is the expected rate)."""

    def __init__(self):
        self._entries: dict[int, tuple] = {}
        self.hits = 0
        self.misses = 0

    @staticmethod
    def _key(weight: torch.Tensor) -> tuple:
        return (weight.data_ptr(), tuple(weight.shape), tuple(weight.stride()), weight.dtype, weight.device,
                weight._version)

    @staticmethod
    def _owner(weight: torch.Tensor) -> torch.Tensor:
        return weight._base if weight._base is not None else weight

    def get(self, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(w8, w_scales) of `weight` [N, K] (any strides: a transposed view is copied before quantising),
        quantised on the current stream when not cached."""
        owner = self._owner(weight)
        entry = self._entries.get(id(owner))
        if entry is not None and entry[0]() is owner and entry[1] == self._key(weight):
            self.hits += 1
            return entry[2], entry[3]
        self.misses += 1
        with torch.no_grad():
            source = weight.detach()
            w8, scales = quantize_weight(source if source.stride(-1) == 1 else source.contiguous())
        ref = weakref.ref(owner, lambda _, key=id(owner): self._entries.pop(key, None))
        self._entries[id(owner)] = (ref, self._key(weight), w8, scales)
        return w8, scales

    def invalidate(self, weight: torch.Tensor | None = None) -> None:
        """Forget `weight`'s owner (or every weight)."""
        if weight is None:
            self._entries.clear()
        else:
            self._entries.pop(id(self._owner(weight)), None)

    def __len__(self) -> int:
        return len(self._entries)


def _check_gemm_operands(a8, a_scales, w8, w_scales, out) -> tuple[int, int, int]:
    _check_matrix("fp8_gemm: a8", a8, (FP8_DTYPE,))
    _check_matrix("fp8_gemm: w8", w8, (FP8_DTYPE,))
    m, k = a8.shape
    n = w8.shape[0]
    if w8.shape[1] != k:
        raise ValueError(f"fp8_gemm: a8 {tuple(a8.shape)} and w8 {tuple(w8.shape)} disagree on K (w8 is [N, K])")
    for name, scales, shape in (("a_scales", a_scales, (m, scale_groups(k))), ("w_scales", w_scales,
                                                                         (scale_groups(n), scale_groups(k)))):
        if not isinstance(scales, torch.Tensor) or scales.dtype != torch.float32 or tuple(scales.shape) != shape:
            got = f"{scales.dtype} {tuple(scales.shape)}" if isinstance(scales, torch.Tensor) else type(scales).__name__
            raise ValueError(f"fp8_gemm: {name} must be float32 {shape} for a8 {tuple(a8.shape)}, w8 "
                             f"{tuple(w8.shape)} (one scale per 128 of K); got {got}")
    if out is not None:
        _check_matrix("fp8_gemm: out", out, _OUTPUTS)
        if tuple(out.shape) != (m, n):
            raise ValueError(f"fp8_gemm: out must be {(m, n)} for a8 {tuple(a8.shape)}, w8 {tuple(w8.shape)}; "
                             f"got {tuple(out.shape)}")
    devices = {t.device for t in (a8, a_scales, w8, w_scales) + ((out,) if out is not None else ())}
    if len(devices) != 1:
        raise ValueError(f"fp8_gemm: all tensors must be on one device, got {sorted(map(str, devices))}")
    return m, n, k


def choose_fp8_blocks(m: int, n: int, k: int, *, warp_specialize: bool = True, device_type: str = "cuda",
                      gpu: str | None = DEFAULT_GPU) -> GemmBlocks:
    """Blocks of the FP8 GEMM (BLOCK_K is the scale group, 128): the table `configs/gemm_blocks/<gpu>_fp8.yaml`
    when it has (N, K) (written by `tp_overlap.launch.gemm_bench --fp8 --write-table`), else 128x128 tiles: on
    the Gluon kernel (FP8_HEURISTIC), or plain with `warp_specialize=False`."""
    if device_type != "cuda":
        return GemmBlocks(16, 32, SCALE_GROUP, 4, 1, 1)
    table = load_block_table(f"{gpu}_fp8") if gpu else None
    entry = table.lookup(m, n, k, "nk") if table is not None else None
    if entry is not None and (warp_specialize or entry.plain.programs_per_sm == 1):  # o2: see GemmBlocks.plain
        return entry.blocks if warp_specialize else entry.plain
    # the H200 table's choice at 102 of its 120 shapes; plain: its usual plain column (a warp-specialised
    # @triton.jit default computed wrong tiles on the H200, results/gemm_fp8_h200.json)
    return GemmBlocks.parse(FP8_HEURISTIC) if warp_specialize else GemmBlocks(128, 128, SCALE_GROUP, 8, 8, 4)


def fp8_default_blocks(m: int, n: int, k: int, *, chunk_wait: bool, device_type: str, gpu: str | None) -> GemmBlocks:
    """The blocks `fp8_gemm` runs when given none, before it checks that TMA can read the call's operands
    (where it cannot: the plain choice): the table's choice, or with chunk waits the plain one in place of a
    warp-specialised @triton.jit choice (which cannot wait)."""
    blocks = choose_fp8_blocks(m, n, k, device_type=device_type, gpu=gpu)
    if chunk_wait and not blocks.gluon:
        blocks = choose_fp8_blocks(m, n, k, warp_specialize=False, device_type=device_type, gpu=gpu)
    return blocks


def fp8_gemm(*, a8: torch.Tensor, a_scales: torch.Tensor, w8: torch.Tensor, w_scales: torch.Tensor,
             out: torch.Tensor | None = None, out_dtype: torch.dtype = torch.bfloat16, num_programs: int | None = None,
             blocks: GemmBlocks | None = None, tile_row_offset: int = 0, chunk_wait: ChunkWait | None = None,
             split_buffers: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """out [M, N] = (a8 * a_scales) @ (w8 * w_scales).T with fp32 accumulation (a8 [M, K] and w8 [N, K]
    float8_e4m3fn, scales as `quantize_activation` / `quantize_weight` make them, any strides), on the
    current stream with `num_programs` persistent programs (default: every SM); `out` (rows contiguous,
    bf16 by default) is valid on the current stream when this returns. `chunk_wait` runs the AllGather
    consumer mode (tiles wait for the chunks of a8 they read: the Gluon kernel's producer warp, or the
    @triton.jit kernel without warp specialisation).
    Gluon blocks (`gl`) read the operands with TMA (`gluon_operand_problems`): where they cannot, the
    table's choice falls back to its plain blocks, and explicit `gl` blocks raise ValueError. Gluon blocks with
    `sk1` cut the last partial wave by K into `split_buffers` (gluon_launch.split_buffers: a caller's own, made
    once), else into the current stream's (allocated at its first use: warm up before a CUDA-graph capture)."""
    m, n, k = _check_gemm_operands(a8, a_scales, w8, w_scales, out)
    if out is None:
        out = torch.empty(m, n, dtype=out_dtype, device=a8.device)
    operand_problems = None
    if blocks is None:
        gpu = gpu_name(a8.device)
        blocks = fp8_default_blocks(m, n, k, chunk_wait=chunk_wait is not None, device_type=a8.device.type, gpu=gpu)
        if blocks.gluon:
            operand_problems = gluon_operand_problems(a8=a8, a_scales=a_scales, w8=w8, w_scales=w_scales, out=out)
            if operand_problems:  # e.g. scale rows of M % 4 != 0: the table's plain blocks for this shape
                blocks = choose_fp8_blocks(m, n, k, warp_specialize=False, device_type=a8.device.type, gpu=gpu)
    if blocks.block_k != SCALE_GROUP or (blocks.stream_k and not blocks.gluon) or (
            blocks.block_n > SCALE_GROUP and blocks.block_n % SCALE_GROUP):
        raise ValueError(f"fp8_gemm: blocks {blocks.name}: BLOCK_K must be {SCALE_GROUP}, BLOCK_N <= 128 or a "
                         "multiple of 128, stream-K only as a Gluon split tail (sk1)")
    if a8.is_cuda and blocks.problems(operand_bytes=1):
        raise ValueError(f"fp8_gemm: blocks {blocks.name}: {'; '.join(blocks.problems(operand_bytes=1))}")
    if chunk_wait is not None and (blocks.warp_specialize or blocks.flatten):
        raise ValueError(f"fp8_gemm: chunk_wait needs blocks without ws / fl, got {blocks.name}")
    if blocks.gluon:
        if operand_problems is None:
            operand_problems = gluon_operand_problems(a8=a8, a_scales=a_scales, w8=w8, w_scales=w_scales, out=out)
        _launch_gluon(a8, a_scales, w8, w_scales, out, blocks, num_programs, tile_row_offset, chunk_wait,
                      operand_problems, split_buffers)
    elif m and n:
        launch_fp8_gemm(a8=a8, a_scales=a_scales, w8=w8, w_scales=w_scales, out=out, blocks=blocks,
                        num_programs=num_programs, tile_row_offset=tile_row_offset, chunk_wait=chunk_wait)
    return out


def _launch_gluon(a8, a_scales, w8, w_scales, out, blocks: GemmBlocks, num_programs, tile_row_offset, chunk_wait,
                  operand_problems: list[str], split_buffers) -> None:
    problems = gluon_block_problems(blocks) + operand_problems
    if not a8.is_cuda:
        problems.append("needs a CUDA device (Gluon kernels do not run under the interpreter)")
    if problems:
        raise ValueError(f"fp8_gemm: blocks {blocks.name}: {'; '.join(problems)}")
    if out.shape[0] and out.shape[1]:
        launch_fp8_gluon_gemm(a8=a8, a_scales=a_scales, w8=w8, w_scales=w_scales, out=out, blocks=blocks,
                              num_programs=num_programs, checked=True, tile_row_offset=tile_row_offset,
                              chunk_wait=chunk_wait, split_buffers=split_buffers)


def _reference_groups(values: torch.Tensor, amax: torch.Tensor):
    # tensor / tensor: torch evaluates `scalar / tensor` as a reciprocal times the scalar, which is not the
    # correctly rounded quotient the kernels compute
    from tp_overlap.kernels.quant_fp8 import AMAX_FLOOR, E4M3_MAX

    amax = amax.clamp_min(AMAX_FLOOR)
    full = torch.full_like(amax, E4M3_MAX)
    return amax / full, full / amax


def quantize_activation_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain torch, the oracle of `quantize_activation`: (x8 [M, K], scales [M, cdiv(K, 128)] contiguous),
    the same bytes and scales (up to the sign of zeros) on CPU and CUDA."""
    m, k = x.shape
    kb = scale_groups(k)
    groups = torch.nn.functional.pad(x.float(), (0, kb * SCALE_GROUP - k)).view(m, kb, SCALE_GROUP)
    scale, inverse = _reference_groups(groups, groups.abs().amax(-1))
    q = (groups * inverse[..., None]).clamp(-448, 448).to(FP8_DTYPE)
    return q.view(m, -1)[:, :k], scale


def quantize_weight_reference(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain torch, the oracle of `quantize_weight`: (w8 [N, K], scales [cdiv(N, 128), cdiv(K, 128)])."""
    n, k = w.shape
    nb, kb = scale_groups(n), scale_groups(k)
    blocks = torch.nn.functional.pad(w.float(), (0, kb * SCALE_GROUP - k, 0, nb * SCALE_GROUP - n))
    blocks = blocks.view(nb, SCALE_GROUP, kb, SCALE_GROUP)
    scale, inverse = _reference_groups(blocks, blocks.abs().amax((1, 3)))
    q = (blocks * inverse[:, None, :, None]).clamp(-448, 448).to(FP8_DTYPE)
    return q.view(nb * SCALE_GROUP, kb * SCALE_GROUP)[:n, :k], scale


def dequantize_activation(x8: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """fp32 [M, K] = x8 * its per-(row, 128-group) scale."""
    k = x8.shape[1]
    return x8.float() * scales.float().repeat_interleave(SCALE_GROUP, dim=1)[:, :k]


def dequantize_weight(w8: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """fp32 [N, K] = w8 * its per-128x128-block scale."""
    n, k = w8.shape
    full = scales.float().repeat_interleave(SCALE_GROUP, dim=0).repeat_interleave(SCALE_GROUP, dim=1)
    return w8.float() * full[:n, :k]


def scaled_mm_reference(*, a8: torch.Tensor, a_scales: torch.Tensor, w8: torch.Tensor, w_scales: torch.Tensor,
                        out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """The same product by cuBLAS (CUDA: `torch._scaled_mm` with the block scales, on the current stream) or,
    on CPU, by dequantising both operands and multiplying in fp32.

    CUDA needs K/128 (the scale groups) to be a multiple of 4: on the H200 with torch 2.11, unpadded scales
    with 11 or 14 groups gave NaN and scale_b padded to 12 groups was refused, so such K raise ValueError
    here (compare against the dequantised product instead)."""
    _check_gemm_operands(a8, a_scales, w8, w_scales, None)
    if not a8.is_cuda:
        return (dequantize_activation(a8, a_scales) @ dequantize_weight(w8, w_scales).T).to(out_dtype)
    if w_scales.shape[1] % 4:
        raise ValueError(f"scaled_mm_reference: K = {a8.shape[1]} has {w_scales.shape[1]} scale groups; "
                         f"torch._scaled_mm's block scales need a multiple of 4")
    return torch._scaled_mm(a8, w8.t(), scale_a=a_scales, scale_b=w_scales.t(), out_dtype=out_dtype)
