"""k-factor on real GPUs (marker `gpu`; tests/gpu/run_all.sh): short sweeps over AG and RS table points, the
op's own per-stream spans (mode "op"), an injected comm delay, and the launch.kfactor CLI."""

import json
import math
import os
import subprocess
import sys
import threading
from pathlib import Path

import torch
import torch.distributed as dist

from tests.multiproc import GPU_SAFE_ENV, child_pythonpath, run_ranks

ROOT = Path(__file__).resolve().parents[2]


def _rel_err(out, ref) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def _sweep(rank, world):
    from tp_overlap.ops.ag_gemm import AgGemm
    from tp_overlap.config.schema import AgGemmConfig, GemmRsConfig
    from tp_overlap.ops.gemm_rs import GemmRs
    from tp_overlap.launch.measure.comm_delay import inject_comm_delay
    from tp_overlap.launch.measure.k_factor import measure
    from tp_overlap.ops.reference import gemm_rs_reference
    from tp_overlap.launch.cli.shapes import ag_points, rs_points
    from tp_overlap.symm_mem.pool import SymmetricPool

    group, dev, dtype = dist.group.WORLD, torch.device("cuda", torch.cuda.current_device()), torch.bfloat16
    ag_pt = ag_points(world, ms=(4096,), layers=["llama8b.qkv"])[0]
    rs_pt = rs_points(world, ms=(4096,), layers=["llama8b.o_proj"])[0]
    gen = torch.Generator().manual_seed(3 + rank)
    rows, ops = [], []
    with SymmetricPool(1 << 30, group=group) as pool:
        a_shard = torch.randn(ag_pt.m // world, ag_pt.k, generator=gen).to(dtype).to(dev)
        w_ag = (torch.randn(ag_pt.k, ag_pt.n, generator=gen) / ag_pt.k ** 0.5).to(dtype).to(dev)
        a = torch.randn(rs_pt.m, rs_pt.k, generator=gen).to(dtype).to(dev)
        w_rs = (torch.randn(rs_pt.k, rs_pt.n, generator=gen) / rs_pt.k ** 0.5).to(dtype).to(dev)
        ref_rs = gemm_rs_reference(a, w_rs, group=group)
        i = 0
        for method in ("decomposed", "fused"):
            for sm_margin in (0, 16):
                i += 1
                ag = AgGemm(group=group, pool=pool, max_m=ag_pt.m, k=ag_pt.k, n_local=ag_pt.n, dtype=dtype,
                            config=AgGemmConfig(method=method, sm_margin=sm_margin, chunks_per_rank=2),
                            name=f"ag{i}")
                out, gathered = ag(a_shard, w_ag, return_gathered=True)   # correct (and compiled) before timing
                assert _rel_err(out, gathered.float() @ w_ag.float()) < 1e-2
                rows.append(("ag_gemm", method, sm_margin, measure(ag, (a_shard, w_ag), reps=10, warmup=3)))
                ops.append(ag)
        # fused runs its reduction on reserved SMs (sm_margin >= num_comm_sms >= 1): its margins are 16 and 32
        for method, sm_margin in (("decomposed", 0), ("decomposed", 16), ("fused", 16), ("fused", 32)):
            rs = GemmRs(group=group, pool=pool, max_m=rs_pt.m, k_local=rs_pt.k, n=rs_pt.n, dtype=dtype,
                        config=GemmRsConfig(method=method, sm_margin=sm_margin, num_comm_sms=16),
                        name=f"rs.{method}.{sm_margin}")
            assert _rel_err(rs(a, w_rs), ref_rs) < 1e-2
            rs.check_errors()
            rows.append(("gemm_rs", method, sm_margin, measure(rs, (a, w_rs), reps=10, warmup=3)))
            ops.append(rs)
        ag = ops[3]  # fused AG, sm_margin 16
        traced = measure(ag, (a_shard, w_ag), reps=10, warmup=3, mode="op")   # the op's own per-stream spans
        active = threading.Event()
        slowed = measure(ag, (a_shard, w_ag), reps=10, warmup=3, overlap_flag=active,
                         wrap_comm=lambda fn: inject_comm_delay(fn, delay_ms=2.0, active=active, device=dev))
        torch.cuda.synchronize()
        for op in ops:
            op.close()
        pool.barrier()
    return rows, traced, slowed


def _sane(kf) -> bool:
    values = (kf.k_comm, kf.k_comp, kf.E, kf.t_comm_solo, kf.t_comp_solo, kf.t_total, kf.t_op)
    return all(math.isfinite(v) for v in values) and kf.k_comm > 0.5 and kf.k_comp > 0.5 and 0 < kf.E <= 1.3


def test_kfactor_short_sweep_ag_and_rs(num_gpus):
    (rows, traced, slowed), (rows1, _, _) = run_ranks(_sweep, 2, backend="nccl", timeout_s=600)
    assert [r[3] for r in rows] == [r[3] for r in rows1]   # max over ranks: identical on both ranks
    assert len(rows) == 8
    for op, method, sm_margin, kf in rows:
        assert _sane(kf), (op, method, sm_margin, kf)
        assert kf.t_comm_overlap > 0 and kf.t_total >= max(kf.t_comm_overlap, kf.t_comp_overlap) * 0.99
    assert traced.mode == "op" and traced.k_comm > 0.5 and math.isfinite(traced.k_comp)
    assert slowed.k_comm > 3, slowed   # 2 ms spin ahead of a ~0.1 ms gather, only under overlap
    assert slowed.t_comm_solo < 1.0, slowed


def test_kfactor_cli_on_gpus(tmp_path, num_gpus):
    env = {**os.environ, **GPU_SAFE_ENV, "PYTHONPATH": child_pythonpath(), "PYTHONUNBUFFERED": "1"}
    tuned = tmp_path / "tuned.yaml"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "tp_overlap.launch.kfactor", "--tokens", "1024", "--layers", "llama8b.qkv,llama8b.o_proj",
           "--sweep", "method=decomposed,fused", "--sweep", "sm_margin=0,16", "--sweep", "chunks_per_rank=1",
           "--reps", "5", "--warmup", "2", "--max-k", "100", "--out-dir", str(tmp_path),
           "--write-config", str(tuned)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    stem = next(tmp_path.glob("kfactor_*_tp2.json")).stem
    doc = json.loads((tmp_path / f"{stem}.json").read_text())
    rows = doc["rows"]
    # gemm_rs: fused at sm_margin 0 is no config (its reduction needs reserved SMs): decomposed x 2, fused x 1
    assert len([r for r in rows if r["op"] == "ag_gemm"]) == 4 and len([r for r in rows if r["op"] == "gemm_rs"]) == 3
    assert len([r for r in rows if r["op"] == "ag_regime"]) == 4
    assert all(math.isfinite(r["k_comm"]) and r["k_comm"] > 0.5 and r["k_comp"] > 0.5 for r in rows)
    assert all("k_comm_op" in r for r in rows if r["op"] == "ag_gemm")
    for name in (f"{stem}.png", f"{stem}_timeline.png"):
        assert (tmp_path / name).stat().st_size > 10_000
    trace = json.loads((tmp_path / f"{stem}_gemm_rs.trace.json").read_text())
    assert any(e.get("cat") == "kernel" for e in trace["traceEvents"])   # CUDA activity recorded
    from tp_overlap.config.presets import load_config
    cfg = load_config(tuned)
    assert cfg.node.tp_size == 2 and cfg.node.num_sms == torch.cuda.get_device_properties(0).multi_processor_count
