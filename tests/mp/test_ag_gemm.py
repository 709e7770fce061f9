"""AllGather+GEMM on CPU ranks (host pool, comm thread, torch.mm) against the NCCL/gloo reference."""

import math
import time

import pytest
import torch
import torch.distributed as dist

from tp_overlap.ops.ag_chunks import plan_chunks, plan_consumer_gemms
from tp_overlap.ops.ag_gemm import AgGemm
from tp_overlap.config.schema import AgGemmConfig, GemmRsConfig
from tp_overlap.ops.validate import OpInputError
from tp_overlap.ops.reference import ag_gemm_reference
from tp_overlap.symm_mem.errors import PoolClosedError, PoolError
from tp_overlap.symm_mem.pool import SymmetricPool
from tests.multiproc import run_ranks


def rel_err(out, ref):
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def _correct(rank, world, shapes, chunks, dtype_name, lead_fraction=0.0):
    dtype = getattr(torch, dtype_name)
    group = dist.group.WORLD
    max_m = max(m for m, _, _ in shapes)
    k, n = shapes[0][1], shapes[0][2]
    cfg = AgGemmConfig(method="decomposed", chunks_per_rank=chunks, comm_stream_priority=0,
                   lead_fraction=lead_fraction)
    errors = []
    with SymmetricPool(64 << 20, group=group) as pool:
        op = AgGemm(group=group, pool=pool, max_m=max_m, k=k, n_local=n, dtype=dtype, config=cfg)
        gen = torch.Generator().manual_seed(100 + rank)
        for step, (m, _, _) in enumerate(shapes * 3):
            # scramble the whole workspace before each repeat; between calls every flag is back at rest:
            # ready[*] CLEAR (taken by this rank), consumed[peer] SET (given back by every peer)
            op.gathered.copy_(torch.randn(op.gathered.shape, generator=gen).to(dtype))
            flags = pool.signals("ag_gemm.a")
            assert flags[:world].tolist() == [0] * world, flags[:world]
            assert flags[world:2 * world].tolist() == [int(r != rank) for r in range(world)], flags
            pool.barrier()
            a_shard = torch.randn(m // world, k, generator=gen).to(dtype)
            w_gen = torch.Generator().manual_seed(7 + step)
            # every third step: the transpose view of a row-major [N, K] weight (what backward passes)
            w = torch.randn(n, k, generator=w_gen).to(dtype).t() if step % 3 == 2 else \
                torch.randn(k, n, generator=w_gen).to(dtype)
            if step % 2:  # zero-copy: the caller writes its shard into the pool slot
                slot = op.input_slot(m)
                slot.copy_(a_shard)
                out, a = op(slot, w, return_gathered=True)
            else:
                out, a = op(a_shard, w, return_gathered=True)
            ref_out, ref_a = ag_gemm_reference(a_shard, w, group=group)
            if not torch.equal(a, ref_a):
                raise AssertionError(f"step {step}: gathered a is not bit-exact")
            errors.append(rel_err(out, ref_a.double() @ w.double()))
            pool.barrier()
        op.close()
    return errors


@pytest.mark.parametrize("world,chunks", [(2, 1), (2, 3), (4, 2)])
def test_ag_gemm_matches_reference_with_tails(world, chunks):
    # M/W = 100 and 37 (not multiples of 128), K = 72 (not a multiple of 64), N = 50 (tail)
    shapes = [(100 * world, 72, 50), (37 * world, 72, 50)]
    for errs in run_ranks(_correct, world, shapes, chunks, "bfloat16", timeout_s=180):
        assert max(errs) <= 1e-2, errs


@pytest.mark.parametrize("world,chunks,lead", [(2, 1, 0.25), (4, 2, 0.5)])
def test_ag_gemm_with_a_lead_gemm_matches_reference(world, chunks, lead):
    # M/W = 300: a 128-row lead and a tail; 100 and 37: the lead is the whole local shard
    shapes = [(300 * world, 72, 50), (100 * world, 72, 50), (37 * world, 72, 50)]
    for errs in run_ranks(_correct, world, shapes, chunks, "bfloat16", lead, timeout_s=180):
        assert max(errs) <= 1e-2, errs


def test_ag_gemm_fp32_is_tight():
    for errs in run_ranks(_correct, 2, [(66, 40, 24)], 2, "float32"):
        assert max(errs) <= 1e-5, errs


def _bad_inputs(rank, world):
    group = dist.group.WORLD
    cfg = AgGemmConfig(method="decomposed")
    msgs = []
    with SymmetricPool(1 << 20, group=group) as pool:
        op = AgGemm(group=group, pool=pool, max_m=64, k=16, n_local=8, dtype=torch.float32, config=cfg)
        good_a, good_w = torch.randn(32 // world, 16), torch.randn(16, 8)
        cases = [
            (good_a.double(), good_w),                     # dtype
            (torch.randn(8, 17), good_w),                  # K mismatch with the op
            (good_a, torch.randn(16, 9)),                  # N mismatch
            (torch.randn(16, 8).t(), good_w),              # non-contiguous
            (torch.randn(40, 16), good_w),                 # M above max_m
        ]
        for a, w in cases:
            try:
                op(a, w)
            except OpInputError as exc:
                msgs.append(str(exc))
        with pytest.raises(OpInputError, match="M=33 must be divisible by the group size"):
            op.input_slot(33)
        # after the refused calls the op still works: no rank is stuck half-way
        out = op(good_a, good_w)
        ref, _ = ag_gemm_reference(good_a, good_w, group=group)
        assert torch.allclose(out, ref, atol=1e-5)
        # a second context on the same region would take the first one's flags for its own: refused
        with pytest.raises(PoolError, match="already reserved by another op context"):
            AgGemm(group=group, pool=pool, max_m=64, k=16, n_local=8, dtype=torch.float32, config=cfg)
    # an op whose pool is closed refuses to run (its views are unmapped), naming what was closed
    with pytest.raises(PoolClosedError, match="its SymmetricPool is closed"):
        op(good_a, good_w)
    return msgs


def test_bad_inputs_raise_the_same_error_on_every_rank_before_communication():
    msgs = run_ranks(_bad_inputs, 2, timeout_s=60)
    assert msgs[0] == msgs[1] and len(msgs[0]) == 5
    assert "a_shard has dtype torch.float64" in msgs[0][0]
    assert "a_shard has shape (8, 17); dim 1 must be 16" in msgs[0][1]
    assert "w has shape (16, 9); dim 1 must be 8" in msgs[0][2]
    assert "a_shard must be contiguous" in msgs[0][3]
    assert "exceeds max_m of this op (64)" in msgs[0][4]


def test_chunks_are_local_first_then_ring_order():
    chunks = plan_chunks(rank=1, world_size=4, m=40, chunks_per_rank=2)
    assert [c[0] for c in chunks] == [1, 1, 2, 2, 3, 3, 0, 0]
    assert chunks[:2] == [(1, 10, 5, 2), (1, 15, 5, 3)]
    assert sum(c[2] for c in chunks) == 40


@pytest.mark.parametrize("world", [1, 2, 4, 8])
@pytest.mark.parametrize("fraction", [0.0, 0.1, 0.5, 1.0])
@pytest.mark.parametrize("m_per_rank", [37, 300, 8192])
def test_consumer_gemms_cover_every_row_once_and_wait_only_for_peer_rows(world, fraction, m_per_rank):
    m = m_per_rank * world
    for rank in range(world):
        plan = plan_consumer_gemms(rank=rank, world_size=world, m=m, chunks_per_rank=2, lead_fraction=fraction)
        covered = sorted((lo, lo + count) for lo, count, _ in plan)
        assert covered[0][0] == 0 and covered[-1][1] == m
        assert all(a[1] == b[0] for a, b in zip(covered, covered[1:])), covered  # no gap, no overlap
        local = range(rank * m_per_rank, (rank + 1) * m_per_rank)
        chunks = plan_chunks(rank=rank, world_size=world, m=m, chunks_per_rank=2)
        for lo, count, wait in plan:
            if wait < 0:  # read from a_shard: only this rank's rows
                assert lo in local and lo + count - 1 in local
            else:  # its rows have all arrived once chunk `wait` has (len(chunks): all, the publish too)
                assert wait == len(chunks) or not set(range(lo, lo + count)) & set(local)
                assert all(c.owner == rank or i <= wait for i, c in enumerate(chunks)
                           if c.first_row < lo + count and lo < c.first_row + c.num_rows)
        if fraction:
            lead = plan[0]
            assert lead.wait == -1 and len(plan) <= 3
            assert lead.num_rows == min(m_per_rank, math.ceil(math.ceil(fraction * m_per_rank) / 128) * 128)


def _lead_work(rank, world):
    """A call with `lead` work: the work runs once per call, and the output and gathered a stay exact."""
    group = dist.group.WORLD
    cfg = AgGemmConfig(method="decomposed", comm_stream_priority=0, lead_fraction=0.5)
    gen = torch.Generator().manual_seed(300 + rank)
    results = []
    with SymmetricPool(16 << 20, group=group) as pool:
        op = AgGemm(group=group, pool=pool, max_m=300 * world, k=72, n_local=50, dtype=torch.bfloat16,
                    config=cfg)
        assert op.consumer_gemms(300 * world, one_gemm=True) == [(0, 300 * world, len(op.chunks(300 * world)))]
        for m in (300 * world, 37 * world, 300 * world):
            a_shard = torch.randn(m // world, 72, generator=gen).to(torch.bfloat16)
            w = torch.randn(72, 50, generator=gen).to(torch.bfloat16)
            led = []
            out, a = op(a_shard, w, return_gathered=True, lead=lambda: led.append(a_shard.double().sum()))
            ref_out, ref_a = ag_gemm_reference(a_shard, w, group=group)
            results.append((len(led), torch.equal(a, ref_a), rel_err(out, ref_a.double() @ w.double())))
            pool.barrier()
        op.close()
    return results


@pytest.mark.parametrize("world", [2, 4])
def test_ag_gemm_with_lead_work_runs_it_once_and_matches_reference(world):
    for results in run_ranks(_lead_work, world, timeout_s=120):
        for calls, exact, err in results:
            assert calls == 1 and exact and err <= 1e-2, results


def _host_trace(rank, world):
    """CPU trace: host clock spans of the call's lanes; the late peer's call holds rank 0's call back."""
    group = dist.group.WORLD
    with SymmetricPool(1 << 20, group=group) as pool:
        op = AgGemm(group=group, pool=pool, max_m=64 * world, k=16, n_local=8, dtype=torch.float32,
                    config=AgGemmConfig(method="decomposed", comm_stream_priority=0))
        a_shard, w = torch.randn(64, 16), torch.randn(16, 8)
        op.enable_trace(True)
        pool.barrier()
        if rank == 1:
            time.sleep(0.3)  # rank 0's call waits this long for rank 1's
        t0 = time.perf_counter()
        op(a_shard, w)
        t1 = time.perf_counter()
        spans = op.last_trace_ms()
        op.enable_trace(False)
        out = op(a_shard, w)  # untraced calls still work
        pool.barrier()
        op.close()
    return spans, (t1 - t0) * 1e3, tuple(out.shape)


def test_host_trace_times_the_call_and_its_comm_lane():
    (spans, call_ms, shape), _ = run_ranks(_host_trace, 2, timeout_s=60)
    assert call_ms >= 250, call_ms  # every rank's call starts together (the per-call check of M)
    assert set(spans) == {"compute_ms", "comm_ms"}, spans
    assert 0 < spans["comm_ms"] <= spans["compute_ms"] <= call_ms, (spans, call_ms)
    assert shape == (128, 8)
