"""What an op context checks and holds (CPU ranks, gloo, the host pool, real processes):

* construction checks exactly the configs a call can reach (M a multiple of W, at most max_m; the `by_m`
  buckets in order, then the default): a bucket that cannot run is refused even when the default can (else
  its calls return wrong rows or nothing), and a default or bucket that no call reaches is not refused;
* close() releases an op's regions: the same op (or TPMLP) built again in the same pool takes them back and
  computes the right rows; another spec under that name is refused with what to do.
"""

import torch
import torch._dynamo  # noqa: F401  before init_process_group in the children: see launch/tp_mlp.py
import torch.distributed as dist

from tp_overlap.config.presets import load_preset
from tp_overlap.config.schema import AgGemmConfig, GemmRsConfig, OpPreset
from tp_overlap.ops.ag_gemm import AgGemm
from tp_overlap.ops.gemm_rs import GemmRs
from tp_overlap.ops.layers import TPMLP, MLPReference, pool_requirements, shard_rows
from tp_overlap.symm_mem.pool import SymmetricPool
from tests.multiproc import run_ranks

TIMEOUT_S = 20.0
K, N = 16, 8
DECOMPOSED_AG = AgGemmConfig(method="decomposed", comm_stream_priority=0)
DECOMPOSED_RS = GemmRsConfig(method="decomposed", num_comm_sms=1, comm_stream_priority=0)
NO_PROGRAMS_AG = AgGemmConfig(method="fused", sm_margin=4, comm_stream_priority=0)   # CPU: 4 - 4 = 0
NO_PROGRAMS_RS = GemmRsConfig(method="fused", sm_margin=4, num_comm_sms=1, comm_stream_priority=0)
GPU_ONLY_RS = GemmRsConfig(method="epilogue_reduce", sm_margin=0)


def _gather(t):
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, t)
    return parts


def _attempt(build, calls=()) -> str:
    """'built' (and 'right' / 'wrong' per call of `calls` on the op) or the refusal's message."""
    try:
        op = build()
    except Exception as exc:  # noqa: BLE001 - any type, so that a wrong one shows in the assertion
        return f"{type(exc).__name__}: {exc}"
    outcome = "built" + "".join(f", {call(op)}" for call in calls)
    op.close()
    return outcome


def _rs_rows(rank, world, rows):
    def call(op):
        a = torch.randn(rows * world, K, generator=torch.Generator().manual_seed(rows + rank))
        w = torch.randn(K, N, generator=torch.Generator().manual_seed(rank))
        want = sum(x @ y for x, y in zip(_gather(a), _gather(w)))[rank * rows:(rank + 1) * rows]
        return "right" if torch.allclose(op(a, w), want, atol=1e-4) else "wrong"
    return call


def _reach(rank, world):
    group, out = dist.group.WORLD, {}
    with SymmetricPool(1 << 22, group=group, timeout_s=TIMEOUT_S) as pool:
        def rs(name, preset, max_m, calls=()):
            out[name] = _attempt(lambda: GemmRs(group=group, pool=pool, max_m=max_m, k_local=K, n=N,
                                                dtype=torch.float32, config=preset, name=name), calls)

        def ag(name, preset, max_m):
            out[name] = _attempt(lambda: AgGemm(group=group, pool=pool, max_m=max_m, k=K, n_local=N,
                                                dtype=torch.float32, config=preset, name=name))
        # a GPU-only default that no M <= max_m reaches: a bucket covers them all (and runs)
        rs("covered", OpPreset(default=GPU_ONLY_RS, by_m=((8 * world, DECOMPOSED_RS),)), 8 * world,
           [_rs_rows(rank, world, 1), _rs_rows(rank, world, 8)])
        # ... and the same default once max_m reaches past the bucket
        rs("reached", OpPreset(default=GPU_ONLY_RS, by_m=((8 * world, DECOMPOSED_RS),)), 16 * world)
        # a bucket with no GEMM program under a default that runs: refused, for both ops
        rs("bucket rs", OpPreset(default=DECOMPOSED_RS, by_m=((4 * world, NO_PROGRAMS_RS),)), 8 * world)
        ag("bucket ag", OpPreset(default=DECOMPOSED_AG, by_m=((4 * world, NO_PROGRAMS_AG),)), 8 * world)
        # a bucket below the smallest M (W): no call reaches it
        rs("below W", OpPreset(default=DECOMPOSED_RS, by_m=((world - 1, NO_PROGRAMS_RS),)), 8 * world,
           [_rs_rows(rank, world, 1)])
        out["regions"] = pool.stats().num_regions
    return out


