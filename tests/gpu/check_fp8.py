"""GPU correctness of the FP8 quantisers and GEMM and of the bf16 GEMM's stream-K path, compiled (not the
interpreter): one PASS/FAIL line per check with its error, exit status 1 on any FAIL.

    python -m tests.gpu.check_fp8            # on the GPU machine
    python -m tests.gpu.check_fp8 --cpu      # tiny shapes under the Triton interpreter: checks the script

Checks: the quantisers give torch's reference bytes and scales (RNE, correctly rounded divisions); the
FP8 GEMM matches the fp32 product of the dequantised operands (bf16 rounding only: relative Frobenius
<= 5e-3) and torch._scaled_mm with the same scale tensors, for K = 1280 and 1344, M/N tails, padding past K
and past the last scale group poisoned with NaN, every FP8 candidate; the chunk-wait mode with ready
flags, and a stale flag timing out by %globaltimer with its error code; stream-K bf16 GEMMs (both layouts)
against cuBLAS with their flags back at zero, and a late contributor recomputed by its finisher; the Gluon FP8
kernel's split tail (GPU only).
"""

from __future__ import annotations

import sys
import time

import torch

from tests.gpu.checklist import Checks, expect, rel, target_device

FP8_TOLERANCE = 5e-3
BF16_TOLERANCE = 1e-2
check = Checks()


# (full size on the GPU, tiny under the interpreter)
SHAPES = {"act": ((1000, 1344), (4096, 1280), (37, 300)), "weight": ((1032, 1344), (3072, 4096)),
          "gemm": ((1000, 1032, 1344), (256, 4096, 1280), (4096, 3072, 4096)),
          "scaled_mm": ((1000, 1024, 1536), (256, 4096, 2048), (4096, 3072, 4096)), "unaligned": (333, 200, 1000),
          "wait": (4, 250, 1024, 1344), "stream_k": ((1024, 3072, 4096), (1000, 768, 4104), (4096, 1280, 8192)),
          "late": (1024, 3072, 4096)}
# (blocks, (M, N, K)) that split_plan cuts on 132 SMs: a K tail (64.5 groups), 64-wide tiles, a 3.4-wave grid
SPLIT_TAILS = (("128x128x128w4s4sk1gl", (1000, 776, 8256)), ("128x64x128w4s4sk1gl", (1000, 392, 8256)),
               ("128x128x128w4s4sk1gl", (1024, 7168, 4096)))
TINY = {"act": ((40, 1344), (37, 300)), "weight": ((136, 1344),), "gemm": ((40, 72, 1344),),
        "scaled_mm": ((40, 64, 1536),), "unaligned": (33, 40, 200), "wait": (3, 23, 64, 1344),
        "stream_k": ((200, 264, 320), (136, 520, 136)), "late": (136, 520, 320)}


