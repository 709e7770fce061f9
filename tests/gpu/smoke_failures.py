"""A step that raises inside a call, for the one-GPU smoke (`smoke_one_gpu.py`), W processes sharing one GPU:
the CUDA side of tests/mp/test_call_failures.py. On the last rank, during call 2 of 4:

* `GemmRs.bulk`'s `work` raises (the CUDA driver runs it while enqueueing the call), and AgGemm's `lead`
  raises: the call's remaining stream operations are still enqueued, so that rank raises its error, its
  peers' rows are right, and every later call is right on every rank;
* the GEMM of the rows pushed to a peer raises: the pool is aborted, every rank raises at that call or at
  its `check_errors()` (the watchdog releases the waits already enqueued), and no later call returns data.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

ROWS, K, N = 100, 136, 264
CALLS, BAD_CALL = 4, 1
TOL = 1e-2


class Injected(RuntimeError):
    """The failure injected (a GEMM out of memory, say)."""


def _raise():
    raise Injected("the caller's callable failed")


@contextlib.contextmanager
def _failing_once(module, name, armed):
    """`module.name` raises Injected at its first use while armed() is true (then never again)."""
    original, fired = getattr(module, name), []

    def wrapper(*args, **kwargs):
        if armed() and not fired:
            fired.append(True)
            raise Injected(f"{name} failed")
        return original(*args, **kwargs)
    setattr(module, name, wrapper)
    try:
        yield
    finally:
        setattr(module, name, original)


def _gather(t: torch.Tensor) -> list[torch.Tensor]:
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, t.detach().cpu())
    return out


def _fresh(shape, seed, dev):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16).to(dev)


def _rs_case(rank, world, step, dev):
    a, w = _fresh((ROWS * world, K), 100 * step + rank, dev), _fresh((K, N), 7 * step + rank, dev)
    total = sum(x.double() @ y.double() for x, y in zip(_gather(a), _gather(w)))
    return (a, w), total[rank * ROWS:(rank + 1) * ROWS]


def _ag_case(rank, world, step, dev):
    a, w = _fresh((ROWS, K), 100 * step + rank, dev), _fresh((K, N), step, dev)
    return (a, w), torch.cat(_gather(a)).double() @ w.double().cpu()


def _outcome(op, call, inputs, want, bad) -> str:
    try:
        got = call(op, inputs, bad)
        got = got[0] if isinstance(got, tuple) else got
        op.check_errors()   # synchronises: an abort or a released wait raises here
    except Exception as exc:  # noqa: BLE001 - named in the outcome
        return type(exc).__name__
    rel = ((got.double().cpu() - want).norm() / want.norm()).item()
    return "ok" if rel < TOL else f"wrong ({rel:.2g})"


def _scenario(c, dev, kind, call, fault) -> list[str]:
    from tp_overlap.config.schema import AgGemmConfig, GemmRsConfig
    from tp_overlap.ops.ag_gemm import AgGemm
    from tp_overlap.ops.gemm_rs import GemmRs
    from tp_overlap.symm_mem.pool import SymmetricPool
    import tp_overlap.ops.gemm_rs as gemm_rs_module
    group, world, rank = dist.group.WORLD, c.world, c.rank
    step_now = [-1]
    bad_now = lambda: rank == world - 1 and step_now[0] == BAD_CALL  # noqa: E731
    injected = _failing_once(gemm_rs_module, "sm_carveout", bad_now) if fault else contextlib.nullcontext()
    with SymmetricPool(64 << 20, group=group, backend="ipc", device=dev, timeout_s=5) as pool, injected:
        if kind == "rs":
            op = GemmRs(group=group, pool=pool, max_m=ROWS * world, k_local=K, n=N, dtype=torch.bfloat16,
                        config=GemmRsConfig(method="decomposed", sm_margin=0, num_comm_sms=4), name="fail.rs",
                        bulk=True)
        else:
            op = AgGemm(group=group, pool=pool, max_m=ROWS * world, k=K, n_local=N, dtype=torch.bfloat16,
                        config=AgGemmConfig(method="decomposed", chunks_per_rank=2), name="fail.ag")
        op.set_eager_graphs(False)   # every call enqueued step by step: the fault is met, never replayed past
        cases = [(_rs_case if kind == "rs" else _ag_case)(rank, world, step, dev) for step in range(CALLS)]
        outcomes = []
        for step, (inputs, want) in enumerate(cases):
            step_now[0] = step
            outcomes.append(_outcome(op, call, inputs, want, bad_now() and not fault))
        op.close()
    return outcomes


def call_failures(c, dev) -> str:
    world, rank = c.world, c.rank
    bad = rank == world - 1
    local = {
        "bulk work": ("rs", lambda op, inputs, b: op.bulk(*inputs, _raise if b else (lambda: None)), False),
        "ag lead": ("ag", lambda op, inputs, b: op(*inputs, lead=_raise if b else (lambda: None)), False),
    }
    notes = []
    for name, (kind, call, fault) in local.items():
        outcomes = _scenario(c, dev, kind, call, fault)
        want = ["ok"] * CALLS
        if bad:
            want[BAD_CALL] = "Injected"
        assert outcomes == want, (name, outcomes)
        notes.append(f"{name}: completed")
    outcomes = _scenario(c, dev, "rs", lambda op, inputs, b: op(*inputs), True)
    head = outcomes[:BAD_CALL + 1]
    assert head == ["ok"] * BAD_CALL + ["Injected"] if bad else set(head) <= {"ok", "PeerAbortError"}, outcomes
    assert outcomes[BAD_CALL + 1:] == ["PeerAbortError"] * (CALLS - BAD_CALL - 1), outcomes
    notes.append("pushed rows' GEMM: aborted on every rank")
    return "; ".join(notes)
