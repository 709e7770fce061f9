"""Op construction refuses what cannot run, the same way on every rank, before it reserves anything (CPU ranks,
gloo, the host pool, real processes): a Triton method with no GEMM program or without the Triton runtime, a
pool whose layout differs between the ranks, an op on another group than its pool's, and a peer that left its
pool block while this rank builds an op."""

import time

import pytest
import torch
import torch.distributed as dist

from tp_overlap.ops.validate import OpInputError
from tp_overlap.ops.ag_gemm import AgGemm
from tp_overlap.config.schema import AgGemmConfig, GemmRsConfig
from tp_overlap.ops.gemm_rs import GemmRs
from tp_overlap.symm_mem.errors import PoolError
from tp_overlap.symm_mem.pool import SymmetricPool, live_pool_count
from tests.multiproc import run_ranks

TIMEOUT_S = 20.0   # far above what any refusal below may take


def _attempt(build) -> str:
    """'built' or the refusal's message (any exception type, so that a wrong one shows in the assertion)."""
    try:
        op = build()
    except Exception as exc:  # noqa: BLE001
        return f"{type(exc).__name__}: {exc}"
    op.close()
    return "built"


# ----- a Triton method needs at least one GEMM program ----------------------------------------------------
def _no_programs(rank, world):
    group = dist.group.WORLD
    out = []
    with SymmetricPool(1 << 20, group=group, timeout_s=TIMEOUT_S) as pool:
        for margin in (4, 8):   # a CPU device counts as 4 SMs: 0 and -4 programs
            out.append(_attempt(lambda: AgGemm(
                group=group, pool=pool, max_m=8 * world, k=16, n_local=8, dtype=torch.float32,
                config=AgGemmConfig(method="fused", sm_margin=margin, comm_stream_priority=0), name=f"ag{margin}")))
        out.append(_attempt(lambda: GemmRs(group=group, pool=pool, max_m=8 * world, k_local=16, n=8,
                                           dtype=torch.float32, config=GemmRsConfig(), name="rs.default")))
        out.append(pool.stats().num_regions)   # nothing was reserved by the refused ops
        # the largest margin that leaves one program builds and gives the right rows
        op = AgGemm(group=group, pool=pool, max_m=8 * world, k=16, n_local=8, dtype=torch.float32,
                    config=AgGemmConfig(method="fused", sm_margin=3, comm_stream_priority=0), name="ag3")
        a, w = torch.randn(8, 16, generator=torch.Generator().manual_seed(rank)), torch.randn(16, 8)
        dist.broadcast(w, 0)
        shards = [torch.empty_like(a) for _ in range(world)]
        dist.all_gather(shards, a)
        out.append(torch.allclose(op(a, w), torch.cat(shards) @ w, atol=1e-5))
        op.close()
    return out, live_pool_count()


def test_a_triton_method_with_no_gemm_program_is_refused_on_every_rank_at_construction():
    results = run_ranks(_no_programs, 2, timeout_s=120)
    assert results[0] == results[1], results   # the same messages on every rank
    (margin4, margin8, rs_default, regions, right), live = results[0]
    assert margin4.startswith("OpInputError: ag4: method fused runs its GEMM on num_sms - sm_margin = 4 - 4 = 0 "
                              "programs on cpu; it needs at least 1 (sm_margin <= 3 here"), margin4
    assert "4 - 8 = -4 programs" in margin8, margin8
    assert rs_default.startswith("OpInputError: rs.default: method fused runs its GEMM on num_sms - sm_margin = "
                                 "4 - 16 = -12 programs on cpu"), rs_default
    assert "GemmRsConfig(method='fused', sm_margin=1, num_comm_sms=1), or method decomposed" in rs_default
    assert regions == 0 and right is True and live == 0