def main(argv=None) -> int:
    dev = target_device(argv)
    if dev is None:
        return 1
    cpu = dev.type == "cpu"
    from tp_overlap.kernels.constants import ag_tile_row_offset
    from tp_overlap.launch.measure.tune import FP8_CANDIDATES
    from tp_overlap.gemm import GemmBlocks, fp8, num_sms, triton_mm
    from tp_overlap.gemm.launch import _stream_k_args

    shapes = TINY if cpu else SHAPES
    candidates = FP8_CANDIDATES[:2] if cpu else FP8_CANDIDATES
    stream_k_names = ("128x256x64w8s3sk1", "64x128x64w4s4sk1") if cpu else (
        "128x256x64w8s3sk1", "128x256x64w8s3sk2", "128x128x64w8s4sk1", "64x128x64w4s4sk1")
    gen = torch.Generator(device=dev).manual_seed(0)

    def synchronize():
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    def grouped(rows, cols, block_rows):
        x = torch.randn(rows, cols, generator=gen, device=dev)
        exps = torch.randint(-3, 4, (-(-rows // block_rows), -(-cols // 128)), generator=gen, device=dev).float()
        factors = torch.exp2(exps).repeat_interleave(block_rows, 0).repeat_interleave(128, 1)
        return (x * factors[:rows, :cols]).bfloat16()

    @check("quantize_activation: torch's bytes and scales, layout (1, M)")
    def _():
        for m, k in shapes["act"]:
            x = grouped(m, k, 1) * torch.exp2(torch.linspace(-20, 8, m, device=dev))[:, None].bfloat16()
            x[1, :128] = 0
            q, s = fp8.quantize_activation(x)
            rq, rs = fp8.quantize_activation_reference(x)
            expect(s.stride() == (1, m), f"scale strides {s.stride()}")
            differ = (q.float() != rq.float()).sum().item()
            expect(differ == 0, f"M={m} K={k}: {differ} values differ")
            expect(torch.equal(s, rs), f"M={m} K={k}: scales differ, max {(s - rs).abs().max().item():.3g}")
        return f"{len(shapes['act'])} shapes"

    @check("quantize_weight: torch's bytes and 128x128 scales")
    def _():
        for n, k in shapes["weight"]:
            w = grouped(n, k, 128) * 0.02
            q, s = fp8.quantize_weight(w)
            rq, rs = fp8.quantize_weight_reference(w)
            expect(torch.equal(q.float(), rq.float()) and torch.equal(s, rs), f"N={n} K={k} differ")
        return f"{len(shapes['weight'])} shapes"

    def gemm_case(m, n, k, blocks):
        x8, xs = fp8.quantize_activation(grouped(m, k, 1))
        w8, ws = fp8.quantize_weight(grouped(n, k, 128) * 0.05)
        pad = torch.full((m, k + 64), 0x7F, dtype=torch.uint8, device=dev).view(fp8.FP8_DTYPE)  # NaN past K
        pad[:, :k] = x8
        scale_pad = torch.full((xs.shape[1] + 2, m), float("nan"), device=dev)
        scale_pad[: xs.shape[1]] = xs.t()
        out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device=dev)
        fp8.fp8_gemm(a8=pad[:, :k], a_scales=scale_pad.t()[:, : xs.shape[1]], w8=w8, w_scales=ws, out=out,
                     blocks=blocks)
        ref = fp8.dequantize_activation(x8, xs) @ fp8.dequantize_weight(w8, ws).T
        return out, ref, (x8, xs, w8, ws)

    @check("fp8_gemm vs the dequantised fp32 product, K 1280/1344, M/N tails, every candidate")
    def _():
        worst = 0.0
        for name in ("default",) + tuple(candidates):
            blocks = None if name == "default" else GemmBlocks.parse(name)
            for m, n, k in shapes["gemm"]:
                out, ref, _ = gemm_case(m, n, k, blocks)
                worst = max(worst, rel(out, ref))
                expect(rel(out, ref) <= FP8_TOLERANCE, f"{name} M={m} N={n} K={k}: {rel(out, ref):.3g}")
        return f"worst {worst:.2e}"

    # cuBLAS takes block scales only for K/128 a multiple of 4 (scaled_mm_reference); partial last groups are
    # checked against the dequantised product above
    @check("fp8_gemm vs torch._scaled_mm with the same block scales (K/128 = 12, 16, 32; M tail)")
    def _():
        worst = 0.0
        for m, n, k in shapes["scaled_mm"]:
            out, _, (x8, xs, w8, ws) = gemm_case(m, n, k, None)
            mm = fp8.scaled_mm_reference(a8=x8, a_scales=xs, w8=w8, w_scales=ws)
            worst = max(worst, rel(out, mm))
            expect(rel(out, mm) <= FP8_TOLERANCE, f"M={m} N={n} K={k}: {rel(out, mm):.3g}")
        return f"worst {worst:.2e}"

    @check("fp8_gemm unaligned (pointer path): K % 16 != 0")
    def _():
        out, ref, _ = gemm_case(*shapes["unaligned"], GemmBlocks.parse("128x128x128w8s4"))
        expect(rel(out, ref) <= FP8_TOLERANCE, f"{rel(out, ref):.3g}")
        return f"{rel(out, ref):.2e}"

    @check("Gluon FP8 split tail (sk1): the last wave's pieces summed; vs the dequantised product and the whole "
           "tiles, bitwise repeatable, counters back at zero")
    def _():
        if cpu:
            return "skipped: Gluon kernels need a CUDA device"
        import dataclasses

        from tp_overlap.gemm.fp8_gluon_launch import SPLIT_BUILD_SLOWDOWN
        from tp_overlap.gemm.gluon_launch import split_buffers, split_tail

        buffers, notes = split_buffers(dev, num_sms(dev)), []
        for name, (m, n, k) in SPLIT_TAILS:
            blocks = GemmBlocks.parse(name)
            cut = split_tail(blocks, m, n, k, num_sms(dev), dev, buffers, operand_bytes=1,
                             split_build_slowdown=SPLIT_BUILD_SLOWDOWN)[2]  # as the launcher plans it
            expect(cut > 1, f"{name} M={m} N={n} K={k}: not split on {num_sms(dev)} SMs")
            x8, xs = fp8.quantize_activation(grouped(m, k, 1))
            w8, ws = fp8.quantize_weight(grouped(n, k, 128) * 0.05)
            pad = torch.full((m, k + 64), 0x7F, dtype=torch.uint8, device=dev).view(fp8.FP8_DTYPE)  # NaN past K
            pad[:, :k] = x8
            runs = [fp8.fp8_gemm(a8=pad[:, :k], a_scales=xs, w8=w8, w_scales=ws, blocks=blocks, split_buffers=buffers)
                    for _ in range(2)]
            whole = fp8.fp8_gemm(a8=x8, a_scales=xs, w8=w8, w_scales=ws, blocks=dataclasses.replace(blocks, stream_k=0))
            ref = fp8.dequantize_activation(x8, xs) @ fp8.dequantize_weight(w8, ws).T
            synchronize()
            expect(rel(runs[0], ref) <= FP8_TOLERANCE and rel(runs[0], whole) <= FP8_TOLERANCE,
                   f"{name} M={m} N={n} K={k}: {rel(runs[0], ref):.3g} from the product, {rel(runs[0], whole):.3g} "
                   "from whole tiles")
            expect(torch.equal(runs[0], runs[1]), f"{name} M={m} N={n} K={k}: two runs differ")
            expect(int(buffers[1].abs().sum()) == 0, f"{name}: counters left at {buffers[1].nonzero().tolist()}")
            notes.append(f"{name} {m}x{n}x{k}: {cut} splits, {rel(runs[0], ref):.1e}")
        return "; ".join(notes)

    @check("fp8_gemm chunk waits: ready flags, then a stale flag times out (%globaltimer) with its code")
    def _():
        world, rows, n, k = shapes["wait"]
        plain = fp8.choose_fp8_blocks(world * rows, n, k, warp_specialize=False, device_type=dev.type)
        x8, xs = fp8.quantize_activation(grouped(world * rows, k, 1))
        w8, ws = fp8.quantize_weight(grouped(n, k, 128))
        flags = torch.ones(world * 2, dtype=torch.int32, device=dev)
        errors = torch.zeros(3, dtype=torch.int32, device=dev)   # a control page: [code, value, abort]
        wait = fp8.ChunkWait(flags=flags, rows_per_rank=rows, chunks_per_rank=2, error_words=errors,
                             error_code_base=100, timeout_s=2.0)
        out = fp8.fp8_gemm(a8=x8, a_scales=xs, w8=w8, w_scales=ws, blocks=plain, chunk_wait=wait,
                           tile_row_offset=ag_tile_row_offset(1, rows, plain.block_m))
        ref = fp8.dequantize_activation(x8, xs) @ fp8.dequantize_weight(w8, ws).T
        expect(errors[0].item() == 0 and rel(out, ref) <= FP8_TOLERANCE, f"error {errors.tolist()}, {rel(out, ref):.3g}")
        flags[5] = 0
        start = time.perf_counter()
        fp8.fp8_gemm(a8=x8, a_scales=xs, w8=w8, w_scales=ws, blocks=plain,
                     chunk_wait=fp8.ChunkWait(flags=flags, rows_per_rank=rows, chunks_per_rank=2, error_words=errors,
                                              error_code_base=100, timeout_s=0.002))
        synchronize()
        expect(errors[0].item() == 100 + 5, f"error words {errors.tolist()}, expected code 105")
        return f"timeout path {1e3 * (time.perf_counter() - start):.1f} ms"

    @check("bf16 stream-K (both layouts) vs cuBLAS, flags back at zero; a late contributor is recomputed")
    def _():
        worst = 0.0
        for name in stream_k_names:
            for m, n, k in shapes["stream_k"]:
                for layout in ("kn", "nk"):
                    a = torch.randn(m, k, generator=gen, device=dev, dtype=torch.bfloat16)
                    w = torch.randn(n, k, generator=gen, device=dev, dtype=torch.bfloat16) / k ** 0.5
                    b = w.t() if layout == "nk" else w.t().contiguous()
                    out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device=dev)
                    triton_mm(a, b, out, blocks=GemmBlocks.parse(name))
                    err = rel(out, torch.mm(a, b))
                    worst = max(worst, err)
                    expect(err <= BF16_TOLERANCE, f"{name} {layout} M={m} N={n} K={k}: {err:.3g}")
        blocks = GemmBlocks.parse("128x256x64w8s3sk1")
        _, flags, _ = _stream_k_args(dev, num_sms(dev), blocks)   # the buffers the launcher will use
        synchronize()
        expect(int(flags.abs().sum().item()) == 0, f"flags left at {flags.nonzero().flatten().tolist()}")
        flags[::3] = -1000   # contributors whose +1 never reaches 1: their finishers time out and recompute
        m, n, k = shapes["late"]
        a = torch.randn(m, k, generator=gen, device=dev, dtype=torch.bfloat16)
        b = torch.randn(k, n, generator=gen, device=dev, dtype=torch.bfloat16) / k ** 0.5
        out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device=dev)
        triton_mm(a, b, out, blocks=blocks)
        expect(rel(out, torch.mm(a, b)) <= BF16_TOLERANCE, "late-contributor recompute is wrong")
        left = flags[::3].tolist()
        flags.zero_()
        expect(all(v == -1000 for v in left), f"late-contributor flags not restored: {left[:5]}")
        return f"worst {worst:.2e}"

    return check.summary()


if __name__ == "__main__":
    sys.exit(main())
