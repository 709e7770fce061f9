"""A step that raises inside a call never leaves a rank one call behind (CPU ranks, gloo, the host pool, real
processes). Every scenario runs 5 calls of one op on a fresh pool with fresh rank-encoded data and makes one
step raise on the last rank during call 2 (index 1):

* a step whose writes only this rank reads (the caller's `work` / `lead`, a GEMM into this rank's own rows,
  the decomposed reduction): that rank raises its error, its peers' call is right, and every later call is
  right on every rank: the call completed its protocol before raising;
* a step whose output a peer waits for (the GEMM of rows pushed or scattered to a peer, the fused
  reduction): the pool is aborted, so every rank raises within the bound (the failing rank its own error,
  the others PeerAbortError) and no later call returns data.

No rank may ever return wrong rows. The realistic case is `GemmRs.bulk(a, w, work)` whose `work` (the
weight-gradient GEMM) runs out of memory on one rank: it used to leave that rank's later calls summing the
peer's partial of the previous call, for good.
"""

import contextlib
import time

import pytest
import torch
import torch.distributed as dist

import tp_overlap.ops.ag_consumers as ag_consumers
import tp_overlap.ops.gemm_rs as gemm_rs
import tp_overlap.ops.rs_scatter as rs_scatter
from tp_overlap.config.schema import AgGemmConfig, GemmRsConfig
from tp_overlap.ops.ag_gemm import AgGemm
from tp_overlap.ops.gemm_rs import GemmRs
from tp_overlap.ops.validate import OpInputError
from tp_overlap.symm_mem.errors import PeerAbortError
from tp_overlap.symm_mem.pool import SymmetricPool
from tests.multiproc import run_ranks

TIMEOUT_S = 30.0        # the pool's wait bound: an abort must reach the peers far sooner
CALLS, BAD_CALL = 4, 1
ROWS, K, N = 6, 16, 8   # rows per rank (no multiple of a block), the GEMM's K and N

AG = {"decomposed": AgGemmConfig(method="decomposed", chunks_per_rank=2, comm_stream_priority=0),
      "fused": AgGemmConfig(method="fused", sm_margin=0, chunks_per_rank=2, comm_stream_priority=0)}
RS = {"decomposed": GemmRsConfig(method="decomposed", sm_margin=0, num_comm_sms=1, comm_stream_priority=0),
      "pair": GemmRsConfig(method="pair", sm_margin=0, comm_stream_priority=0),
      "fused": GemmRsConfig(method="fused", sm_margin=1, num_comm_sms=1, comm_stream_priority=0)}


class Injected(RuntimeError):
    """The failure a scenario injects (a GEMM out of memory, say)."""


def _raise():
    raise Injected("the caller's callable failed")


class _Fault:
    """`module.name` replaced by a wrapper that, once armed, raises Injected at its (skip + 1)-th use."""

    def __init__(self, module, name):
        self.module, self.name, self.original = module, name, getattr(module, name)
        self.armed, self.skip = False, 0

    def __call__(self, *args, **kwargs):
        if self.armed:
            if self.skip == 0:
                self.armed = False
                raise Injected(f"{self.name} failed")
            self.skip -= 1
        return self.original(*args, **kwargs)

    @contextlib.contextmanager
    def installed(self):
        setattr(self.module, self.name, self)
        try:
            yield self
        finally:
            setattr(self.module, self.name, self.original)


def _gather(t):
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, t)
    return parts


# ----- the ops, their data and their calls ---------------------------------------------------------------
def _ag_data(rank, world, step):
    a = torch.randn(ROWS, K, generator=torch.Generator().manual_seed(100 * step + rank))
    w = torch.randn(K, N, generator=torch.Generator().manual_seed(step))
    return (a, w), torch.cat(_gather(a)) @ w


def _rs_data(rank, world, step):
    gen = torch.Generator().manual_seed(100 * step + rank)
    a, w = torch.randn(ROWS * world, K, generator=gen), torch.randn(K, N, generator=gen)
    total = sum(x @ y for x, y in zip(_gather(a), _gather(w)))
    return (a, w), (total[rank * ROWS:(rank + 1) * ROWS], a.sum(0))


