"""Ranks that disagree, use after close, bounded pool creation and barrier, nothing left behind (CPU ranks,
gloo, the host pool, real processes)."""

import os
import signal
import threading
import time

import pytest
import torch
import torch.distributed as dist

from tp_overlap.ops.validate import OpInputError
from tp_overlap.ops.ag_gemm import AgGemm
from tp_overlap.config.schema import AgGemmConfig, GemmRsConfig
from tp_overlap.ops.gemm_rs import GemmRs
from tp_overlap.ops.layers import TPMLP, pool_requirements
from tp_overlap.config.presets import load_preset
from tp_overlap.ops.program import HostDriver
from tp_overlap.symm_mem.errors import PeerAbortError, PeerLostError, PoolClosedError, PoolError, PoolTimeoutError
from tp_overlap.symm_mem.pool import SymmetricPool, live_pool_count
from tp_overlap.symm_mem.host import SHM_DIR, SHM_PREFIX
from tests.multiproc import run_ranks

AG = AgGemmConfig(method="decomposed", comm_stream_priority=0)
RS = GemmRsConfig(method="decomposed", num_comm_sms=1, comm_stream_priority=0)


def _our_segments(pids):
    named = [n for n in os.listdir(SHM_DIR) if n.startswith(SHM_PREFIX)]
    return [n for n in named if any(str(p) in n for p in pids)]


def _mapped_segments() -> int:
    with open("/proc/self/maps") as f:
        return sum(1 for line in f if SHM_PREFIX in line)


# ----- 1. ranks that disagree ----------------------------------------------------------------------------
def _static_disagreement(rank, world):
    group = dist.group.WORLD
    out = []
    with SymmetricPool(1 << 20, group=group) as pool:
        for kwargs in ({"max_m": 16 * world if rank == 0 else 32 * world},
                       {"dtype": torch.float32 if rank == 0 else torch.bfloat16},
                       {"config": AG if rank == 0 else AgGemmConfig(method="decomposed", chunks_per_rank=2,
                                                                     comm_stream_priority=0)}):
            args = dict(group=group, pool=pool, max_m=16 * world, k=8, n_local=4, dtype=torch.float32, config=AG,
                        name=f"static{len(out)}")
            args.update(kwargs)
            try:
                AgGemm(**args)
                out.append("accepted")
            except OpInputError as exc:
                out.append(str(exc))
        try:
            GemmRs(group=group, pool=pool, max_m=8 * world, k_local=8 if rank else 16, n=4, dtype=torch.float32,
                   config=RS, name="static.rs")
            out.append("accepted")
        except OpInputError as exc:
            out.append(str(exc))
        pool.barrier()
    return out


def test_ranks_that_build_an_op_differently_raise_on_every_rank_naming_the_field():
    for world in (2, 3):
        results = run_ranks(_static_disagreement, world, timeout_s=90)
        assert all(r == results[0] for r in results), results   # the same message on every rank
        max_m, dtype, config, rs = results[0]
        assert "max_m: rank 0 " + str(16 * world) in max_m and f"rank 1 {32 * world}" in max_m, max_m
        assert "dtype: rank 0 'torch.float32', rank 1 'torch.bfloat16'" in dtype, dtype
        assert "config: rank 0" in config and "chunks_per_rank=2" in config, config
        assert "k_local: rank 0 16, rank 1 8" in rs, rs


def _disagree(rank, make_op, call):
    """Call a fresh op with M differing between ranks: the error of every rank, then what a later call says."""
    group = dist.group.WORLD
    with SymmetricPool(1 << 22, group=group) as pool:
        op = make_op(group, pool)
        out = []
        for attempt in (call, call):  # the disagreement, then a call after it: the group stays aborted
            try:
                attempt(op)
                out.append("accepted")
            except (OpInputError, PeerAbortError) as exc:
                out.append(f"{type(exc).__name__}: {exc}")
        op.close()
    return out


def _call_disagreement(rank, world):
    w = torch.randn(8, 4, generator=torch.Generator().manual_seed(0))
    rows = 8 if rank else 4
    ag = _disagree(rank, lambda g, p: AgGemm(group=g, pool=p, max_m=16 * world, k=8, n_local=4,
                                             dtype=torch.float32, config=AG),
                   lambda op: op(torch.randn(rows, 8), w))
    rs = _disagree(rank, lambda g, p: GemmRs(group=g, pool=p, max_m=16 * world, k_local=8, n=4,
                                             dtype=torch.float32, config=RS),
                   lambda op: op(torch.randn(rows * world, 8), torch.randn(8, 4)))
    # agreeing calls on a fresh pool and op: right rows
    group = dist.group.WORLD
    with SymmetricPool(1 << 22, group=group) as pool:
        op = AgGemm(group=group, pool=pool, max_m=16 * world, k=8, n_local=4, dtype=torch.float32, config=AG)
        a = torch.randn(8, 8, generator=torch.Generator().manual_seed(rank))
        full = [torch.empty_like(a) for _ in range(world)]
        dist.all_gather(full, a)
        still_right = torch.allclose(op(a, w), torch.cat(full) @ w, atol=1e-5)
        op.close()
    cfg = load_preset("cpu", world)
    req = pool_requirements(hidden=8, max_m=16 * world, world_size=world, dtype=torch.float32)
    with SymmetricPool(req.size_bytes, num_signal_words=req.num_signal_words,
                       num_device_words=req.num_device_words, group=group) as mlp_pool:
        mlp = TPMLP(8, 4 * world, group=group, max_m=16 * world, dtype=torch.float32, pool=mlp_pool, config=cfg)
        try:
            mlp(torch.randn(8 if rank else 6, 8))
            mlp_out = "accepted"
        except OpInputError as exc:
            mlp_out = str(exc)
        mlp.close()
    return ag, rs, still_right, mlp_out


