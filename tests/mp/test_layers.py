"""TP layers on CPU ranks (gloo + host pool) against the single-process MLP with the full weights."""

import dataclasses

import pytest
import torch
import torch._dynamo  # noqa: F401  before init_process_group in the children: see launch/tp_mlp.py
import torch.distributed as dist

from tp_overlap.ops.validate import OpInputError
from tp_overlap.ops.ag_gemm import AgGemm
from tp_overlap.config.schema import OpPreset, RoleConfig
from tp_overlap.config.presets import load_preset
from tp_overlap.ops.layers import TPMLP, MLPReference, pool_requirements, shard_fc1, shard_fc2, shard_rows
from tp_overlap.symm_mem.pool import SymmetricPool
from tests.multiproc import run_ranks

# tails everywhere: hidden and ffn not multiples of 64, M/W not a multiple of 128 (and M < max_m)
HIDDEN, FFN, ROWS = 72, 88, (37, 20)
TOLERANCE = {"float32": 1e-5, "bfloat16": 2e-2}


def rel_err(out, ref):
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def _make(group, pool, dtype, activation="swiglu", overlap=True, max_m=None, config=None, **kwargs):
    world = dist.get_world_size(group)
    mlp = TPMLP(HIDDEN, FFN, activation=activation, group=group, max_m=max_m or ROWS[0] * world, dtype=dtype,
                pool=pool if overlap else None, config=config or load_preset("cpu", world), overlap=overlap,
                **kwargs)
    return mlp


def bulk_lead_config(world, lead_wgrad=False):
    """The CPU preset with the GPU preset's schedules: a lead AG GEMM (or, with lead_wgrad, the row
    backward's weight-grad GEMM of the local rows as the lead) and the RS of backward in bulk."""
    cfg = load_preset("cpu", world)
    ag = dataclasses.replace(cfg.ag_gemm, default=dataclasses.replace(cfg.ag_gemm.default, lead_fraction=0.5))
    roles = {"fc2_dgrad": OpPreset(default=RoleConfig(lead_wgrad=lead_wgrad)),
             "fc1_dgrad": OpPreset(default=RoleConfig(bulk_wgrad=True))}
    return dataclasses.replace(cfg, ag_gemm=ag, roles=roles)


def _pool(group, dtype, num_mlps, world, timeout_s: float = 30.0):
    # exactly what pool_requirements says (no slack: an under-estimate raises PoolCapacityError)
    req = pool_requirements(hidden=HIDDEN, max_m=ROWS[0] * world, world_size=world, dtype=dtype)
    return SymmetricPool(num_mlps * req.size_bytes, group=group, num_signal_words=num_mlps * req.num_signal_words,
                         num_device_words=num_mlps * req.num_device_words, timeout_s=timeout_s)


def _ref(activation, seed, dtype):
    """The oracle in float64 with weights rounded to `dtype` (the TP module gets the same values)."""
    ref = MLPReference(HIDDEN, FFN, activation=activation, seed=seed, dtype=dtype).double()
    return ref


