"""Pool peer-read bandwidth: copy-engine pull of every peer's region vs NCCL/gloo AllGather.

Both variants move the same bytes into each rank: (W - 1) x size. The pull runs on a high-priority side
stream in the ops' ring order (`ring_order`: from rank + 1, no two ranks read one peer at once) and is joined back into the
current stream, as AG+GEMM will use it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from tp_overlap.config import envs
from tp_overlap.launch.measure.timing import bench_interleaved, progress
from tp_overlap.ops.protocol import ring_order
from tp_overlap.symm_mem.pool import SymmetricPool

from ..cli.dist import DistContext

GPU_SIZES_MB = (1, 4, 16, 64, 256)
CPU_SIZES_MB = (1, 4, 16)


def ring_pull(pool: SymmetricPool, out: torch.Tensor, nbytes: int, stream) -> None:
    """out[r, :nbytes] = shard of rank r for every peer r, pulled on `stream` (joined on return)."""
    peers = ring_order(pool.rank, pool.world_size)
    if stream is None:
        for peer in peers:
            out[peer, :nbytes].copy_(pool.peer("shard", peer)[:nbytes])
        return
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for peer in peers:
            out[peer, :nbytes].copy_(pool.peer("shard", peer)[:nbytes], non_blocking=True)
    torch.cuda.current_stream().wait_stream(stream)


def run(ctx: DistContext, *, sizes_mb, backend: str, warmup: int, reps: int) -> list[dict]:
    sizes_mb = sizes_mb or (GPU_SIZES_MB if ctx.device.type == "cuda" else CPU_SIZES_MB)
    max_bytes = max(sizes_mb) << 20
    world, rank = ctx.world_size, ctx.rank
    stream = torch.cuda.Stream(priority=-1) if ctx.device.type == "cuda" else None
    rows = []
    with SymmetricPool(max_bytes, group=ctx.group, backend=backend, device=ctx.device,
                       timeout_s=envs.timeout_s()) as pool:
        shard = pool.reserve("shard", (max_bytes,), torch.uint8)
        out = torch.empty(world, max_bytes, dtype=torch.uint8, device=ctx.device)
        nccl_out = torch.empty(world * max_bytes, dtype=torch.uint8, device=ctx.device)
        private = torch.empty(max_bytes, dtype=torch.uint8, device=ctx.device)
        for i, size_mb in enumerate(sizes_mb):
            nbytes = size_mb << 20
            _check_exact(pool, shard, private, out, nccl_out, nbytes, stream, ctx)
            variants = {
                "ce_pull": lambda: ring_pull(pool, out, nbytes, stream),
                "allgather": lambda: dist.all_gather_into_tensor(
                    nccl_out[:world * nbytes], private[:nbytes], group=ctx.group),
            }
            stats = bench_interleaved(variants, group=ctx.group, device=ctx.device, warmup=warmup, reps=reps)
            moved = (world - 1) * nbytes
            row = {"size_bytes": nbytes, "bytes_moved_per_rank": moved, "pool_backend": pool.backend_name,
                   "allgather_backend": dist.get_backend(ctx.group)}
            for name, s in stats.items():
                row.update(s.as_dict(f"{name}_"))
                row[f"{name}_GBps"] = moved / (s.median_ms * 1e-3) / 1e9
            rows.append(row)
            progress(f"pool_bw {i + 1}/{len(sizes_mb)}: {size_mb} MB  ce_pull {row['ce_pull_GBps']:.1f} GB/s  "
                     f"allgather {row['allgather_GBps']:.1f} GB/s", rank=rank)
        pool.barrier()
    return rows


def _check_exact(pool, shard, private, out, nccl_out, nbytes, stream, ctx) -> None:
    """Rank-encoded random payload through both paths, compared bit for bit before any timing."""
    gen = torch.Generator(device="cpu").manual_seed(1234 + 17 * pool.rank + nbytes)
    payload = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen).to(ctx.device)
    shard[:nbytes].copy_(payload)
    private[:nbytes].copy_(payload)
    out.fill_(0xA5)  # poison
    pool.barrier()
    ring_pull(pool, out, nbytes, stream)
    dist.all_gather_into_tensor(nccl_out[:pool.world_size * nbytes], private[:nbytes], group=ctx.group)
    gathered = nccl_out[:pool.world_size * nbytes].view(pool.world_size, nbytes)
    bad = [peer for peer in range(pool.world_size)
           if peer != pool.rank and not torch.equal(out[peer, :nbytes], gathered[peer])]
    flag = torch.tensor([len(bad)], device=ctx.device)
    dist.all_reduce(flag, group=ctx.group)  # every rank raises if any rank saw a mismatch
    if int(flag.item()):
        raise RuntimeError(f"copy-engine pull of {nbytes} bytes is not bit-exact on some rank "
                           f"(this rank: from ranks {bad})")
    pool.barrier()