def test_construction_refuses_exactly_the_configs_a_call_can_reach():
    for world in (2, 3):
        results = run_ranks(_reach, world, timeout_s=180)
        assert all(r == results[0] for r in results), results   # the same on every rank
        out = results[0]
        assert out["covered"] == "built, right, right", out
        assert out["reached"].startswith("OpInputError: reached: method epilogue_reduce needs a GPU"), out
        assert out["bucket rs"].startswith("OpInputError: bucket rs: method fused runs its GEMM on num_sms - "
                                           "sm_margin = 4 - 4 = 0 programs on cpu"), out
        assert out["bucket ag"].startswith("OpInputError: bucket ag: method fused runs its GEMM on num_sms - "
                                           "sm_margin = 4 - 4 = 0 programs on cpu"), out
        assert out["below W"] == "built, right", out
        assert out["regions"] == 2   # the two ops that were built; nothing reserved by the refused ones


# ----- close() releases the regions ----------------------------------------------------------------------
def _mlp_forward(mlp, ref, rank, world, rows) -> float:
    x = torch.randn(rows * world, 24, generator=torch.Generator().manual_seed(rows))
    with torch.no_grad():
        got, want = mlp(shard_rows(x, rank, world)), shard_rows(ref(x.double()), rank, world)
    return ((got.double() - want).norm() / want.norm()).item()


def _rebuild(rank, world):
    group, out = dist.group.WORLD, {}
    req = pool_requirements(hidden=24, max_m=4 * world, world_size=world, dtype=torch.float32)
    ref = MLPReference(24, 16 * world, seed=3, dtype=torch.float64)
    # one MLP, and the regions of one small AgGemm (a rebuild that reserved new regions would not fit)
    with SymmetricPool(req.size_bytes + 1024, num_signal_words=req.num_signal_words + 8,
                       num_device_words=req.num_device_words + 8, group=group, timeout_s=TIMEOUT_S) as pool:
        errors = []
        for _ in range(3):   # the default name every time, in a pool sized for one MLP
            mlp = TPMLP(24, 16 * world, group=group, max_m=4 * world, dtype=torch.float32, pool=pool,
                        config=load_preset("cpu", world))
            mlp.load_full_weights(ref.fc1_weight.detach().float(), ref.fc2_weight.detach().float())
            errors.append(max(_mlp_forward(mlp, ref, rank, world, rows) for rows in (4, 2)))
            mlp.close()
        out["errors"] = errors
        out["regions"] = pool.stats().num_regions
        op = AgGemm(group=group, pool=pool, max_m=4 * world, k=K, n_local=N, dtype=torch.float32,
                    config=DECOMPOSED_AG, name="ag")
        out["open"] = _attempt(lambda: AgGemm(group=group, pool=pool, max_m=4 * world, k=K, n_local=N,
                                              dtype=torch.float32, config=DECOMPOSED_AG, name="ag"))
        op.close()
        out["other spec"] = _attempt(lambda: AgGemm(group=group, pool=pool, max_m=2 * world, k=K, n_local=N,
                                                    dtype=torch.float32, config=DECOMPOSED_AG, name="ag"))
    return out


def test_a_closed_layer_s_regions_are_taken_back_by_the_same_layer_built_again_in_the_pool():
    for out in run_ranks(_rebuild, 2, timeout_s=180):
        assert max(out["errors"]) < 1e-5 and len(out["errors"]) == 3, out
        assert out["regions"] == 4, out   # fc1 and fc2, AG and RS: once, whatever the rebuilds
        assert "region 'ag.a' is already reserved by another op context of this pool" in out["open"], out
        assert "close() the one that holds it first" in out["open"], out
        assert "region 'ag.a' was released by a closed op" in out["other spec"], out
        assert "give the new op another name" in out["other spec"], out
