"""`compute_alone`, the "compute alone" of every k-factor: the op's own plan for M without its comm lanes.
It computes what the op's GEMMs compute, touches no flag of the pool (AgGemm's chunk flags included: the fused
consumer polls flags of its own), and leaves the op's next call exact."""

import pytest
import torch
import torch.distributed as dist

from tp_overlap import AgGemm, AgGemmConfig, GemmRs, GemmRsConfig, SymmetricPool
from tests.multiproc import run_ranks


def _rel_err(out, ref) -> float:
    return ((out.double() - ref).norm() / ref.norm()).item()


def _flags(pool, region) -> list:
    """The region's control flags (the protocol between ranks) on this rank."""
    return list(pool.signals(region)[:])


def _ag(rank, world, method):
    group = dist.group.WORLD
    m, k, n = 96 * world, 64, 48
    cfg = AgGemmConfig(method=method, chunks_per_rank=2, comm_stream_priority=0)
    gen = torch.Generator().manual_seed(3 + rank)
    with SymmetricPool(8 << 20, num_device_words=64, group=group) as pool:
        op = AgGemm(group=group, pool=pool, max_m=m, k=k, n_local=n, dtype=torch.float32, config=cfg)
        a_shard = torch.randn(m // world, k, generator=gen)
        w = torch.randn(k, n, generator=torch.Generator().manual_seed(9))
        gathered = op.all_gather(a_shard).clone()
        pool.barrier()  # every peer's pulls are done: its flags are at rest
        before, chunks_before = _flags(pool, "ag_gemm.a"), op.chunk_flags.tolist()
        alone = op.compute_alone(a_shard, w)
        pool.barrier()
        after, chunks_after = _flags(pool, "ag_gemm.a"), op.chunk_flags.tolist()
        pool.barrier()  # read before any peer starts its next call
        out = op(a_shard, w)   # the op still runs exactly after it
        op.close()
    ref = gathered.double() @ w.double()
    return _rel_err(alone, ref), (before + chunks_before, after + chunks_after), _rel_err(out, ref), tuple(alone.shape)


def _rs(rank, world, method):
    group = dist.group.WORLD
    m, k, n = 64 * world, 48, 64
    # the interpreter counts as 4 SMs: the fused GEMM keeps 3 of them, the reduction 1
    extra = {"sm_margin": 1, "num_comm_sms": 1} if method == "fused" else {}
    cfg = GemmRsConfig(method=method, comm_stream_priority=0, **extra)
    gen = torch.Generator().manual_seed(5 + rank)
    with SymmetricPool(8 << 20, num_device_words=64, group=group) as pool:
        op = GemmRs(group=group, pool=pool, max_m=m, k_local=k, n=n, dtype=torch.float32, config=cfg)
        a, w = torch.randn(m, k, generator=gen), torch.randn(k, n, generator=gen)
        pool.barrier()
        before = _flags(pool, "gemm_rs.partials")
        alone = op.compute_alone(a, w)
        pool.barrier()
        after = _flags(pool, "gemm_rs.partials")
        pool.barrier()
        out = op(a, w)
        partial = a.double() @ w.double()
        dist.all_reduce(partial, group=group)
        rows = m // world
        op.close()
    return (_rel_err(alone, a.double() @ w.double()), (before, after),
            _rel_err(out, partial[rank * rows:(rank + 1) * rows]), tuple(alone.shape))


@pytest.mark.parametrize("method", ["decomposed", "fused"])
def test_ag_gemm_compute_alone_is_the_consumer_without_comm(method):
    for err, flags_untouched, op_err, shape in run_ranks(_ag, 2, method):
        assert shape == (192, 48)
        assert err < 1e-5 and op_err < 1e-5, (err, op_err)
        assert flags_untouched[0] == flags_untouched[1], flags_untouched


@pytest.mark.parametrize("method", ["decomposed", "pair", "fused"])
def test_gemm_rs_compute_alone_is_the_gemms_without_comm(method):
    for err, flags_untouched, op_err, shape in run_ranks(_rs, 2, method):
        assert shape == (128, 64)
        assert err < 1e-5 and op_err < 1e-5, (err, op_err)
        assert flags_untouched[0] == flags_untouched[1], flags_untouched
