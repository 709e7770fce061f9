"""The `fused` methods on CPU ranks (gloo, the host pool, the persistent Triton GEMM under the interpreter):
right rows for every M >= W and every chunks_per_rank, and the flag protocol under a late rank.

A late rank is late inside the call: its shard is a tensor whose first read sleeps, so it publishes its rows
after its peers have entered the call and cleared their flags. A peer whose consumer trusted a flag left
over from the previous call would multiply rows scrambled between the calls.
"""

import time

import pytest
import torch
import torch.distributed as dist

from tp_overlap.ops.ag_gemm import AgGemm
from tp_overlap.config.schema import AgGemmConfig, GemmRsConfig
from tp_overlap.ops.gemm_rs import GemmRs
from tp_overlap.ops.protocol import CLEAR, SET
from tp_overlap.symm_mem.pool import SymmetricPool, live_pool_count
from tests.multiproc import run_ranks

TIMEOUT_S = 20.0
_METADATA = {"__get__", "dim", "size", "stride", "is_contiguous", "data_ptr", "numel", "element_size",
             "storage_offset", "__len__", "untyped_storage", "__repr__", "__format__", "is_floating_point"}


class _Late(torch.Tensor):
    """A call input whose first data read sleeps `delay_s` (then reads as usual); `reads` counts the sleeps."""
    delay_s = 0.0
    reads = 0

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if cls.delay_s and getattr(func, "__name__", "") not in _METADATA:
            time.sleep(cls.delay_s)
            cls.delay_s = 0.0
            cls.reads += 1
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **(kwargs or {}))


def _late(t: torch.Tensor, delay_s: float) -> torch.Tensor:
    _Late.delay_s = delay_s
    return t.clone().as_subclass(_Late)


def _gathered_reference(a_shard, world):
    shards = [torch.empty_like(a_shard) for _ in range(world)]
    dist.all_gather(shards, a_shard)
    return torch.cat(shards)


def _rel(out, ref) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30)).item()


# ----- every M >= W, every chunks_per_rank -----------------------------------------------------------------
def _every_m(rank, world, rows_list, chunks_list):
    group = dist.group.WORLD
    results = []
    with SymmetricPool(1 << 20, group=group, timeout_s=TIMEOUT_S) as pool:
        for chunks in chunks_list:
            op = AgGemm(group=group, pool=pool, max_m=max(rows_list) * world, k=24, n_local=8, dtype=torch.float32,
                        config=AgGemmConfig(method="fused", chunks_per_rank=chunks, comm_stream_priority=0),
                        name=f"ag{chunks}")
            for rows in rows_list:
                gen = torch.Generator().manual_seed(10 * rows + rank)
                a_shard, w = torch.randn(rows, 24, generator=gen), torch.randn(24, 8, generator=torch.Generator())
                out, gathered = op(a_shard, w, return_gathered=True)
                full = _gathered_reference(a_shard, world)
                results.append((chunks, rows, torch.equal(gathered, full), _rel(out, full.double() @ w.double())))
            op.close()
        pool.barrier()
    return results


@pytest.mark.parametrize("world", [2, 3, 4])
def test_fused_ag_gemm_has_the_right_rows_for_every_m_and_chunks_per_rank(world):
    # M/W = 1 with 2-4 chunks leaves an owner's trailing chunks empty (no rows, no flag write); odd M/W
    # makes the last chunk shorter
    chunks_list = (1, 2, 3, 4) if world == 2 else (2, 4)
    for results in run_ranks(_every_m, world, (1, 3, 5), chunks_list, timeout_s=240):
        assert len(results) == 3 * len(chunks_list)
        for chunks, rows, exact, err in results:
            assert exact and err <= 1e-5, (chunks, rows, exact, err)


