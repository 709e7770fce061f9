"""Sustained replays of the TP MLP step, ours vs the NCCL baseline, in blocks of 30 back-to-back replays
(order O B O B), with wall-clock block bounds printed so that nvidia-smi samples can be matched to blocks.
Diagnostic (scratch): torchrun --standalone --nproc-per-node 2 scratch/power_probe.py --cuda-graphs ..."""
import sys, time, json, os
import torch, torch.distributed as dist
import launch.tp_mlp as T

orig = T.bench_interleaved
blocks = []

def probe(steps, *, group, device, warmup, reps):
    stats = orig(steps, group=group, device=device, warmup=warmup, reps=reps)
    rank = dist.get_rank(group)
    n = int(2500 / stats["overlap"].median_ms) + 1  # about 2.5 s per block
    for name in ("overlap", "baseline", "overlap", "baseline"):
        torch.cuda.synchronize(); dist.barrier(group=group)
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0 = time.time(); e0.record()
        for _ in range(n):
            steps[name]()
        e1.record(); e1.synchronize(); t1 = time.time()
        blocks.append(dict(rank=rank, name=name, t0=t0, t1=t1, ms_per_step=e0.elapsed_time(e1) / n))
        if rank == 0:
            print(f"BLOCK {name} {t0:.3f} {t1:.3f} {e0.elapsed_time(e1) / n:.3f} ms/step", flush=True)
    return stats

T.bench_interleaved = probe
rc = T.main(sys.argv[1:])
if dist.is_initialized() and dist.get_rank() == 0 or not dist.is_initialized():
    json.dump(blocks, open(os.environ.get("BLOCKS_JSON", "/tmp/blocks.json"), "w"))
sys.exit(rc)
