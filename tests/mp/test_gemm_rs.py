"""GEMM+ReduceScatter on CPU ranks (host pool: partials stored into owners' shared memory, host waits)."""

import pytest
import torch
import torch.distributed as dist

from tp_overlap.ops.validate import OpInputError
from tp_overlap.config.schema import AgGemmConfig, GemmRsConfig
from tp_overlap.ops.gemm_rs import GemmRs
from tp_overlap.ops.reference import gemm_rs_reference
from tp_overlap.symm_mem.pool import SymmetricPool
from tests.multiproc import run_ranks


def _correct(rank, world, shapes, dtype_name, bulk=False):
    dtype = getattr(torch, dtype_name)
    group = dist.group.WORLD
    k, n = shapes[0][1], shapes[0][2]
    cfg = GemmRsConfig(method="decomposed", comm_stream_priority=0)
    errors = []
    with SymmetricPool(32 << 20, group=group) as pool:
        op = GemmRs(group=group, pool=pool, max_m=max(s[0] for s in shapes), k_local=k, n=n, dtype=dtype,
                    config=cfg)
        gen = torch.Generator().manual_seed(1 + rank)
        for step, (m, _, _) in enumerate(shapes * 3):
            op.partials.copy_(torch.randn(op.partials.shape, generator=gen).to(dtype))  # scramble
            # between calls every flag is back at rest: free[peer] SET (given back), pushed[*] CLEAR (taken)
            flags = pool.signals("gemm_rs.partials")
            assert flags[:world].tolist() == [int(r != rank) for r in range(world)], flags
            assert flags[world:2 * world].tolist() == [0] * world, flags
            pool.barrier()
            a = torch.randn(m, k, generator=gen).to(dtype)
            # odd steps: the transpose view of a row-major [N, K] weight (what backward passes)
            w = torch.randn(k, n, generator=gen).to(dtype) if step % 2 == 0 else \
                torch.randn(n, k, generator=gen).to(dtype).t()
            if bulk:  # the column-backward schedule: the RS around the caller's independent work
                calls = []
                out, token = op.bulk(a, w, lambda: calls.append(step) or ("work", step))
                if token != ("work", step) or calls != [step]:
                    raise AssertionError(f"bulk ran work {calls} and returned {token!r}")
            else:
                out = op(a, w)
            # fp64 reference of the summed partials: gather every rank's a, w
            parts = [None] * world
            dist.all_gather_object(parts, (a.double(), w.double()), group=group)
            full = sum(x @ y for x, y in parts)
            rows = m // world
            ref = full[rank * rows:(rank + 1) * rows]
            errors.append(((out.double() - ref).norm() / ref.norm()).item())
            seq = gemm_rs_reference(a, w, group=group)  # the baseline agrees too
            errors.append(((seq.double() - ref).norm() / ref.norm()).item())
            pool.barrier()
    return errors


@pytest.mark.parametrize("world", [2, 4])
def test_gemm_rs_matches_fp64_reference_with_tails(world):
    # rows per rank 100 / 37, K_local = 1280-like tail (72 is not a multiple of 64), N tail 50
    shapes = [(100 * world, 72, 50), (37 * world, 72, 50)]
    for errs in run_ranks(_correct, world, shapes, "bfloat16", timeout_s=180):
        assert max(errs) <= 1e-2, errs


@pytest.mark.parametrize("world", [2, 4])
def test_gemm_rs_bulk_runs_the_work_once_and_matches_the_reference(world):
    shapes = [(100 * world, 72, 50), (37 * world, 72, 50)]
    for errs in run_ranks(_correct, world, shapes, "bfloat16", True, timeout_s=180):
        assert max(errs) <= 1e-2, errs


def test_gemm_rs_fp32_is_tight():
    for errs in run_ranks(_correct, 2, [(64, 40, 24)], "float32"):
        assert max(errs) <= 1e-5, errs


def _bad(rank, world):
    group = dist.group.WORLD
    msgs = []
    with SymmetricPool(1 << 20, group=group) as pool:
        op = GemmRs(group=group, pool=pool, max_m=64, k_local=16, n=8, dtype=torch.float32,
                    config=GemmRsConfig(method="decomposed"))
        for a, w in [(torch.randn(33, 16), torch.randn(16, 8)),   # M not divisible by W
                     (torch.randn(66, 16), torch.randn(16, 8)),   # M above max_m
                     (torch.randn(32, 16), torch.randn(15, 8)),   # K mismatch
                     (torch.randn(32, 16).half(), torch.randn(16, 8)),
                     (torch.randn(32, 16), torch.randn(16, 16)[:, ::2]),  # strided, not a transpose view
                     (torch.randn(32, 16), torch.randn(8, 15).t())]:      # transpose view, K mismatch

            try:
                op(a, w)
            except OpInputError as exc:
                msgs.append(str(exc))
        with pytest.raises(OpInputError, match="method pair is the W = 2 schedule") if world != 2 else \
                pytest.raises(OpInputError, match="epilogue_reduce needs a GPU"):
            GemmRs(group=group, pool=pool, max_m=64, k_local=16, n=8, dtype=torch.float32, name="other",
                   config=GemmRsConfig(method="pair" if world != 2 else "epilogue_reduce", num_comm_sms=0))
        out = op(torch.ones(32, 16), torch.ones(16, 8))   # still usable, nobody waits
        assert torch.equal(out, torch.full((16, 8), 16.0 * world))
    return msgs


def test_bad_inputs_raise_the_same_error_on_every_rank():
    msgs = run_ranks(_bad, 2)
    assert msgs[0] == msgs[1] and len(msgs[0]) == 6
    assert "M=33 must be divisible by the group size (2)" in msgs[0][0]
    assert "M=66 exceeds max_m of this op (64)" in msgs[0][1]
    assert "w has shape (15, 8); dim 0 must be 16" in msgs[0][2]
    assert "a has dtype torch.float16" in msgs[0][3]
    assert "w must be row-major [K, N] or the transpose view of a row-major [N, K]" in msgs[0][4]
    assert "w has shape (15, 8); dim 0 must be 16" in msgs[0][5]


def test_owner_order_is_ring_from_next_rank_with_own_last():
    class Fake:
        rank, world_size = 2, 4
    assert GemmRs.owners(Fake()) == [3, 0, 1, 2]