# ----- a late rank, a scrambled workspace, flags at rest after every call ----------------------------------
def _ag_flags_at_rest(op, pool, rank, world, m) -> str | None:
    """Between calls: ready[*] CLEAR (taken), consumed[peer] SET (given back), the chunk flags of this call's
    chunks SET (cleared by the next call before its pulls) and every other chunk flag CLEAR."""
    control = pool.signals(op.flags.region)[:2 * world].tolist()
    want = [CLEAR] * world + [int(r != rank) * SET for r in range(world)]
    chunk = op.chunk_flags.tolist()
    planned = {c.flag_index for c in op.chunks(m)}
    want_chunk = [SET if i in planned else CLEAR for i in range(len(chunk))]
    if control != want or chunk != want_chunk:
        return f"AG flags {control} / chunk flags {chunk}, expected {want} / {want_chunk}"
    return None


def _rs_flags_at_rest(op, pool, rank, world) -> str | None:
    """Between calls: free[peer] SET (given back), pushed[*] CLEAR, every row-block flag and tile counter 0."""
    control = pool.signals(op.flags.region)[:2 * world].tolist()
    want = [int(o != rank) * SET for o in range(world)] + [CLEAR] * world
    if control != want or op.row_flags.any() or op._tile_counters.any():
        return f"RS flags {control}, row flags {op.row_flags.tolist()}, expected {want} and zeros"
    return None


def _late_rank(rank, world, calls):
    group = dist.group.WORLD
    k, n, rows = 24, 8, 5
    m = rows * world
    log = {"errors": [], "exact": True, "rest": [], "late_reads": 0}
    with SymmetricPool(4 << 20, group=group, timeout_s=TIMEOUT_S) as pool:
        ag = AgGemm(group=group, pool=pool, max_m=m, k=k, n_local=n, dtype=torch.float32,
                    config=AgGemmConfig(method="fused", chunks_per_rank=2, comm_stream_priority=0), name="ag")
        rs = GemmRs(group=group, pool=pool, max_m=m, k_local=k, n=n, dtype=torch.float32,
                    config=GemmRsConfig(method="fused", sm_margin=1, num_comm_sms=1, comm_stream_priority=0),
                    name="rs")
        for call in range(calls):
            late = call % world   # a different rank is late in each call
            gen = torch.Generator().manual_seed(100 * call + rank)
            a_shard, w = torch.randn(rows, k, generator=gen), torch.randn(k, n, generator=gen)
            a_rs, w_rs = torch.randn(m, k, generator=gen), torch.randn(k, n, generator=gen)
            # scramble everything this rank's next call must overwrite before reading (nobody reads it now)
            pool.barrier()
            ag.gathered.copy_(torch.randn(ag.gathered.shape, generator=gen) * 1e3)
            rs.partials.copy_(torch.randn(rs.partials.shape, generator=gen) * 1e3)
            pool.barrier()
            out, gathered = ag(_late(a_shard, 0.4) if rank == late else a_shard, w, return_gathered=True)
            full = _gathered_reference(a_shard, world)
            log["exact"] &= torch.equal(gathered, full)
            log["errors"].append(_rel(out, full.double() @ w.double()))
            out_rs = rs(_late(a_rs, 0.4) if rank == late else a_rs, w_rs)
            total = a_rs.double() @ w_rs.double()
            dist.all_reduce(total)
            log["errors"].append(_rel(out_rs, total[rank * rows:(rank + 1) * rows]))
            pool.barrier()   # every rank's call is over: the flags are at rest
            log["rest"] += [f for f in (_ag_flags_at_rest(ag, pool, rank, world, m),
                                        _rs_flags_at_rest(rs, pool, rank, world)) if f]
        log["late_reads"] = _Late.reads
        ag.close()
        rs.close()
    log["live"] = live_pool_count()
    return log


@pytest.mark.parametrize("world", [2, 3])
def test_fused_ops_with_a_late_rank_and_a_scrambled_workspace_stay_exact_and_leave_flags_at_rest(world):
    calls = 3 if world == 3 else 4
    for rank, log in enumerate(run_ranks(_late_rank, world, calls, timeout_s=300)):
        assert log["exact"], "the gathered rows are not bit-exact"
        assert max(log["errors"]) <= 1e-5, log["errors"]
        assert log["rest"] == [], log["rest"]
        # the late input was really read late: once per op and call in which this rank was the late one
        assert log["late_reads"] == 2 * len([c for c in range(calls) if c % world == rank]), log
        assert log["live"] == 0
