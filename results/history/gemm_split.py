"""cuBLAS time of the TP MLP's split GEMMs by row count, cuBLAS vs cuBLASLt, plus the fc2 wgrad K-split.
One process per GPU (no communication): python scratch/gemm_split.py MODEL OUT_JSON. Diagnostic (scratch).
Every variant: median of REPS CUDA-event timings, variants interleaved round-robin, L2 flushed before each."""
import json, os, statistics, sys, time
import torch

model, out_path = sys.argv[1], sys.argv[2]
REPS = int(os.environ.get("REPS", "20"))
H, F = {"llama8b": (4096, 7168), "llama70b": (8192, 14336)}[model]  # hidden, ffn per rank (TP2)
M = 16384
dev = torch.device("cuda")
bf = torch.bfloat16
g = torch.Generator(device=dev).manual_seed(0)
rnd = lambda *s: torch.randn(*s, device=dev, generator=g).to(bf)
# shape name: (K, N, weight is a transpose view)
SHAPES = {"fc1_fwd": (H, 2 * F, False), "fc2_fwd": (F, H, False), "fc2_dgrad": (H, F, True),
          "fc1_dgrad": (2 * F, H, True)}
ROWS = [int(r) for r in os.environ.get("ROWS", ",".join(str(1024 * i) for i in range(1, 17))).split(",")]
flush = torch.empty(256 << 20, dtype=torch.uint8, device=dev)
variants = {}
for name, (k, n, wt) in SHAPES.items():
    a = rnd(M, k)
    w = rnd(n, k).t() if wt else rnd(k, n)
    out = torch.empty(M, n, device=dev, dtype=bf)
    for r in ROWS:
        for lib in ("cublas", "cublaslt"):
            variants[(name, r, lib)] = (lib, lambda a=a, w=w, out=out, r=r: torch.mm(a[:r], w, out=out[:r]))
# fc2 wgrad: h^T [F, M] @ gy [M, H]; whole vs two K halves accumulated in place (beta = 1)
h, gy = rnd(M, F), rnd(M, H)
dw = torch.empty(F, H, device=dev, dtype=bf)
def ksplit(frac):
    kk = int(M * frac)
    def run():
        torch.mm(h[:kk].t(), gy[:kk], out=dw)
        torch.addmm(dw, h[kk:].t(), gy[kk:], out=dw)
    return run
for lib in ("cublas", "cublaslt"):
    variants[("fc2_wgrad", M, lib)] = (lib, lambda: torch.mm(h.t(), gy, out=dw))
    variants[("fc2_wgrad_ksplit_half", M, lib)] = (lib, ksplit(0.5))
    variants[("fc2_wgrad_ksplit_quarter", M, lib)] = (lib, ksplit(0.25))
    # fc1 wgrad: x^T [H, M] @ gh [M, 2F]
x, gh = rnd(M, H), rnd(M, 2 * F)
dw1 = torch.empty(H, 2 * F, device=dev, dtype=bf)
for lib in ("cublas", "cublaslt"):
    variants[("fc1_wgrad", M, lib)] = (lib, lambda: torch.mm(x.t(), gh, out=dw1))
# an add of two [M/2, H] bf16 tensors (the pair / bulk epilogue)
p1, p2, p3 = rnd(M // 2, H), rnd(M // 2, H), torch.empty(M // 2, H, device=dev, dtype=bf)
variants[("add_half", M // 2, "torch")] = ("cublas", lambda: torch.add(p1, p2, out=p3))

def use(lib):
    torch.backends.cuda.preferred_blas_library(lib if lib != "torch" else "cublas")

# kernel names, one profiled call each
names = {}
for key, (lib, fn) in variants.items():
    use(lib); fn(); fn()
torch.cuda.synchronize()
from torch.profiler import profile, ProfilerActivity
for key, (lib, fn) in variants.items():
    use(lib)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn(); torch.cuda.synchronize()
    names[key] = sorted({e.name for e in prof.events() if e.device_type.name == "CUDA"})
times = {key: [] for key in variants}
t0 = time.time()
starts = [torch.cuda.Event(enable_timing=True) for _ in variants]
ends = [torch.cuda.Event(enable_timing=True) for _ in variants]
for rep in range(REPS + 2):
    for i, (key, (lib, fn)) in enumerate(variants.items()):
        use(lib)
        flush.zero_()
        starts[i].record(); fn(); ends[i].record()
    torch.cuda.synchronize()
    if rep >= 2:
        for i, key in enumerate(variants):
            times[key].append(starts[i].elapsed_time(ends[i]))
use("cublas")
rows = []
for key, ts in times.items():
    name, r, lib = key
    rows.append(dict(shape=name, rows=r, lib=lib, median_ms=statistics.median(ts), min_ms=min(ts), max_ms=max(ts),
                     kernels=names[key]))
json.dump({"model": model, "M": M, "hidden": H, "ffn_per_rank": F, "reps": REPS, "device": torch.cuda.get_device_name(),
           "torch": torch.__version__, "command": " ".join(sys.argv), "commit": os.environ.get("OVERLAP_GIT_COMMIT"),
           "rows": rows}, open(out_path, "w"), indent=1)
# short table: per shape, us per 1k rows relative to the whole GEMM, and the kernel tile
for name in SHAPES:
    whole = {lib: times[(name, M, lib)] for lib in ("cublas", "cublaslt")}
    for lib in ("cublas", "cublaslt"):
        wm = statistics.median(whole[lib]) / M
        cells = []
        for r in ROWS:
            t = statistics.median(times[(name, r, lib)])
            k = [n for n in names[(name, r, lib)] if "nvjet" in n or "gemm" in n.lower() or "sm90" in n]
            tile = k[0].split("_")[2] if k and k[0].startswith("nvjet") else (k[0][:18] if k else "?")
            cells.append(f"{r//1024}k:{t:.3f}/{t/(wm*r):.3f}/{tile}")
        print(f"{model} {name} {lib}: " + " ".join(cells), flush=True)
for key in [k for k in times if k[0].startswith(("fc2_wgrad", "fc1_wgrad", "add"))]:
    print(model, key, f"{statistics.median(times[key]):.3f}", names[key][:2])
print(f"{model} done in {time.time() - t0:.0f}s")
