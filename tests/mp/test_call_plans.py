"""A call is a plan: built once per (M, variant), each call runs the config of its own M (`by_m`), in an op
and in a layer, and a failure inside a call leaves the op usable (CPU ranks, gloo, the host pool, real
processes)."""

import dataclasses

import pytest
import torch
import torch.distributed as dist

from tp_overlap.ops.validate import OpInputError
from tp_overlap.ops.ag_gemm import AgGemm
from tp_overlap.config.schema import AgGemmConfig, GemmRsConfig, OpPreset, RoleConfig
from tp_overlap.ops.gemm_rs import GemmRs
from tp_overlap.ops.layers import TPMLP, MLPReference, pool_requirements, shard_fc1, shard_fc2, shard_rows
from tp_overlap.config.presets import load_preset
from tp_overlap.ops.program import HostDriver
from tp_overlap.symm_mem.pool import SymmetricPool
from tests.multiproc import run_ranks

SMALL = AgGemmConfig(method="decomposed", chunks_per_rank=1, comm_stream_priority=0)
LARGE = AgGemmConfig(method="decomposed", chunks_per_rank=3, lead_fraction=0.5, comm_stream_priority=0)
RS_SMALL = GemmRsConfig(method="decomposed", num_comm_sms=1, comm_stream_priority=0)



def _gather(t):
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, t)
    return parts


def _plans_and_by_m(rank, world):
    torch.set_num_threads(1)
    group = dist.group.WORLD
    bound = 4 * world  # M <= bound runs the bucket's config, larger M the default
    out = {}
    with SymmetricPool(1 << 22, group=group) as pool:
        ag = AgGemm(group=group, pool=pool, max_m=12 * world, k=16, n_local=8, dtype=torch.float32,
                    config=OpPreset(default=LARGE, by_m=((bound, SMALL),)))
        rs = GemmRs(group=group, pool=pool, max_m=12 * world, k_local=16, n=8, dtype=torch.float32,
                    config=OpPreset(default=RS_SMALL, by_m=((bound, RS_SMALL),)))
        worst = 0.0
        for step, rows in enumerate((4, 12, 4, 12, 12, 3)):
            gen = torch.Generator().manual_seed(10 * step + rank)
            a, w = torch.randn(rows, 16, generator=gen), torch.randn(16, 8, generator=torch.Generator().manual_seed(step))
            got = ag(a, w)
            worst = max(worst, (got - torch.cat(_gather(a)) @ w).abs().max().item())
            a_rs = torch.randn(rows * world, 16, generator=gen)
            w_rs = torch.randn(16, 8, generator=gen)
            total = sum(x @ y for x, y in zip(_gather(a_rs), _gather(w_rs)))
            worst = max(worst, (rs(a_rs, w_rs) - total[rank * rows:(rank + 1) * rows]).abs().max().item())
        out["ag_plans"] = sorted((key[0], plan.config.chunks_per_rank) for key, plan in ag._plans.items())
        out["rs_plans"] = len(rs._plans)
        out["calls"] = (ag.calls, rs.calls)
        out["worst"] = worst
        ag.close()
        rs.close()
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_a_plan_is_built_once_per_m_and_each_call_runs_the_config_of_its_m(world):
    for result in run_ranks(_plans_and_by_m, world, timeout_s=180):
        # three Ms, six calls: one plan per M; M <= 4W runs the bucket (1 chunk), larger M the default (3)
        assert result["ag_plans"] == [(3 * world, 1), (4 * world, 1), (12 * world, 3)], result
        assert result["rs_plans"] == 3 and result["calls"] == (6, 6), result
        assert result["worst"] < 1e-4, result


def _layer_by_m(rank, world):
    torch.set_num_threads(1)
    group = dist.group.WORLD
    hidden, ffn, bound = 16, 8 * world, 4 * world
    base = load_preset("cpu", world)
    cfg = dataclasses.replace(
        base, ag_gemm=OpPreset(default=LARGE, by_m=((bound, SMALL),)),
        gemm_rs=OpPreset(default=RS_SMALL),
        roles={"fc1_dgrad": OpPreset(default=RoleConfig(), by_m=((bound, RoleConfig(bulk_wgrad=True)),)),
               "fc2_dgrad": OpPreset(default=RoleConfig(lead_wgrad=True), by_m=((bound, RoleConfig()),))})
    req = pool_requirements(hidden=hidden, max_m=12 * world, world_size=world, dtype=torch.float32,
                            chunks_per_rank=3)
    ref = MLPReference(hidden, ffn, seed=1, dtype=torch.float64)
    worst = 0.0
    with SymmetricPool(req.size_bytes, num_signal_words=req.num_signal_words, num_device_words=req.num_device_words,
                       group=group) as pool:
        mlp = TPMLP(hidden, ffn, group=group, max_m=12 * world, dtype=torch.float32, pool=pool, config=cfg)
        mlp.load_full_weights(ref.fc1_weight.detach().float(), ref.fc2_weight.detach().float())
        for step, rows in enumerate((4, 12, 4, 12)):
            gen = torch.Generator().manual_seed(step)
            x_full, dy_full = torch.randn(rows * world, hidden, generator=gen), torch.randn(rows * world, hidden,
                                                                                              generator=gen)
            x = shard_rows(x_full, rank, world).requires_grad_(True)
            mlp.zero_grad()
            mlp(x).backward(shard_rows(dy_full, rank, world))
            xr = x_full.double().requires_grad_(True)
            ref.zero_grad()
            ref(xr).backward(dy_full.double())
            for got, want in ((x.grad, shard_rows(xr.grad, rank, world)),
                              (mlp.fc1.weight.grad, shard_fc1(ref.fc1_weight.grad, rank, world)),
                              (mlp.fc2.weight.grad, shard_fc2(ref.fc2_weight.grad, rank, world))):
                worst = max(worst, ((got.double() - want).norm() / want.norm()).item())
        variants = {
            "fc2_dgrad": sorted((k[0], k[2]) for k in mlp.fc2.ops.ag._plans),            # (M, wgrad)
            "fc1_dgrad": sorted((k[0], k[1]) for k in mlp.fc1.ops.rs._plans),            # (M, schedule)
            "fc1_fprop": sorted((k[0], p.config.chunks_per_rank) for k, p in mlp.fc1.ops.ag._plans.items())}
        mlp.close()
    return worst, variants