def _compare(mlp, ref, rank, world, m, seed, dtype):
    """One forward + backward of both on fresh data; relative errors of output and every gradient."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, HIDDEN, generator=gen).to(dtype).double()
    dy = torch.randn(m, HIDDEN, generator=gen).to(dtype).double()
    x_full = x.clone().requires_grad_(True)
    ref.zero_grad()
    ref(x_full).backward(dy)
    x_shard = shard_rows(x, rank, world).to(dtype).requires_grad_(True)
    mlp.zero_grad()
    y = mlp(x_shard)
    y.backward(shard_rows(dy, rank, world).to(dtype))
    if y.shape != (m // world, HIDDEN) or y.dtype != dtype or not y.is_contiguous():
        raise AssertionError(f"output {tuple(y.shape)} {y.dtype} contiguous={y.is_contiguous()}")
    with torch.no_grad():
        y_ref = ref(x)
    return max(rel_err(y, shard_rows(y_ref, rank, world)),
               rel_err(x_shard.grad, shard_rows(x_full.grad, rank, world)),
               rel_err(mlp.fc1.weight.grad, shard_fc1(ref.fc1_weight.grad, rank, world, mlp.activation)),
               rel_err(mlp.fc2.weight.grad, shard_fc2(ref.fc2_weight.grad, rank, world)))


def _matches_reference(rank, world, group, cases, config=None):
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    errors = {}
    with _pool(group, torch.float32, len(cases), world) as pool:
        for i, (dtype_name, activation, overlap) in enumerate(cases):
            dtype = getattr(torch, dtype_name)
            mlp = _make(group, pool, dtype, activation, overlap, config=config, name=f"mlp{i}")
            ref = _ref(activation, seed=i + 10 * world, dtype=dtype)
            mlp.load_full_weights(ref.fc1_weight.detach().to(dtype), ref.fc2_weight.detach().to(dtype))
            errs = [_compare(mlp, ref, rank, world, rows * world, seed=step, dtype=dtype)
                    for step, rows in enumerate(ROWS + ROWS[:1])]  # M < max_m; a pool buffer reused
            errors[(dtype_name, activation, overlap)] = max(errs)
            mlp.close()
        pool.barrier()  # the pool is sized by pool_requirements: an under-estimate raises PoolCapacityError
    return errors


CASES = [(d, a, o) for d in ("float32", "bfloat16") for a in ("swiglu", "gelu") for o in (True, False)]


def _world_cases(rank, world):
    torch.set_num_threads(1)  # 2-4 ranks share 2 cores: oversubscribed threads cost 10x
    return _matches_reference(rank, world, dist.group.WORLD, CASES)


@pytest.mark.parametrize("world", [2, 4])
def test_mlp_output_and_every_gradient_match_the_full_reference(world):
    for errors in run_ranks(_world_cases, world, timeout_s=240):
        for (dtype_name, activation, overlap), err in errors.items():
            assert err <= TOLERANCE[dtype_name], (dtype_name, activation, overlap, err)


def _bulk_lead_cases(rank, world, lead_wgrad):
    torch.set_num_threads(1)
    cases = [(d, "swiglu", True) for d in ("float32", "bfloat16")]
    led = []  # AgGemm calls and whether each ran the row backward's weight-grad lead (lead_wgrad)
    plain_run = AgGemm._run

    def counting_run(op, *args, lead_wgrad=False, **kwargs):
        led.append(lead_wgrad)
        return plain_run(op, *args, lead_wgrad=lead_wgrad, **kwargs)

    AgGemm._run = counting_run
    try:
        errors = _matches_reference(rank, world, dist.group.WORLD, cases,
                                    config=bulk_lead_config(world, lead_wgrad))
    finally:
        AgGemm._run = plain_run
    return errors, sum(led), len(led)


@pytest.mark.parametrize("world,lead_wgrad", [(2, False), (4, False), (2, True), (4, True)])
def test_mlp_with_lead_gemm_and_bulk_wgrad_matches_the_full_reference(world, lead_wgrad):
    for errors, lead_calls, calls in run_ranks(_bulk_lead_cases, world, lead_wgrad, timeout_s=240):
        for (dtype_name, _, _), err in errors.items():
            assert err <= TOLERANCE[dtype_name], (dtype_name, err)
        # one AG per forward (no lead) and one per backward (lead work exactly when lead_wgrad is on)
        assert calls > 0 and lead_calls == (calls // 2 if lead_wgrad else 0), (lead_calls, calls)


def _reserved_vs_required(rank, world):
    torch.set_num_threads(1)
    group = dist.group.WORLD
    req = pool_requirements(hidden=HIDDEN, max_m=ROWS[0] * world, world_size=world, dtype=torch.float32)
    with SymmetricPool(req.size_bytes, group=group, num_signal_words=req.num_signal_words,
                       num_device_words=req.num_device_words) as pool:
        mlp = _make(group, pool, torch.float32, config=bulk_lead_config(world), name="sized")
        stats = pool.stats()
        reserved = (stats.bytes_reserved, stats.control_words_reserved, stats.device_words_reserved,
                    stats.num_regions)
        mlp.close()
        pool.barrier()
    return req, reserved


@pytest.mark.parametrize("world", [2, 4])
def test_pool_requirements_cover_exactly_the_signal_words_the_layers_reserve(world):
    """pool_requirements is what callers size pools with: every flag word the ops reserve (row-block flags,
    reduced flags, the W = 2 schedules' pushed-slot flags, AG ready/consumed) is counted, none twice."""
    for req, (reserved_bytes, signal_words, device_words, num_regions) in run_ranks(_reserved_vs_required, world):
        assert num_regions == 4  # two layers x (AG region + RS region)
        assert (signal_words, device_words) == (req.num_signal_words, req.num_device_words)
        assert reserved_bytes <= req.size_bytes


def _two_groups_of_two(rank, world):
    torch.set_num_threads(1)  # 2-4 ranks share 2 cores: oversubscribed threads cost 10x
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    group = groups[rank // 2]
    return _matches_reference(rank, world, group, [("float32", "swiglu", True), ("bfloat16", "gelu", True)])


def test_two_tp_groups_inside_a_world_of_four():
    for errors in run_ranks(_two_groups_of_two, 4, timeout_s=180):
        for (dtype_name, *_), err in errors.items():
            assert err <= TOLERANCE[dtype_name], errors


def _pending_forwards(mlp, world, compiled=None):
    """Two forwards pending before their backwards: the latest one's backward is fine, the earlier one's
    finds its saved input overwritten (view: the pool keeps one) and must raise, not return wrong grads."""
    run = compiled if compiled is not None else mlp
    xs = [torch.randn(ROWS[0], HIDDEN, generator=torch.Generator().manual_seed(s)).requires_grad_(True)
          for s in range(2)]
    for x in xs:  # one forward, one backward at a time: the values to compare with
        run(x).sum().backward()
    single = [x.grad.clone() for x in xs]
    for x in xs:
        x.grad = None
    ys = [run(x) for x in xs]
    ys[1].sum().backward()
    errors = [rel_err(xs[1].grad, single[1])]
    try:
        ys[0].sum().backward()
        message = None
        errors.append(rel_err(xs[0].grad, single[0]))
    except OpInputError as exc:
        message = str(exc)
    return message, errors


def _pending(rank, world):
    torch.set_num_threads(1)  # 2-4 ranks share 2 cores: oversubscribed threads cost 10x
    group, dtype = dist.group.WORLD, torch.float32
    out = {}
    with _pool(group, dtype, 2, world) as pool:
        for save in ("view", "copy"):
            mlp = _make(group, pool, dtype, save_gathered=save, name=f"mlp.{save}")
            ref = _ref("swiglu", seed=5, dtype=dtype)
            mlp.load_full_weights(ref.fc1_weight.detach(), ref.fc2_weight.detach())
            out[save] = _pending_forwards(mlp, world)
            mlp.close()
        pool.barrier()
    return out


def test_saved_gathered_input_is_checked_not_silently_stale():
    out = run_ranks(_pending, 2)
    assert out[0] == out[1]  # the same error on every rank
    message, errors = out[0]["view"]
    assert "overwritten by 1 later forward(s)" in message and "save_gathered='copy'" in message, message
    assert out[0]["copy"][0] is None  # copies never go stale
    assert max(errors + out[0]["copy"][1]) <= 1e-6


def _compile_matches_eager(rank, world):
    torch.set_num_threads(1)  # 2-4 ranks share 2 cores: oversubscribed threads cost 10x
    group, dtype, m = dist.group.WORLD, torch.float32, ROWS[0] * world
    errors = []
    # each rank compiles on its own (inductor, cold cache), and the first AG waits for the peer's rows:
    # give that wait room for one rank's compile finishing well after the other's
    with _pool(group, dtype, 1, world, timeout_s=240) as pool:
        mlp = _make(group, pool, dtype)
        ref = _ref("swiglu", seed=3, dtype=dtype)
        mlp.load_full_weights(ref.fc1_weight.detach(), ref.fc2_weight.detach())
        compiled = torch.compile(mlp, fullgraph=True)  # inductor; the ops are opaque with fake impls
        for step in range(3):
            gen = torch.Generator().manual_seed(step)
            x, dy = torch.randn(m // world, HIDDEN, generator=gen), torch.randn(m // world, HIDDEN, generator=gen)
            results = []
            for run in (mlp, compiled):
                xs = x.clone().requires_grad_(True)
                mlp.zero_grad()
                y = run(xs)
                y.backward(dy)
                results.append((y.detach(), xs.grad, mlp.fc1.weight.grad.clone(), mlp.fc2.weight.grad.clone()))
            errors.append(max(rel_err(a, b) for a, b in zip(*results)))
        stale = _pending_forwards(mlp, world, compiled)  # the stamp is a runtime value, not baked in
        mlp.close()
        pool.barrier()
    return errors, stale


def test_compile_fullgraph_forward_backward_matches_eager():
    for errors, (message, pending_errors) in run_ranks(_compile_matches_eager, 2, timeout_s=300, pg_timeout_s=240):
        assert max(errors) <= 1e-5, errors
        assert max(pending_errors) <= 1e-5, pending_errors
        assert message and "overwritten by 1 later forward(s)" in message, message


def _bad_arguments(rank, world):
    torch.set_num_threads(1)  # 2-4 ranks share 2 cores: oversubscribed threads cost 10x
    group, dtype = dist.group.WORLD, torch.float32
    msgs = []
    with _pool(group, dtype, 1, world) as pool:
        bad_builds = [
            dict(hidden=HIDDEN, ffn=87),                       # ffn not divisible by W
            dict(overlap=True, pool=None),                     # overlap without a pool
            dict(overlap=False, baseline="mpi"),               # unknown baseline
            dict(overlap=False, baseline="torch_symm"),        # CUDA only
            dict(save_gathered="keep"),                        # unknown save mode
            dict(max_m=75),                                    # max_m not divisible by W
        ]
        for case in bad_builds:
            kwargs = {"group": group, "max_m": case.pop("max_m", 74), "dtype": dtype,
                      "pool": case.pop("pool", pool), "config": load_preset("cpu", world)}
            try:
                TPMLP(case.pop("hidden", HIDDEN), case.pop("ffn", FFN), name="bad", **kwargs, **case)
            except OpInputError as exc:
                msgs.append(str(exc))
        mlp = _make(group, pool, dtype, max_m=74)
        good = torch.randn(37, HIDDEN)
        for x in (good.double(), torch.randn(37, HIDDEN + 1), torch.randn(HIDDEN, 37).t(), torch.randn(38, HIDDEN)):
            try:
                mlp(x)
            except OpInputError as exc:
                msgs.append(str(exc))
        # after refused calls the module still works: no rank is stuck half-way through a collective
        y = mlp(good.requires_grad_(True))
        y.sum().backward()
        mlp.close()
        pool.barrier()
    return msgs


def test_bad_arguments_raise_the_same_clear_error_on_every_rank():
    msgs = run_ranks(_bad_arguments, 2)
    assert msgs[0] == msgs[1] and len(msgs[0]) == 10, msgs[0]
    expected = ["ffn_hidden=87 must be divisible by the group size (2)", "overlap=True needs pool=",
                "baseline='mpi'; allowed: nccl | torch_symm", "baseline='torch_symm' needs CUDA",
                "save_gathered='keep'; allowed: view | copy", "max_m=75 must be divisible by the group size",
                "mlp.fc1 input has dtype torch.float64", "mlp.fc1 input has shape (37, 73); dim 1 must be 72",
                "mlp.fc1 input must be contiguous", "mlp.fc1: M=76 exceeds max_m of this layer (74)"]
    for msg, want in zip(msgs[0], expected):
        assert want in msg, (msg, want)


def _opcheck(rank, world):
    torch.set_num_threads(1)  # 2-4 ranks share 2 cores: oversubscribed threads cost 10x
    group, dtype = dist.group.WORLD, torch.float32
    results = {}
    with _pool(group, dtype, 1, world) as pool:
        for overlap in (True, False):
            mlp = _make(group, pool, dtype, overlap=overlap)
            torch.nn.init.normal_(mlp.fc1.weight)
            torch.nn.init.normal_(mlp.fc2.weight)
            x = torch.randn(ROWS[0], HIDDEN, requires_grad=True)
            h = torch.randn(ROWS[0] * world, FFN // world, requires_grad=True)
            # the overlapped column op returns its call-number stamp, which differs between calls by design, so
            # the eager-vs-AOT output comparison does not apply to it
            tests = ("test_schema", "test_autograd_registration", "test_faketensor")
            tests += () if overlap else ("test_aot_dispatch_dynamic",)
            results[f"column.{overlap}"] = torch.library.opcheck(
                torch.ops.tp_overlap.column_forward.default, (x, mlp.fc1.weight, mlp.fc1.layer_id),
                test_utils=tests)
            results[f"row.{overlap}"] = torch.library.opcheck(
                torch.ops.tp_overlap.row_forward.default, (h, mlp.fc2.weight, mlp.fc2.layer_id))
            mlp.close()
        pool.barrier()
    return results


def test_custom_ops_pass_opcheck():
    for results in run_ranks(_opcheck, 2, timeout_s=180):
        for name, checks in results.items():
            assert checks and set(checks.values()) == {"SUCCESS"}, (name, checks)


def test_shard_helpers_slice_gate_and_up_separately():
    full = torch.arange(4 * 8, dtype=torch.float32).view(4, 8)  # [gate 4 cols | up 4 cols]
    shards = [shard_fc1(full, r, 2, "swiglu") for r in range(2)]
    assert torch.equal(shards[0], full[:, [0, 1, 4, 5]]) and torch.equal(shards[1], full[:, [2, 3, 6, 7]])
    assert torch.equal(shard_fc1(full, 1, 2, "gelu"), full[:, 4:])
    assert torch.equal(shard_fc2(full.t().contiguous(), 1, 2), full.t()[4:])
    with pytest.raises(OpInputError, match="fc1 width=3 must be divisible by the group size"):
        shard_fc1(torch.zeros(2, 6), 0, 2, "swiglu")
