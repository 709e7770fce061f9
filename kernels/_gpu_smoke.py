# TEMPORARY: GPU smoke/bench for kernels/gemm.py; deleted after use.
import statistics
import sys
import time

import torch
import triton

from kernels.gemm import persistent_gemm_kernel, reduce_partials_kernel, scatter_flags_per_source, cdiv

dev = "cuda"
triton.set_allocator(lambda size, alignment, stream: torch.empty(size, dtype=torch.int8, device=dev))
NUM_SMS = torch.cuda.get_device_properties(0).multi_processor_count


def gemm(a, b, c, programs, cfg, ws=False, epi=0, scatter=None, b_t=False):
    m, k = a.shape
    n = c.shape[1] if epi == 0 else (b.shape[0] if b_t else b.shape[1])
    bm, bn, bk, warps, stages = cfg
    if scatter is None:
        scatter = (None, None, None, 0, 0, 1, 0)
    persistent_gemm_kernel[(programs,)](
        a, b, c, m, n, k, a.stride(0), b.stride(0), c.stride(0) if epi == 0 else n, 0, *scatter,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, EPILOGUE=epi, USE_DESCRIPTORS=True,
        B_TRANSPOSED=b_t, WARP_SPECIALIZE=ws, num_warps=warps, num_stages=stages)


def bench(fns, reps=15):
    times = {name: [] for name in fns}
    for fn in fns.values():
        fn()
    torch.cuda.synchronize()
    for _ in range(reps):
        for name, fn in fns.items():
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record(); fn(); e.record(); torch.cuda.synchronize()
            times[name].append(s.elapsed_time(e))
    return {name: statistics.median(t) for name, t in times.items()}


def perf():
    cfgs = {"128x256x64w8s3": (128, 256, 64, 8, 3), "128x128x64w4s4": (128, 128, 64, 4, 4)}
    for (m, n, k) in [(4096, 2048, 4096), (16384, 4096, 14336), (4096, 8192, 28672), (1000, 4096, 4096)]:
        a = torch.randn(m, k, device=dev).bfloat16()
        b = torch.randn(k, n, device=dev).bfloat16()
        bt = b.t().contiguous()
        ref = a.float() @ b.float()
        fns = {"cublas": lambda: torch.mm(a, b)}
        outs = {}
        for name, cfg in cfgs.items():
            for ws in (False, True):
                c = torch.full((m, n), float("nan"), device=dev, dtype=torch.bfloat16)
                try:
                    gemm(a, b, c, NUM_SMS, cfg, ws)
                    torch.cuda.synchronize()
                except Exception as exc:  # noqa
                    print("FAIL", name, ws, type(exc).__name__, str(exc)[:300]); continue
                err = (torch.linalg.norm(c.float() - ref) / torch.linalg.norm(ref)).item()
                outs[f"{name}-ws{int(ws)}"] = err
                fns[f"{name}-ws{int(ws)}"] = (lambda c=c, cfg=cfg, ws=ws: gemm(a, b, c, NUM_SMS, cfg, ws))
        c2 = torch.empty(m, n, device=dev, dtype=torch.bfloat16)
        gemm(a, bt, c2, NUM_SMS, cfgs["128x256x64w8s3"], False, b_t=True)
        torch.cuda.synchronize()
        outs["bT"] = (torch.linalg.norm(c2.float() - ref) / torch.linalg.norm(ref)).item()
        fns["bT-128x256"] = lambda: gemm(a, bt, c2, NUM_SMS, cfgs["128x256x64w8s3"], False, b_t=True)
        t = bench(fns)
        print(f"M,N,K={m},{n},{k} errs={ {k_: round(v, 5) for k_, v in outs.items()} }")
        print("   ms:", {k_: round(v, 4) for k_, v in t.items()})