def test_a_layer_runs_the_op_and_role_settings_of_each_call_s_m():
    world = 2
    for worst, variants in run_ranks(_layer_by_m, world, timeout_s=180):
        small, large = 4 * world, 12 * world
        assert worst < 1e-5, worst
        assert variants["fc2_dgrad"] == [(small, "after"), (large, "lead")], variants   # lead_wgrad by M
        assert variants["fc1_dgrad"] == [(small, "bulk"), (large, "op")], variants      # bulk_wgrad by M
        assert variants["fc1_fprop"] == [(small, 1), (large, 3)], variants              # ag_gemm by M


def _failure_releases(rank, world):
    torch.set_num_threads(1)
    group = dist.group.WORLD
    with SymmetricPool(1 << 22, group=group) as pool:
        op = AgGemm(group=group, pool=pool, max_m=8 * world, k=8, n_local=4, dtype=torch.float32, config=SMALL)
        a, w = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank)), torch.randn(8, 4)
        plain = HostDriver.run

        def failing(driver, ctx, compute=None):
            raise RuntimeError("a step failed before anything was enqueued")

        HostDriver.run = failing
        try:
            op(a, w)
            first = "accepted"
        except RuntimeError as exc:
            first = str(exc)
        finally:
            HostDriver.run = plain
        locked = op._lock.locked()
        right = torch.allclose(op(a, w), torch.cat(_gather(a)) @ w, atol=1e-5)
        try:  # a bad call is refused before it takes the op
            op(torch.randn(4, 9), w)
        except OpInputError:
            pass
        right &= torch.allclose(op(a, w), torch.cat(_gather(a)) @ w, atol=1e-5)
        op.close()
    return first, locked, right


def test_a_failure_inside_a_call_releases_the_op():
    for first, locked, right in run_ranks(_failure_releases, 2, timeout_s=120):
        assert first == "a step failed before anything was enqueued"
        assert locked is False and right is True


def _wgrad_variants(rank, world):
    """One op, one M, calls alternating with and without a weight grad (AgGemm: its two orders too): each
    variant is a plan of its own (a plan built without the weight-grad GEMM must not serve a call with one)."""
    torch.set_num_threads(1)
    group, rows, j = dist.group.WORLD, 4, 5
    worst = 0.0
    with SymmetricPool(1 << 22, group=group) as pool:
        ag = AgGemm(group=group, pool=pool, max_m=rows * world, k=16, n_local=8, dtype=torch.float32, config=SMALL)
        rs = GemmRs(group=group, pool=pool, max_m=rows * world, k_local=16, n=8, dtype=torch.float32,
                    config=RS_SMALL)
        for step, variant in enumerate((None, "after", None, "lead", "after", None)):
            gen = torch.Generator().manual_seed(10 * step + rank)
            a, w = torch.randn(rows, 16, generator=gen), torch.randn(16, 8, generator=torch.Generator())
            x = torch.randn(rows * world, j, generator=gen)
            gathered = torch.cat(_gather(a))
            if variant is None:
                worst = max(worst, (ag(a, w) - gathered @ w).abs().max().item())
            else:
                out, grad = ag(a, w, wgrad_of=x, lead_wgrad=variant == "lead")
                worst = max(worst, (out - gathered @ w).abs().max().item(),
                            (grad - x.t() @ gathered).abs().max().item())
            a_rs, w_rs = torch.randn(rows * world, 16, generator=gen), torch.randn(16, 8, generator=gen)
            want = sum(p @ q for p, q in zip(_gather(a_rs), _gather(w_rs)))[rank * rows:(rank + 1) * rows]
            if variant is None:
                worst = max(worst, (rs(a_rs, w_rs) - want).abs().max().item())
            else:
                out, grad = rs(a_rs, w_rs, wgrad_of=x)
                worst = max(worst, (out - want).abs().max().item(), (grad - x.t() @ a_rs).abs().max().item())
        plans = (len(ag._plans), len(rs._plans))
        ag.close()
        rs.close()
    return worst, plans


def test_a_call_with_a_weight_grad_and_one_without_at_the_same_m_run_plans_of_their_own():
    for worst, plans in run_ranks(_wgrad_variants, 2, timeout_s=120):
        assert worst < 1e-4, worst
        assert plans == (3, 2), plans   # AgGemm: none, after, lead; GemmRs: with and without
