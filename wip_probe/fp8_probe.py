"""Device probe: where the FP8 Gluon GEMM loses to torch._scaled_mm (ablations of wip_probe/fp8_variants.py,
programs 66 vs 132), medians of 20, L2 flushed, 1.5 ms hold."""
import json
import sys

import torch

sys.path.insert(0, "wip_probe")
import fp8_variants  # noqa: E402
from tp_overlap.gemm import quantize_activation, quantize_weight, scaled_mm_reference, sm_carveout  # noqa
from tp_overlap.gemm import GemmBlocks  # noqa: E402
from tp_overlap.gemm.gluon_launch import split_buffers  # noqa: E402
import tp_overlap.gemm.fp8_gluon_launch as fl  # noqa: E402
import tp_overlap.kernels.gemm_fp8_gluon as base  # noqa: E402
from tp_overlap.launch.measure.timing import bench_interleaved  # noqa: E402

dev = torch.device("cuda")
WHOLE = GemmBlocks.parse("128x128x128w4s4gl")
SPLIT = GemmBlocks.parse("128x128x128w4s4sk1gl")
MODULES = {"base": base}
FOCUS = []  # the kernel now reads the scales after the MMA (scale_late); the edits above no longer apply
ONLY = FOCUS if "focus" in sys.argv else list(fp8_variants.VARIANTS)
MODULES.update({name: fp8_variants.variant_module(name) for name in ONLY if "split" not in sys.argv})


def run(kernel, a8, gm, w8, ws, out, programs=None, blocks=WHOLE, buffers=None):
    saved = base.fp8_gluon_gemm_kernel
    base.fp8_gluon_gemm_kernel = kernel
    try:
        fl.launch_fp8_gluon_gemm(a8=a8, a_scales=gm, w8=w8, w_scales=ws, out=out, num_programs=programs,
                                 blocks=blocks, split_buffers=buffers)
    finally:
        base.fp8_gluon_gemm_kernel = saved


def show(tag, st, ref):
    row = {nm: round(s.median_ms * 1e3, 1) for nm, s in st.items()}
    rel = {nm: round(st[ref].median_ms / s.median_ms, 3) for nm, s in st.items()}
    spread = {nm: round((s.max_ms - s.min_ms) / s.median_ms, 3) for nm, s in st.items()}
    print(tag, json.dumps(row), json.dumps(rel), "spread", json.dumps(spread), flush=True)


def split():
    """The split tail at M = 1024 (448 tiles: 3.4 waves on 132 SMs; 224: 1.7)."""
    buffers = split_buffers(dev, 132)
    for (m, n, k) in [(1024, 7168, 4096), (1024, 7168, 8192), (1024, 3584, 4096), (1024, 14336, 4096)]:
        a = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        w = torch.randn(n, k, device=dev, dtype=torch.bfloat16)
        a8, gm = quantize_activation(a)
        w8, ws = quantize_weight(w)
        out = torch.empty(m, n, device=dev, dtype=torch.bfloat16)
        ref = scaled_mm_reference(a8=a8, a_scales=gm, w8=w8, w_scales=ws).float()
        run(base.fp8_gluon_gemm_kernel, a8, gm, w8, ws, out, blocks=SPLIT, buffers=buffers)
        print("err split", m, n, k, round(((out.float() - ref).norm() / ref.norm()).item(), 5), flush=True)
        vs = {"scaled_mm": lambda: scaled_mm_reference(a8=a8, a_scales=gm, w8=w8, w_scales=ws),
              "whole": lambda: run(base.fp8_gluon_gemm_kernel, a8, gm, w8, ws, out),
              "split": lambda: run(base.fp8_gluon_gemm_kernel, a8, gm, w8, ws, out, blocks=SPLIT, buffers=buffers)}
        st = bench_interleaved(vs, group=None, device=dev, reps=20, hold_device_us=1500)
        show(f"fp8 split {m}x{n}x{k}", st, "scaled_mm")


def focus():
    """Only FOCUS's variants (which half of the scales costs), without the 66-program comparison."""
    main(shapes=[(16384, 14336, 4096), (4096, 3584, 4096)], half_sms=False)


def main(shapes=((16384, 14336, 4096), (16384, 7168, 8192), (4096, 28672, 8192), (4096, 3584, 4096)),
         half_sms=True):
    for (m, n, k) in shapes:
        a = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        w = torch.randn(n, k, device=dev, dtype=torch.bfloat16)
        a8, gm = quantize_activation(a)
        w8, ws = quantize_weight(w)
        out = torch.empty(m, n, device=dev, dtype=torch.bfloat16)
        ref = scaled_mm_reference(a8=a8, a_scales=gm, w8=w8, w_scales=ws).float()
        vs = {"scaled_mm": lambda: scaled_mm_reference(a8=a8, a_scales=gm, w8=w8, w_scales=ws)}
        for name, mod in MODULES.items():
            try:
                run(mod.fp8_gluon_gemm_kernel, a8, gm, w8, ws, out)
                torch.cuda.synchronize()
            except Exception as exc:  # noqa: BLE001 -- a variant that fails is reported, the others run
                print("failed", name, type(exc).__name__, str(exc)[-300:], flush=True)
                continue
            err = ((out.float() - ref).norm() / ref.norm()).item()
            print("err", m, n, k, name, round(err, 5), flush=True)
            vs[name] = lambda mod=mod: run(mod.fp8_gluon_gemm_kernel, a8, gm, w8, ws, out)
        st = bench_interleaved(vs, group=None, device=dev, reps=20, hold_device_us=1500)
        show(f"fp8 {m}x{n}x{k}", st, "scaled_mm")
        if not half_sms:
            continue

        def sm66():
            with sm_carveout(66):
                scaled_mm_reference(a8=a8, a_scales=gm, w8=w8, w_scales=ws)
        half = {"scaled_mm": vs["scaled_mm"], "scaled_mm_66": sm66, "base": vs["base"],
                "base_66": lambda: run(base.fp8_gluon_gemm_kernel, a8, gm, w8, ws, out, 66)}
        st = bench_interleaved(half, group=None, device=dev, reps=20, hold_device_us=1500)
        show(f"fp8 66 programs {m}x{n}x{k}", st, "scaled_mm")


if __name__ == "__main__":
    try:
        for part in sys.argv[1:]:
            globals()[part]()
    finally:
        import pathlib
        for p in pathlib.Path("kernels").glob("_probe_*.py"):
            p.unlink()
