"""Where an AG+GEMM call's time goes (llama8b.qkv, M = 1024 and 4096, decomposed): host enqueue time and
device time with and without a device hold, for ours, NCCL-then-GEMM, the gather alone and the GEMM alone,
plus a torch.profiler trace of 3 calls per rank at M = 4096. A diagnostic, not a benchmark of record.

    PYTHONPATH=$PWD torchrun --standalone --nproc-per-node 2 launch/ag_host_cost.py   (OUT=dir for the files)
"""
import os, time, statistics, json
import torch, torch.distributed as dist
from launch import _dist
from overlap.ag_gemm import AgGemm
from overlap.config import OpConfig
from overlap.reference import ag_gemm_reference
from symm_mem import SymmetricPool

ctx = _dist.init()
rank, dev = ctx.rank, ctx.device
OUT = os.environ.get("OUT", ".")
res = {}
for m in (1024, 4096):
    k, n = 4096, 3072
    with SymmetricPool(256 << 20, group=ctx.group, device=dev) as pool:
        op = AgGemm(group=ctx.group, pool=pool, max_m=m, k=k, n_local=n, dtype=torch.bfloat16,
                    config=OpConfig(op="ag_gemm", method="decomposed"), name=f"ag{m}")
        a = torch.randn(m // 2, k, device=dev, dtype=torch.bfloat16)
        w = torch.randn(k, n, device=dev, dtype=torch.bfloat16)
        variants = {"ours": lambda: op(a, w), "seq": lambda: ag_gemm_reference(a, w, group=ctx.group),
                    "gather_only": lambda: op.all_gather(a), "mm_only": lambda: torch.mm(torch.cat([a, a]), w)}
        for f in variants.values():
            for _ in range(10): f()
        torch.cuda.synchronize(); dist.barrier()
        for name, f in variants.items():
            for hold in (0, 1):
                ts, hs = [], []
                for _ in range(30):
                    torch.cuda.synchronize(); dist.barrier()
                    if hold: torch.cuda._sleep(2_000_000)  # ~1 ms
                    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    t0 = time.perf_counter(); s.record(); f(); e.record(); hs.append((time.perf_counter() - t0) * 1e3)
                    e.synchronize(); ts.append(s.elapsed_time(e))
                t = torch.tensor([statistics.median(ts), statistics.median(hs)], device=dev)
                dist.all_reduce(t, op=dist.ReduceOp.MAX)
                res[f"M{m} {name} hold={hold}"] = [round(x, 4) for x in t.tolist()]
        if m == 4096:
            from torch.profiler import profile, ProfilerActivity
            torch.cuda.synchronize(); dist.barrier()
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                for _ in range(3):
                    dist.barrier(); op(a, w)
                torch.cuda.synchronize()
            prof.export_chrome_trace(f"{OUT}/ag_decomposed_M4096_rank{rank}.trace.json")
            if rank == 0:
                print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12))
        op.close(); torch.cuda.synchronize(); pool.barrier()
if rank == 0:
    print("variant: [device ms (max over ranks, median of 30), host enqueue ms]")
    for k_, v in res.items(): print(f"{k_:32s} {v}")
    json.dump(res, open(f"{OUT}/prof_ag.json", "w"), indent=1)
_dist.shutdown()