def _ag_op(method):
    return lambda group, pool, world: AgGemm(group=group, pool=pool, max_m=ROWS * world, k=K, n_local=N,
                                             dtype=torch.float32, config=AG[method])


def _rs_op(method):
    return lambda group, pool, world: GemmRs(group=group, pool=pool, max_m=ROWS * world, k_local=K, n=N,
                                             dtype=torch.float32, config=RS[method])


def _call(op, inputs, bad):
    return op(*inputs)


def _lead(op, inputs, bad):
    return op(*inputs, lead=_raise if bad else (lambda: None))


def _bulk(op, inputs, bad):
    a = inputs[0]
    return op.bulk(*inputs, _raise if bad else (lambda: a.sum(0)))


# name: (op, data, call, fault (module, name, uses to skip) or None: the call's callable raises)
LOCAL = {
    "rs bulk work, decomposed": (_rs_op("decomposed"), _rs_data, _bulk, None),
    "rs bulk work, pair": (_rs_op("pair"), _rs_data, _bulk, None),
    "rs bulk work, fused": (_rs_op("fused"), _rs_data, _bulk, None),
    "rs own-rows GEMM, decomposed": (_rs_op("decomposed"), _rs_data, _call, (gemm_rs, "sm_carveout", "last")),
    "rs own-rows GEMM, pair": (_rs_op("pair"), _rs_data, _call, (gemm_rs, "sm_carveout", 1)),
    "rs reduction, decomposed": (_rs_op("decomposed"), _rs_data, _call, (gemm_rs, "launch_reduce", 0)),
    "ag lead, decomposed": (_ag_op("decomposed"), _ag_data, _lead, None),
    "ag lead, fused": (_ag_op("fused"), _ag_data, _lead, None),
    "ag consumer GEMM, decomposed": (_ag_op("decomposed"), _ag_data, _call, (ag_consumers, "sm_carveout", 0)),
    "ag consumer GEMM, fused": (_ag_op("fused"), _ag_data, _call, (ag_consumers, "launch_gemm", 0)),
}
AWAITED = {
    "rs pushed rows' GEMM, decomposed": (_rs_op("decomposed"), _rs_data, _call, (gemm_rs, "sm_carveout", 0)),
    "rs pushed rows' GEMM, pair": (_rs_op("pair"), _rs_data, _call, (gemm_rs, "sm_carveout", 0)),
    "rs scatter GEMM, fused": (_rs_op("fused"), _rs_data, _call, (rs_scatter, "launch_gemm", 0)),
    "rs reduction, fused": (_rs_op("fused"), _rs_data, _call, (gemm_rs, "launch_reduce", 0)),
    "rs bulk GEMM, decomposed": (_rs_op("decomposed"), _rs_data, _bulk, (gemm_rs, "sm_carveout", 0)),
}


def _outcome(got, want) -> str:
    """'ok' if a call's output (and bulk's result) is right. `want`: rows, or (rows, bulk's work result)."""
    want = want if isinstance(want, tuple) else (want,)
    got = got if isinstance(got, tuple) else (got,)
    right = all(torch.allclose(g, w, atol=1e-4, rtol=1e-4) for g, w in zip(got, want))
    return "ok" if right else "wrong"


def _scenario(rank, world, spec, bad_rank):
    """CALLS calls of a fresh op on a fresh pool, one step raising on `bad_rank` in call BAD_CALL: the outcome
    of every call ('ok', 'wrong' or the exception's name) and the seconds the bad call took on this rank."""
    make_op, data, call, fault = spec
    group = dist.group.WORLD
    outcomes, bad_call_s = [], 0.0
    injected = _Fault(*fault[:2]) if fault else None
    with SymmetricPool(1 << 22, group=group, timeout_s=TIMEOUT_S) as pool, \
            (injected.installed() if injected else contextlib.nullcontext()):
        op = make_op(group, pool, world)
        cases = [data(rank, world, step) for step in range(CALLS)]  # the references' collectives first
        for step, (inputs, want) in enumerate(cases):
            bad = rank == bad_rank and step == BAD_CALL
            if bad and injected:
                injected.armed, injected.skip = True, (world - 1 if fault[2] == "last" else fault[2])
            t0 = time.monotonic()
            try:
                outcomes.append(_outcome(call(op, inputs, bad and not injected), want))
            except (Injected, PeerAbortError) as exc:
                outcomes.append(type(exc).__name__)
            bad_call_s = bad_call_s or (time.monotonic() - t0 if step == BAD_CALL else 0.0)
        op.close()
    return outcomes, bad_call_s