def scatter_concurrent():
    world, n, k = 2, 4096, 4096
    cfg = (128, 256, 64, 8, 3)
    bm = cfg[0]
    rpr_max = 3000
    parts = [torch.empty(world, rpr_max, n, device=dev, dtype=torch.bfloat16) for _ in range(world)]
    flags = [torch.zeros(world, scatter_flags_per_source(rpr_max, bm) + 4, device=dev, dtype=torch.int32)
             for _ in range(world)]
    counters = [torch.zeros(cdiv(world * rpr_max, bm), device=dev, dtype=torch.int32) for _ in range(world)]
    dst_ptrs = torch.tensor([p.data_ptr() for p in parts], device=dev, dtype=torch.int64)
    flag_ptrs = torch.tensor([f.data_ptr() for f in flags], device=dev, dtype=torch.int64)
    errors = torch.zeros(world, device=dev, dtype=torch.int32)
    producer, consumer = torch.cuda.Stream(), torch.cuda.Stream()
    for epoch, rpr in enumerate([3000, 1000, 2901, 200, 3000, 1337], start=1):
        for p in parts:
            p.fill_(float("nan"))
        m = world * rpr
        As = [torch.randn(m, k, device=dev).bfloat16() for _ in range(world)]
        Bs = [torch.randn(k, n, device=dev).bfloat16() for _ in range(world)]
        outs = [torch.full((rpr, n), float("nan"), device=dev, dtype=torch.bfloat16) for _ in range(world)]
        torch.cuda.synchronize()
        errors.zero_()
        if epoch == 1:  # compile/warm the GEMM before any reducer waits on it
            with torch.cuda.stream(producer):
                    for src in range(world):
                        gemm(As[src], Bs[src], parts[src], NUM_SMS - 16, cfg, False, epi=1,
                             scatter=(dst_ptrs, flag_ptrs, counters[src], rpr, src, epoch, flags[0].shape[1]))
            torch.cuda.synchronize()
        with torch.cuda.stream(consumer):
            for owner in range(world):
                reduce_partials_kernel[(16,)](
                    parts[owner], outs[owner], flags[owner], errors[owner:], rpr, n, n, world, epoch,
                    flags[owner].shape[1], bm, owner, 50_000_000, WAIT=True, BLOCK_M=64, BLOCK_N=128, num_warps=4)
        if epoch > 1:
            with torch.cuda.stream(producer):
                    for src in range(world):
                        gemm(As[src], Bs[src], parts[src], NUM_SMS - 16, cfg, False, epi=1,
                             scatter=(dst_ptrs, flag_ptrs, counters[src], rpr, src, epoch, flags[0].shape[1]))
        torch.cuda.synchronize()
        ref = sum(a.float() @ b.float() for a, b in zip(As, Bs))
        for owner in range(world):
            r = ref[owner * rpr:(owner + 1) * rpr]
            err = (torch.linalg.norm(outs[owner].float() - r) / torch.linalg.norm(r)).item()
            print(f"scatter epoch {epoch} rpr {rpr} owner {owner}: rel err {err:.5f} error word {errors[owner].item()}"
                  f" counters zero {all(bool((c == 0).all()) for c in counters)}")


def spin_rate():
    flags = torch.zeros(2, 4, device=dev, dtype=torch.int32)
    parts = torch.zeros(2, 64, 128, device=dev, dtype=torch.bfloat16)
    out = torch.empty(64, 128, device=dev, dtype=torch.bfloat16)
    for spins in (1000, 1_000_000):
        err = torch.zeros(1, device=dev, dtype=torch.int32)
        reduce_partials_kernel[(1,)](parts, out, flags, err, 64, 128, 128, 2, 1, 4, 128, 0, spins,
                                     WAIT=True, BLOCK_M=64, BLOCK_N=128)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        err.zero_()
        reduce_partials_kernel[(1,)](parts, out, flags, err, 64, 128, 128, 2, 1, 4, 128, 0, spins,
                                     WAIT=True, BLOCK_M=64, BLOCK_N=128)
        torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        print(f"spins {spins}: {dt*1e3:.2f} ms, {dt/spins*1e9:.1f} ns/spin, error {err.item()}")




def scatter_cost():
    world, rpr, n, k = 2, 4000, 4096, 4096
    cfg = (128, 256, 64, 8, 3)
    parts = [torch.empty(world, rpr, n, device=dev, dtype=torch.bfloat16) for _ in range(world)]
    flags = [torch.zeros(world, scatter_flags_per_source(rpr, 128), device=dev, dtype=torch.int32) for _ in range(world)]
    counters = torch.zeros(cdiv(world * rpr, 128), device=dev, dtype=torch.int32)
    dst_ptrs = torch.tensor([p.data_ptr() for p in parts], device=dev, dtype=torch.int64)
    flag_ptrs = torch.tensor([f.data_ptr() for f in flags], device=dev, dtype=torch.int64)
    a = torch.randn(world * rpr, k, device=dev).bfloat16()
    b = torch.randn(k, n, device=dev).bfloat16()
    c = torch.empty(world * rpr, n, device=dev, dtype=torch.bfloat16)
    t = bench({
        "cublas": lambda: torch.mm(a, b),
        "local": lambda: gemm(a, b, c, NUM_SMS, cfg),
        "scatter": lambda: gemm(a, b, parts[0], NUM_SMS, cfg, epi=1,
                                scatter=(dst_ptrs, flag_ptrs, counters, rpr, 0, 1, flags[0].shape[1])),
    })
    print("scatter cost ms:", {k_: round(v, 4) for k_, v in t.items()})