def test_a_call_whose_m_differs_between_ranks_raises_on_every_rank_naming_both_ms():
    """The M of a call travels in the flags that say "this call's data is there": a rank that finds a peer's
    flag at another M raises (OpInputError naming both values) and aborts the group, so that every rank
    raises within the op's bound, before any consumer reads the rows; later calls raise too."""
    for world in (2, 3):
        results = run_ranks(_call_disagreement, world, timeout_s=120)
        for rank, (ag, rs, still_right, mlp) in enumerate(results):
            for first, later in (ag, rs):
                assert first.startswith("OpInputError") and "with different M" in first, (rank, first)
                named = {int(part.split(": ")[1]) for part in first.split("(")[1].split(")")[0].split(", ")}
                assert named == {4 * world, 8 * world}, (rank, first)  # rank 0's M and its peers'
                assert later.startswith(("OpInputError", "PeerAbortError")), (rank, later)
            assert still_right is True
            assert "with different M" in mlp and f": {6 * world}" in mlp and f": {8 * world}" in mlp, mlp


def _fused_rs_disagreement(rank, world):
    rows = 8 if rank else 4
    start = time.monotonic()
    fused = GemmRsConfig(method="fused", sm_margin=1, num_comm_sms=1, comm_stream_priority=0)
    out = _disagree(rank, lambda g, p: GemmRs(group=g, pool=p, max_m=16 * world, k_local=8, n=4,
                                              dtype=torch.float32, config=fused),
                    lambda op: op(torch.randn(rows * world, 8), torch.randn(8, 4)))
    return out, time.monotonic() - start


def test_an_m_that_differs_between_ranks_in_the_fused_reduce_scatter_raises_on_every_rank_naming_both_ms():
    """The fused GemmRs carries M in its scatter epilogue's row-block flags (device flags, polled by the
    reduction; on CPU by the host before the interpreted reduction): the rank that finds the other M aborts
    the group, every rank raises naming both values, at once rather than at the 30 s wait bound."""
    for world in (2, 3):
        for rank, ((first, later), elapsed) in enumerate(run_ranks(_fused_rs_disagreement, world, timeout_s=120)):
            assert first.startswith("OpInputError") and "with different M" in first, (rank, first)
            named = {int(part.split(": ")[1]) for part in first.split("(")[1].split(")")[0].split(", ")}
            assert named == {4 * world, 8 * world}, (rank, first)
            assert later.startswith(("OpInputError", "PeerAbortError")), (rank, later)
            assert elapsed < 15, (rank, elapsed)


# ----- 2. use after close -------------------------------------------------------------------------------
def _after_close(rank, world):
    group = dist.group.WORLD
    out = {}
    pool = SymmetricPool(1 << 20, group=group)
    ag = AgGemm(group=group, pool=pool, max_m=8 * world, k=8, n_local=4, dtype=torch.float32, config=AG)
    x, w = torch.randn(4, 8), torch.randn(8, 4)
    ag(x, w)
    calls = {"call": lambda: ag(x, w), "all_gather": lambda: ag.all_gather(x), "input_slot": lambda: ag.input_slot(8),
             "reserve": lambda: pool.reserve("late", (4,), torch.float32), "barrier": pool.barrier}
    pool.close()
    for name, call in calls.items():
        try:
            call()
            out[name] = "ran"
        except PoolClosedError as exc:
            out[name] = f"PoolClosedError: {exc}"
    ag.close()  # closing an op after its pool is fine (idempotent teardown)
    pool2 = SymmetricPool(1 << 20, group=group)
    ag2 = AgGemm(group=group, pool=pool2, max_m=8 * world, k=8, n_local=4, dtype=torch.float32, config=AG)
    ag2.close()
    for name, call in {"call": lambda: ag2(x, w), "all_gather": lambda: ag2.all_gather(x),
                       "input_slot": lambda: ag2.input_slot(8)}.items():
        try:
            call()
            out[f"op {name}"] = "ran"
        except OpInputError as exc:
            out[f"op {name}"] = f"OpInputError: {exc}"
    # close() while a call is in flight on another thread is refused, for the op and for its pool
    ag3 = AgGemm(group=group, pool=pool2, max_m=8 * world, k=8, n_local=4, dtype=torch.float32, config=AG,
                 name="inflight")
    started, release = threading.Event(), threading.Event()
    plain_run = HostDriver.run

    def held(driver, ctx, compute=None):  # the call is inside the op (and its pool) while this waits
        started.set()
        release.wait(30)
        return plain_run(driver, ctx, compute)
    HostDriver.run = held
    worker = threading.Thread(target=lambda: ag3(x, w))
    worker.start()
    assert started.wait(30)
    for name, close in (("op close in flight", ag3.close), ("pool close in flight", pool2.close)):
        try:
            close()
            out[name] = "closed"
        except (OpInputError, PoolError) as exc:
            out[name] = str(exc)
    release.set()
    worker.join(30)
    HostDriver.run = plain_run
    ag3.close()
    pool2.close()
    out["live"] = live_pool_count()
    return out