def _scenarios(rank, world, table):
    """Every scenario of table `table` ("LOCAL" or "AWAITED": by name, the children import this module)."""
    return {name: _scenario(rank, world, spec, world - 1) for name, spec in globals()[table].items()
            if world == 2 or "pair" not in name}


@pytest.mark.parametrize("world", [2, 3])
def test_a_local_step_that_raises_completes_the_call_and_every_later_call_is_right(world):
    results = run_ranks(_scenarios, world, "LOCAL", timeout_s=600)
    for rank, by_name in enumerate(results):
        for name, (outcomes, _) in by_name.items():
            want = ["ok"] * CALLS
            if rank == world - 1:
                want[BAD_CALL] = "Injected"
            assert outcomes == want, (name, rank, outcomes)


@pytest.mark.parametrize("world", [2, 3])
def test_a_step_whose_output_a_peer_awaits_aborts_the_pool_and_no_call_returns_data_after_it(world):
    results = run_ranks(_scenarios, world, "AWAITED", timeout_s=600)
    for rank, by_name in enumerate(results):
        for name, (outcomes, bad_call_s) in by_name.items():
            if rank == world - 1:
                assert outcomes[:BAD_CALL + 1] == ["ok"] * BAD_CALL + ["Injected"], (name, rank, outcomes)
            else:  # a peer may finish its call (right rows), or see the abort before its call returns: the
                # failing rank can be a call ahead (its previous call had all it needed)
                assert set(outcomes[:BAD_CALL + 1]) <= {"ok", "PeerAbortError"}, (name, rank, outcomes)
            assert outcomes[BAD_CALL + 1:] == ["PeerAbortError"] * (CALLS - BAD_CALL - 1), (name, rank, outcomes)
            assert bad_call_s < TIMEOUT_S / 3, (name, rank, bad_call_s)   # the abort, not the wait bound


# ----- a failure while entering the call guard --------------------------------------------------------------
def _entry_failures(rank, world):
    """An interrupt inside the call's entry (both ranks), then a recorded abort met at the entry: the op's lock
    and the pool's in-flight count are released every time, so that later calls and close() behave."""
    group, out = dist.group.WORLD, {}
    a, w = torch.randn(ROWS, K, generator=torch.Generator().manual_seed(rank)), torch.randn(K, N)
    want = torch.cat(_gather(a)) @ w
    with SymmetricPool(1 << 22, group=group, timeout_s=TIMEOUT_S) as pool:
        op = _ag_op("decomposed")(group, pool, world)
        entry = SymmetricPool.begin_call

        def interrupted(self):
            SymmetricPool.begin_call = entry
            raise KeyboardInterrupt
        SymmetricPool.begin_call = interrupted
        try:
            op(a, w)
            out["interrupted"] = "returned"
        except KeyboardInterrupt:
            out["interrupted"] = "KeyboardInterrupt"
        out["after"] = _outcome(op(a, w), want)   # the call was never entered on any rank: the next one runs
        out["calls"] = op.calls
        pool.barrier()
        if rank == world - 1:
            pool.abort()
        out["aborted"] = []
        for _ in range(2):   # both at the entry: the second is not "already running", the pool not in flight
            try:
                op(a, w)
                out["aborted"].append("returned")
            except (PeerAbortError, OpInputError) as exc:
                out["aborted"].append(f"{type(exc).__name__}: {exc}")
        op.close()
    out["closed"] = pool.closed
    return out


def test_a_failure_while_entering_the_call_guard_releases_the_op_and_the_pool():
    for out in run_ranks(_entry_failures, 2, timeout_s=120):
        assert out["interrupted"] == "KeyboardInterrupt" and out["after"] == "ok" and out["calls"] == 1, out
        assert [m.split(":")[0] for m in out["aborted"]] == ["PeerAbortError"] * 2, out
        assert all("rank 1 aborted the group" in m for m in out["aborted"]), out
        assert out["closed"] is True