def _variant(name, replacements):
    import importlib.util, os
    src = open("kernels/gemm.py").read()
    for old, new in replacements:
        assert old in src, (name, old)
        src = src.replace(old, new)
    os.makedirs("/tmp/variants", exist_ok=True)
    path = f"/tmp/variants/gemm_{name}.py"
    open(path, "w").write(src)
    spec = importlib.util.spec_from_file_location(f"gemm_{name}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.persistent_gemm_kernel


SCATTER_STORE = """            dst = owner_base[:, None] + dst_row[:, None] * N + cols[None, :]
            tl.store(dst, result, mask=row_in_range[:, None] & (cols < N)[None, :])
"""
SUBTILE_STORE = """            dst = owner_base[:, None] + dst_row[:, None] * N
            half: tl.constexpr = BLOCK_N // 2
            left, right = tl.split(tl.permute(tl.reshape(result, (BLOCK_M, 2, half)), (0, 2, 1)))
            cols_left = first_col + tl.arange(0, half)
            cols_right = cols_left + half
            tl.store(dst + cols_left[None, :], left, mask=row_in_range[:, None] & (cols_left < N)[None, :])
            tl.store(dst + cols_right[None, :], right, mask=row_in_range[:, None] & (cols_right < N)[None, :])
"""


OWNER_LOOP_STORE_FROM = """            row_in_range = rows < M
            owner = rows // rows_per_rank
            owner_base = tl.load(dst_ptrs + owner, mask=row_in_range, other=0).to(tl.pointer_type(out_dtype))
            dst_row = (src_rank * rows_per_rank + rows - owner * rows_per_rank).to(tl.int64)
            dst = owner_base[:, None] + dst_row[:, None] * N + cols[None, :]
            tl.store(dst, result, mask=row_in_range[:, None] & (cols < N)[None, :])
"""
OWNER_LOOP_STORE = """            last_store_row = tl.minimum(first_row + BLOCK_M, M) - 1
            col_in_range = (cols < N)[None, :]
            for store_owner in range(first_row // rows_per_rank, last_store_row // rows_per_rank + 1):
                owner_base = tl.load(dst_ptrs + store_owner).to(tl.pointer_type(out_dtype))
                owner_first_row = store_owner * rows_per_rank
                in_owner = (rows >= owner_first_row) & (rows < owner_first_row + rows_per_rank) & (rows < M)
                dst_row = (src_rank * rows_per_rank - owner_first_row + rows).to(tl.int64)
                tl.store(owner_base + dst_row[:, None] * N + cols[None, :], result,
                         mask=in_owner[:, None] & col_in_range)
"""


def variants():
    kernels = {
        "current": persistent_gemm_kernel,
        "nosignal": _variant("nosignal", [
            ('tiles_done_before = tl.atomic_add(counter, 1, sem="acq_rel", scope="sys")', "tiles_done_before = 0"),
            ("            tl.debug_barrier()\n            counter", "            counter")]),
        "plainlocal": _variant("plainlocal", [("c_desc.store([first_row, first_col], result)",
                                               "tl.store(c_ptr + rows.to(tl.int64)[:, None] * ldc + cols[None, :], result, mask=(rows < M)[:, None] & (cols < N)[None, :])")]),
        "subtile": _variant("subtile", [(SCATTER_STORE, SUBTILE_STORE)]),
        "ownerloop": _variant("ownerloop", [(OWNER_LOOP_STORE_FROM, OWNER_LOOP_STORE)]),
        "ownerloop_alignint": _variant("ownerloop_alignint", [(OWNER_LOOP_STORE_FROM, OWNER_LOOP_STORE.replace(
            "tl.load(dst_ptrs + store_owner).to(", "tl.multiple_of(tl.load(dst_ptrs + store_owner), 16).to("))]),
        "ownerloop_alignptr": _variant("ownerloop_alignptr", [(OWNER_LOOP_STORE_FROM, OWNER_LOOP_STORE.replace(
            "owner_base = tl.load(dst_ptrs + store_owner).to(tl.pointer_type(out_dtype))",
            "owner_base = tl.multiple_of(tl.load(dst_ptrs + store_owner).to(tl.pointer_type(out_dtype)), 16)"))]),
    }
    world, rpr, n, k = 2, 4000, 4096, 4096
    parts = [torch.empty(world, rpr, n, device=dev, dtype=torch.bfloat16) for _ in range(world)]
    flags = [torch.zeros(world, scatter_flags_per_source(rpr, 128), device=dev, dtype=torch.int32) for _ in range(world)]
    counters = torch.zeros(cdiv(world * rpr, 128), device=dev, dtype=torch.int32)
    dst_ptrs = torch.tensor([p.data_ptr() for p in parts], device=dev, dtype=torch.int64)
    flag_ptrs = torch.tensor([f.data_ptr() for f in flags], device=dev, dtype=torch.int64)
    a = torch.randn(world * rpr, k, device=dev).bfloat16()
    b = torch.randn(k, n, device=dev).bfloat16()
    c = torch.empty(world * rpr, n, device=dev, dtype=torch.bfloat16)
    ref = a.float() @ b.float()
    rpr_odd = 3999
    for name in ("current", "ownerloop", "ownerloop_alignint", "ownerloop_alignptr"):
        for p in parts:
            p.fill_(float("nan"))
        counters.zero_()
        kernels[name][(NUM_SMS,)](a[: 2 * rpr_odd], b, parts[0], 2 * rpr_odd, n, k, k, n, n, 3, dst_ptrs, flag_ptrs, counters,
                                  rpr_odd, 1, 1, flags[0].shape[1], BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, GROUP_M=8,
                                  EPILOGUE=1, USE_DESCRIPTORS=True, B_TRANSPOSED=False, WARP_SPECIALIZE=False,
                                  num_warps=8, num_stages=3)
        torch.cuda.synchronize()
        got = torch.cat([parts[0].view(-1)[: 2 * rpr_odd * n].view(2, rpr_odd, n)[1],
                         parts[1].view(-1)[: 2 * rpr_odd * n].view(2, rpr_odd, n)[1]])
        err = (torch.linalg.norm(got.float() - ref[: 2 * rpr_odd]) / torch.linalg.norm(ref[: 2 * rpr_odd])).item()
        print(name, "straddling scatter err", err, "flags", flags[0][1].tolist(), flags[1][1].tolist())
    for cfg in [(128, 256, 64, 8, 3), (128, 128, 64, 8, 4), (128, 128, 64, 4, 4)]:
        bm, bn, bk, warps, stages = cfg

        def launch(kernel, epi):
            out = c if epi == 0 else parts[0]
            kernel[(NUM_SMS,)](a, b, out, world * rpr, n, k, k, n, n, 0, dst_ptrs, flag_ptrs, counters, rpr, 0, 1,
                               flags[0].shape[1], BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, EPILOGUE=epi,
                               USE_DESCRIPTORS=True, B_TRANSPOSED=False, WARP_SPECIALIZE=False,
                               num_warps=warps, num_stages=stages)
        fns = {"cublas": lambda: torch.mm(a, b)}
        for name, kernel in kernels.items():
            for epi in (0, 1):
                if (name == "plainlocal" and epi == 1) or (name != "current" and name != "plainlocal" and epi == 0):
                    continue
                fns[f"{name}-e{epi}"] = (lambda kernel=kernel, epi=epi: launch(kernel, epi))
        try:
            t = bench(fns)
        except Exception as exc:  # noqa
            print("FAIL", cfg, str(exc)[:400]); continue
        got = torch.cat([parts[0][0], parts[1][0]])
        err = (torch.linalg.norm(got.float() - ref) / torch.linalg.norm(ref)).item()
        print(cfg, "last scatter err", round(err, 5), {k_: round(v, 4) for k_, v in t.items()})


if __name__ == "__main__":
    for part in sys.argv[1:]:
        globals()[part]()