def _no_interpreter(rank, world):
    group = dist.group.WORLD
    with SymmetricPool(1 << 20, group=group, timeout_s=TIMEOUT_S) as pool:
        return [_attempt(lambda: AgGemm(group=group, pool=pool, max_m=8 * world, k=16, n_local=8,
                                        dtype=torch.float32, config=AgGemmConfig(method="fused"), name="ag")),
                _attempt(lambda: GemmRs(group=group, pool=pool, max_m=8 * world, k_local=16, n=8, dtype=torch.float32,
                                        config=GemmRsConfig(method="fused", sm_margin=1, num_comm_sms=1),
                                        name="rs")),
                _attempt(lambda: AgGemm(group=group, pool=pool, max_m=8 * world, k=16, n_local=8,
                                        dtype=torch.float32, config=AgGemmConfig(method="decomposed"), name="dec"))]


def test_fused_on_cpu_without_the_triton_interpreter_is_refused_on_every_rank(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)   # the spawned ranks import Triton without it
    results = run_ranks(_no_interpreter, 2, timeout_s=120)
    assert results[0] == results[1], results
    ag, rs, decomposed = results[0]
    for name, message in (("ag", ag), ("rs", rs)):
        assert message == (f"OpInputError: {name}: method fused runs a Triton kernel, which needs a GPU or, on cpu, "
                           f"the Triton interpreter (TRITON_INTERPRET=1 in the environment before triton is "
                           f"imported); without them use method decomposed"), message
    assert decomposed == "built"


# ----- the pool's layout must be the same on every rank ---------------------------------------------------
def _layouts(rank, world):
    group = dist.group.WORLD
    out = {}
    variants = {   # what the last rank reserves differently before the op is built
        "bytes": lambda pool, last: pool.reserve("user", (300 if last else 100,), torch.uint8),
        "control words": lambda pool, last: pool.reserve("user", (64,), torch.uint8, num_signals=3 if last else 2),
        "device words": lambda pool, last: pool.reserve("user", (64,), torch.uint8, num_device_flags=int(last)),
        "order": lambda pool, last: [pool.reserve(n, (64,), torch.uint8) for n in (("b", "a") if last else ("a", "b"))],
    }
    for variant, reserve in variants.items():
        with SymmetricPool(1 << 20, group=group, timeout_s=TIMEOUT_S) as pool:
            reserve(pool, rank == world - 1)
            out[variant] = _attempt(lambda: AgGemm(group=group, pool=pool, max_m=8 * world, k=16, n_local=8,
                                                   dtype=torch.float32, config=AgGemmConfig(), name="ag"))
    try:
        with SymmetricPool(1 << 20 if rank else 1 << 21, group=group, timeout_s=TIMEOUT_S):
            out["creation"] = "created"
    except PoolError as exc:
        out["creation"] = f"{type(exc).__name__}: {exc}"
    out["live"] = live_pool_count()
    return out


def test_a_pool_layout_that_differs_between_ranks_is_refused_on_every_rank_naming_the_region():
    results = run_ranks(_layouts, 3, timeout_s=180)
    assert all(r == results[0] for r in results), results
    out = results[0]
    head = "OpInputError: ag: the pool's regions differ between the ranks before this op reserves its own (region "
    assert out["bytes"].startswith(head + "0: rank 0 'user' [100] uint8 at byte 0,"), out["bytes"]
    assert "rank 2 'user' [300] uint8 at byte 0" in out["bytes"], out["bytes"]
    assert "rank 0 'user' [64] uint8 at byte 0, control words [0, 2)" in out["control words"], out
    assert "rank 2 'user' [64] uint8 at byte 0, control words [0, 3)" in out["control words"], out
    assert "device words [0, 0)" in out["device words"] and "device words [0, 1)" in out["device words"], out
    assert out["order"].startswith(head + "0: rank 0 'a'") and "rank 2 'b'" in out["order"], out["order"]
    assert out["creation"] == ("PoolError: pool creation: the ranks created the pool with different sizes (size_bytes "
                               "(aligned): rank 0 2097152, rank 1 1048576, rank 2 1048576); a symmetric pool has the "
                               "same layout on every rank"), out["creation"]
    assert out["live"] == 0


