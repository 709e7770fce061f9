"""The communication of GEMM+RS with no GEMM: the "comm solo" of the k-factor (overlap/k_factor.py)."""

from __future__ import annotations

import weakref

import torch

from .gemm_rs import FLAG_BLOCK_M, GemmRs
from .timing import mark as _mark

__all__ = ["RsCommOnly"]


class RsCommOnly:
    """The communication of GEMM+RS with no GEMM: push precomputed partials [M, N] to their owners (copy
    engine, ring order from rank + 1, own chunk last), flag them, reduce the W partials of this rank's
    rows into [M/W, N] with the reduction kernel (CUDA) or torch (CPU). Own pool region and epochs, so
    it never disturbs the op's flags. Built once per (pool, max_m, n, dtype); call it many times while
    the caller keeps the pool open (it holds only a weak reference to it).
    """

    def __init__(self, pool, *, max_m: int, n: int, dtype: torch.dtype, stream_priority: int = -1,
                 name: str = "kfactor.rs_comm"):
        # A weak proxy: the caller owns the pool (and the cache below must not keep it alive).
        self.pool, self.name, self.n, self.dtype = weakref.proxy(pool), name, n, dtype
        self.rank, self.world_size, self.device = pool.rank, pool.world_size, pool.device
        max_rows = max_m // self.world_size
        self.flags_per_source = -(-max_rows // FLAG_BLOCK_M) + 1
        self.slots = pool.reserve(name, (2, self.world_size * max_rows * n), dtype,
                                  num_signals=self.world_size * self.flags_per_source, exclusive=True)
        self.epoch = 0
        self.marks: dict = {}
        if self.device.type == "cuda":
            self.push_stream = torch.cuda.Stream(self.device, priority=stream_priority)
            self.reduce_stream = torch.cuda.Stream(self.device, priority=stream_priority)
            self.errors = torch.zeros(2, dtype=torch.int32, device=self.device)

    def _slots(self, rank: int, rows: int) -> torch.Tensor:
        flat = self.pool.peer(self.name, rank)[self.epoch % 2]
        return flat[:self.world_size * rows * self.n].view(self.world_size, rows, self.n)

    def __call__(self, partials: torch.Tensor, out: torch.Tensor, *, programs: int = 8) -> torch.Tensor:
        """out [M/W, N] = sum over ranks of their partials' rows of this rank; valid on the current stream."""
        self.epoch += 1
        rows = partials.shape[0] // self.world_size
        fps = self.flags_per_source
        owners = [(self.rank + s) % self.world_size for s in range(1, self.world_size + 1)]
        if self.device.type != "cuda":
            push0 = _mark()
            for owner in owners:
                self._slots(owner, rows)[self.rank].copy_(partials[owner * rows:(owner + 1) * rows])
                self.pool.signal(self.name, self.rank * fps, self.epoch, rank=owner)
            reduce0 = _mark()
            for src in range(self.world_size):
                self.pool.wait(self.name, src * fps, self.epoch, peer=src, op=self.name)
            out.copy_(self._slots(self.rank, rows).float().sum(dim=0))
            self.marks = {"push": (push0, reduce0), "reduce": (reduce0, _mark())}
            return out
        from kernels.flags import launch_signal_range
        from kernels.gemm import reduce_partials_kernel
        current = torch.cuda.current_stream(self.device)
        self.push_stream.wait_stream(current)    # also orders this step after the last step's reduction
        self.reduce_stream.wait_stream(current)
        with torch.cuda.stream(self.push_stream):
            push0 = _mark(self.push_stream)
            for owner in owners:
                self._slots(owner, rows)[self.rank].copy_(partials[owner * rows:(owner + 1) * rows],
                                                          non_blocking=True)
                launch_signal_range(self.pool.peer_signals(self.name, owner), self.rank * fps, fps, self.epoch)
            push1 = _mark(self.push_stream)
        with torch.cuda.stream(self.reduce_stream):
            reduce0 = _mark(self.reduce_stream)
            reduce_partials_kernel[(max(1, programs),)](
                self._slots(self.rank, rows), out, self.pool.signals(self.name), self.errors, rows, self.n,
                out.stride(0), self.world_size, self.epoch, fps, FLAG_BLOCK_M, self.rank,
                int(self.pool.timeout_s * 1e9), WAIT=True, USE_TIMER=True, BLOCK_M=32, BLOCK_N=256, num_warps=4)
            self.marks = {"push": (push0, push1), "reduce": (reduce0, _mark(self.reduce_stream))}
        current.wait_stream(self.push_stream)
        current.wait_stream(self.reduce_stream)
        return out

    def check_errors(self) -> None:
        """Raise if a reduction wait expired (CUDA; synchronises)."""
        if self.device.type == "cuda" and int(self.errors[0].item()):
            code = int(self.errors[0].item())
            self.errors.zero_()
            raise RuntimeError(f"{self.name}: the reduction's wait for source rank {code - 1} expired "
                               f"(epoch {self.epoch}, {self.pool.timeout_s} s)")


_rs_comm_cache: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _rs_comm_for(op: GemmRs) -> RsCommOnly:
    # One per (pool, shape): a second instance on the same region would restart epochs under stale flags.
    per_pool = _rs_comm_cache.setdefault(op.pool, {})
    key = (op.max_m, op.n, op.dtype)
    if key not in per_pool:
        per_pool[key] = RsCommOnly(op.pool, max_m=op.max_m, n=op.n, dtype=op.dtype,
                                   stream_priority=op.config.comm_stream_priority,
                                   name=f"kfactor.rs_comm{len(per_pool)}")
    return per_pool[key]
