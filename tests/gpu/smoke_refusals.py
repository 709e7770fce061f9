"""Construction refusals of the one-GPU smoke (`smoke_one_gpu.py`), on W processes sharing one GPU: a fused
method with no GEMM program and a pool whose layout differs between the ranks are refused with the same
error on every rank, before anything is reserved; one program is enough for the right rows."""

from __future__ import annotations

import torch
import torch.distributed as dist


def _same_everywhere(message: str) -> str:
    messages = [None] * dist.get_world_size()
    dist.all_gather_object(messages, message)
    if len(set(messages)) != 1:
        raise AssertionError(f"the ranks raised different errors: {messages}")
    return message


def _refused(build, *errors) -> str:
    try:
        op = build()
    except errors as exc:
        return _same_everywhere(f"{type(exc).__name__}: {exc}")
    op.close()
    raise AssertionError("accepted")


def refusals(c, dev) -> str:
    from tp_overlap.ops.validate import OpInputError
    from tp_overlap.ops.ag_gemm import AgGemm
    from tp_overlap.config.schema import AgGemmConfig, ConfigError, GemmRsConfig
    from tp_overlap.ops.gemm_rs import GemmRs
    from tp_overlap.gemm import num_sms
    from tp_overlap.symm_mem.pool import SymmetricPool
    group, world, rank = dist.group.WORLD, c.world, c.rank
    sms = num_sms(dev)
    with SymmetricPool(32 << 20, group=group, backend="ipc", device=dev, timeout_s=10) as pool:
        ag = _refused(lambda: AgGemm(group=group, pool=pool, max_m=64 * world, k=64, n_local=32, dtype=torch.bfloat16,
                                     config=AgGemmConfig(method="fused", sm_margin=sms), name="ag.none"), ConfigError)
        rs = _refused(lambda: GemmRs(group=group, pool=pool, max_m=64 * world, k_local=64, n=32, dtype=torch.bfloat16,
                                     config=GemmRsConfig(method="fused", sm_margin=sms), name="rs.none"), ConfigError)
        assert f"sm_margin: got {sms}; allowed: an int with 0 <= x <= {sms - 1}" in ag, ag
        assert f"sm_margin: got {sms}" in rs, rs
        assert pool.layout() == (), pool.layout()   # nothing reserved by the refused ops
        op = AgGemm(group=group, pool=pool, max_m=64 * world, k=64, n_local=32, dtype=torch.bfloat16,
                    config=AgGemmConfig(method="fused", sm_margin=sms - 1), name="ag.one")
        a = torch.randn(64, 64, generator=torch.Generator().manual_seed(rank)).bfloat16().to(dev)
        w = torch.randn(64, 32, generator=torch.Generator().manual_seed(7)).bfloat16().to(dev)
        out = op(a, w)
        shards = [None] * world
        dist.all_gather_object(shards, a.cpu())
        ref = torch.cat(shards).double() @ w.double().cpu()
        err = ((out.double().cpu() - ref).norm() / ref.norm()).item()
        op.check_errors()
        op.close()
        assert err < 1e-2, err
        pool.barrier()
    with SymmetricPool(32 << 20, group=group, backend="ipc", device=dev, timeout_s=10) as pool:
        pool.reserve("user", (300 if rank == world - 1 else 100,), torch.uint8)
        layout = _refused(lambda: AgGemm(group=group, pool=pool, max_m=64 * world, k=64, n_local=32,
                                         dtype=torch.bfloat16, config=AgGemmConfig(), name="ag.layout"), OpInputError)
        assert "the pool's regions differ between the ranks" in layout and "'user' [300] uint8" in layout, layout
        pool.barrier()
    return f"no program and a layout mismatch refused on every rank; 1 program rel={err:.1e}"