# ----- an op on another group; a peer that left its pool block -------------------------------------------
def _other_group(rank, world):
    a, b = dist.new_group([0, 1]), dist.new_group([0, 2])   # rank 0 has rank 0 of size 2 in both
    if rank == 2:
        return None
    start = time.monotonic()
    message = _attempt(lambda: _build_on(a, b if rank == 0 else a))
    return message, time.monotonic() - start, live_pool_count()


def _build_on(pool_group, op_group):
    with SymmetricPool(1 << 20, group=pool_group, timeout_s=TIMEOUT_S) as pool:
        # an exception leaves the block: its pool's close tells the peers why
        return AgGemm(group=op_group, pool=pool, max_m=16, k=16, n_local=8, dtype=torch.float32,
                      config=AgGemmConfig(), name="ag")


def _left_its_block(rank, world):
    group = dist.group.WORLD
    start = time.monotonic()
    message = _attempt(lambda: _build_in_a_block(group, rank))
    return message, time.monotonic() - start, live_pool_count()


def _build_in_a_block(group, rank):
    with SymmetricPool(1 << 20, group=group, timeout_s=TIMEOUT_S) as pool:
        # rank 1 fails a local check (fp8 quantises bf16) and leaves the block; rank 0 reaches the agreement
        return AgGemm(group=group, pool=pool, max_m=32, k=16, n_local=8, dtype=torch.float16 if rank else
                      torch.bfloat16, config=AgGemmConfig(), fp8=True, name="ag")


def _barrier_against_close(rank, world):
    group = dist.group.WORLD
    start = time.monotonic()
    pool = SymmetricPool(1 << 20, group=group, timeout_s=TIMEOUT_S)
    try:
        if rank == 0:
            pool.barrier()
        message = "no error"
    except PoolError as exc:
        message = f"{type(exc).__name__}: {exc}"
    finally:
        pool.close()
    return message, time.monotonic() - start, live_pool_count()


def test_an_op_on_another_group_and_a_peer_that_left_its_pool_block_are_named_at_once():
    (refused, t0, live0), (mismatch, t1, live1), _ = run_ranks(_other_group, 3, timeout_s=120)
    assert refused == ("OpInputError: ag: pool= was built on the group of global ranks [0, 1], group= has [0, 2]; "
                       "build the op on its pool's group"), refused
    assert mismatch.startswith("OpInputError: ag: argument check: the ranks reached different collective steps of "
                               "this pool (step "), mismatch
    assert "rank 0 at 'pool close' (it left its pool block with OpInputError: ag: pool= was built on the group of " \
           "global ranks [0, 1]" in mismatch and "rank 1 at 'ag: argument check'" in mismatch, mismatch
    (waited, t0b, live0b), (local, t1b, live1b) = run_ranks(_left_its_block, 2, timeout_s=120)
    assert local == "OpInputError: ag: fp8=True quantises bf16 activations; dtype is torch.float16", local
    assert "rank 1 at 'pool close' (it left its pool block with OpInputError: ag: fp8=True quantises bf16 " \
           "activations; dtype is torch.float16)" in waited and waited.startswith("OpInputError: ag: argument check"), \
        waited
    (barrier, t0c, live0c), (closed, t1c, live1c) = run_ranks(_barrier_against_close, 2, timeout_s=120)
    assert barrier.startswith("PoolStepMismatch: pool barrier: the ranks reached different collective steps") and \
        "rank 0 at 'pool barrier'; rank 1 at 'pool close'" in barrier, barrier
    assert closed == "no error"
    # at once: far below the pools' 20 s bound (each time includes the pool's creation on a loaded machine)
    assert max(t0, t1, t0b, t1b, t0c, t1c) < 8, (t0, t1, t0b, t1b, t0c, t1c)
    assert live0 == live1 == live0b == live1b == live0c == live1c == 0