def test_every_entry_point_after_close_raises_a_clear_error_and_close_waits_for_no_call():
    for out in run_ranks(_after_close, 2, timeout_s=90):
        for name in ("call", "all_gather", "input_slot", "reserve", "barrier"):
            assert out[name].startswith("PoolClosedError") and "pool.close() was called" in out[name], out[name]
        for name in ("op call", "op all_gather", "op input_slot"):
            assert out[name].startswith("OpInputError") and "is closed" in out[name], out[name]
        assert "close() while a call is in flight" in out["op close in flight"], out
        assert "close() while an op call on it is in flight" in out["pool close in flight"], out
        assert out["live"] == 0


# ----- 3. bounded creation and barrier, 4. nothing left behind -------------------------------------------
def _absent_peer(rank, world, where):
    group = dist.group.WORLD
    if rank == world - 1:
        if where == "barrier":
            pool = SymmetricPool(1 << 16, group=group, timeout_s=3)
            time.sleep(8)   # never reaches the barrier in time
            return "absent", pool.peer_pids
        time.sleep(8)       # never creates the pool in time
        return "absent", None
    start = time.monotonic()
    try:
        pool = SymmetricPool(1 << 16, group=group, timeout_s=3)
        pool.barrier()
        return "no error", None
    except PoolTimeoutError as exc:
        elapsed = time.monotonic() - start
        if rank == 0:  # hosts the group's store, which the other waiting rank polls until it gives up too
            time.sleep(max(0.0, 10 - elapsed))
        return str(exc), elapsed


@pytest.mark.parametrize("where", ["creation", "barrier"])
def test_pool_creation_and_barrier_honour_timeout_s_and_name_the_missing_rank(where):
    results = run_ranks(_absent_peer, 3, where, timeout_s=60, pg_timeout_s=1800)
    for message, elapsed in results[:-1]:
        assert f"ranks [2] of the group did not arrive within 3 s" in message, message
        assert elapsed < 3 + 5, elapsed   # the process group's own timeout here is 30 minutes


def _killed_in_creation(rank, world):
    group = dist.group.WORLD
    before = _mapped_segments()
    if rank == 1:
        import tp_overlap.symm_mem.shared as shared
        original = shared.SharedSegments._map

        def die(self, *args):  # killed after its own segment exists, before the others are mapped
            os.kill(os.getpid(), signal.SIGKILL)
            return original(self, *args)
        shared.SharedSegments._map = die
    start = time.monotonic()
    try:
        SymmetricPool(1 << 20, group=group, timeout_s=3)
        return "no error", 0.0, 0, os.getpid()
    except (PoolTimeoutError, PoolError, PeerLostError) as exc:
        return f"{type(exc).__name__}: {exc}", time.monotonic() - start, _mapped_segments() - before, os.getpid()


def test_a_rank_killed_during_pool_creation_leaves_no_segment_and_the_survivor_raises_in_time():
    results = run_ranks(_killed_in_creation, 2, timeout_s=60, allow_exit=frozenset({1}))
    message, elapsed, leaked_mappings, pid = results[0]
    assert message != "no error" and elapsed < 3 + 5, (message, elapsed)
    assert leaked_mappings == 0, "a failed creation left mappings behind"
    assert _our_segments({pid}) == [] and not [n for n in os.listdir(SHM_DIR) if n.startswith(SHM_PREFIX)]


# ----- 6. every survivor names the lost rank; a late rank raises on the aborted call ---------------------
def _late_to_an_aborted_call(rank, world):
    group = dist.group.WORLD
    with SymmetricPool(1 << 20, group=group, timeout_s=30) as pool:
        op = AgGemm(group=group, pool=pool, max_m=8 * world, k=8, n_local=4, dtype=torch.float32, config=AG)
        x, w = torch.randn(4, 8), torch.randn(8, 4)
        op(x, w)
        pool.barrier()
        if rank == 0:
            pool.abort()          # gives up before the next call
            return "aborted", op.calls
        time.sleep(0.5)           # arrives late at the call its peer gave up
        try:
            op(x, w)              # the one call after the abort: it must raise, not run on stale data
            return "no error", op.calls
        except PeerAbortError as exc:
            return str(exc), op.calls


def test_a_rank_late_to_an_aborted_call_raises_on_that_call():
    (_, calls0), (message, calls1) = run_ranks(_late_to_an_aborted_call, 2, timeout_s=60)
    assert "rank 0 aborted the group" in message, message
    assert calls1 == calls0   # the call it was late to was refused before anything ran
