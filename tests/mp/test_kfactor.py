"""k-factor measurement and the launch.kfactor CLI on CPU ranks (gloo + host pool, comm on a thread)."""

import json
import math
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tp_overlap.launch.measure.tune import best_configs, gate_failures, tuned_config
from tp_overlap.launch.cli.common import UsageError
from tp_overlap.launch.kfactor import configs_for, parse_sweep
from tp_overlap.config.schema import AgGemmConfig, GemmRsConfig
from tp_overlap.config.presets import load_config, dump_config, parse_config
from tp_overlap.launch.measure.k_factor import KFactor, measure, measure_pair
from tests.multiproc import child_pythonpath, run_ranks

ROOT = Path(__file__).resolve().parents[2]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


# ----- the measurement core on deterministic workloads ------------------------------------------------
REPS = 7

def _sleep_pairs(rank, world):
    group, cpu = dist.group.WORLD, torch.device("cpu")
    sleep = lambda ms: (lambda: time.sleep(ms / 1e3))  # noqa: E731
    # Workloads of tens of ms, so that a loaded 2-core machine's wake-up and thread-start latency (a few
    # ms) stays well inside the bounds below.
    # independent sleeps overlap perfectly: k = 1, E = 1, all comm hidden
    free = measure_pair(sleep(40), sleep(40), device=cpu, group=group, reps=REPS, warmup=1)
    # both sides need one lock: the overlapped step is sequential, one side waits for the other
    lock = threading.Lock()

    def locked(ms):
        def run():
            with lock:
                time.sleep(ms / 1e3)
        return run
    serial = measure_pair(locked(40), locked(40), device=cpu, group=group, reps=REPS, warmup=1)
    # a delay only while compute runs: the solo comm time must not move
    active = threading.Event()

    def comm():
        time.sleep((100 if active.is_set() else 20) / 1e3)
    injected = measure_pair(comm, sleep(40), device=cpu, group=group, reps=REPS, warmup=1, overlap_flag=active,
                            op_fn=sleep(1 + rank))
    return free, serial, injected


def test_measure_pair_separates_free_serial_and_injected_overlap():
    (free, serial, injected), (free1, _, injected1) = run_ranks(_sleep_pairs, 2)
    assert free == free1 and injected == injected1   # max over ranks: the same numbers on every rank
    assert 37.5 < free.t_comm_solo < 60 and 37.5 < free.t_comp_solo < 60
    assert free.k_comm < 1.3 and free.k_comp < 1.3 and free.E > 0.75 and free.hidden_comm > 0.6
    assert 0 <= free.start_late_ms < 8               # both threads started at `go`
    assert serial.t_total > 79                      # ran one after the other
    assert max(serial.k_comm, serial.k_comp) > 1.8 and serial.E < 0.6 and serial.hidden_comm < 0.25
    assert 17.5 < injected.t_comm_solo < 35         # solo unaffected by the injection
    assert injected.k_comm > 3.5 and injected.t_comm_overlap > 99
    assert injected.t_op >= 1.9                     # rank 1's 2 ms, not rank 0's 1 ms
    for kf in (free, serial, injected):
        assert kf.k_comm == pytest.approx(kf.t_comm_overlap / kf.t_comm_solo)
        assert kf.E == pytest.approx(max(kf.t_comm_solo, kf.t_comp_solo) / kf.t_total)
        assert kf.reps == REPS and kf.mode == "pair"


def test_kfactor_derivations():
    kf = KFactor.from_times(t_comm_solo=2.0, t_comp_solo=4.0, t_comm_overlap=2.2, t_comp_overlap=4.4, t_total=5.0,
                            t_op=8.0)
    assert (kf.k_comm, kf.k_comp, kf.E, kf.hidden_comm) == pytest.approx((1.1, 1.1, 0.8, 0.5))
    row = kf.as_row()
    assert row["t_total_ms"] == 5.0 and row["E_op"] == pytest.approx(0.5)
    with pytest.raises(Exception):
        kf.k_comm = 1.0   # frozen


# ----- our ops on the host pool ---------------------------------------------------------------------
def _ops(rank, world):
    from tp_overlap.ops.ag_gemm import AgGemm
    from tp_overlap.ops.gemm_rs import GemmRs
    from tp_overlap.symm_mem.pool import SymmetricPool

    group, dtype = dist.group.WORLD, torch.bfloat16
    gen = torch.Generator().manual_seed(5 + rank)
    m, k, n = 128, 32, 48
    out = {}
    with SymmetricPool(8 << 20, group=group) as pool:
        ag = AgGemm(group=group, pool=pool, max_m=m, k=k, n_local=n, dtype=dtype,
                    config=AgGemmConfig(method="decomposed", chunks_per_rank=2, comm_stream_priority=0))
        a_shard, w = torch.randn(m // world, k, generator=gen).to(dtype), torch.randn(k, n, generator=gen).to(dtype)
        out["ag"] = measure(ag, (a_shard, w), reps=3, warmup=1)
        rs = GemmRs(group=group, pool=pool, max_m=m, k_local=k, n=n, dtype=dtype,
                    config=GemmRsConfig(method="decomposed", comm_stream_priority=0))
        a = torch.randn(m, k, generator=gen).to(dtype)
        out["rs"] = measure(rs, (a, w), reps=3, warmup=1)
        # the RS comm path alone delivers the reduce-scatter of the partials, bit-exact in fp32
        comm = GemmRs(group=group, pool=pool, max_m=m, k_local=k, n=n, dtype=torch.float32, name="t.rs",
                      config=GemmRsConfig(method="decomposed", comm_stream_priority=0))
        ref = torch.empty(m // world, n)
        for _ in range(3):  # the handshakes come back to their start every call
            partials = torch.randn(m, n, generator=gen)
            shard = comm.reduce_scatter(partials)
            dist.reduce_scatter_tensor(ref, partials, group=group)
            out.setdefault("rs_exact", []).append(torch.equal(shard, ref))
        out["ag_works_after"] = torch.equal(ag(a_shard, w), ag(a_shard, w))  # the op's flags were not disturbed
        pool.barrier()
    return out


def test_measure_ops_on_host_pool():
    for out in run_ranks(_ops, 2, timeout_s=120):
        for kf in (out["ag"], out["rs"]):
            values = (kf.t_comm_solo, kf.t_comp_solo, kf.t_comm_overlap, kf.t_comp_overlap, kf.t_total, kf.t_op)
            assert all(math.isfinite(v) and v > 0 for v in values), kf
            assert kf.t_total >= max(kf.t_comm_overlap, kf.t_comp_overlap) - 1e-9
        assert out["rs_exact"] == [True, True, True] and out["ag_works_after"]


# ----- the CLI ----------------------------------------------------------------------------------------
def test_parse_sweep_both_spellings_and_errors():
    grid = {"sm_margin": (0, 8, 16), "chunks_per_rank": (1, 2)}
    assert parse_sweep(["sm_margin=0,8,16", "chunks_per_rank=1,2"]) == grid
    assert parse_sweep(["sm_margin=0,8,16,chunks_per_rank=1,2"]) == grid
    assert parse_sweep(["method=fused,decomposed"]) == {"method": ("fused", "decomposed")}
    for bad, words in [(["smm=1"], "unknown key"), (["0,8"], "no KEY="), (["sm_margin=x"], "not an int"),
                       (["sm_margin=1", "sm_margin=2"], "twice"), (["sm_margin="], "no values")]:
        with pytest.raises(ValueError, match=words):
            parse_sweep(bad)


def test_a_swept_method_applies_only_to_the_ops_that_have_it():
    base = load_config(ROOT / "configs" / "h200_tp2.yaml")
    grid = {"method": ("decomposed", "epilogue_reduce"), "sm_margin": (0, 16)}
    ag = configs_for("ag_gemm", base, grid, True, 132)
    rs = configs_for("gemm_rs", base, grid, True, 132)
    assert [(c.method, c.sm_margin) for c in ag] == [("decomposed", 0), ("decomposed", 16)]
    assert [(c.method, c.sm_margin) for c in rs] == [("decomposed", 0), ("decomposed", 16),
                                                     ("epilogue_reduce", 0), ("epilogue_reduce", 16)]
    with pytest.raises(UsageError, match="no swept method applies to ag_gemm"):
        configs_for("ag_gemm", base, {"method": ("epilogue_reduce",)}, True, 132)
    # a lead GEMM only for the decomposed AG consumer; the preset's lead is dropped for fused
    lead = configs_for("ag_gemm", base, {"method": ("decomposed", "fused"), "lead_fraction": (0.0, 0.25)}, True, 132)
    assert [(c.method, c.lead_fraction) for c in lead] == [("decomposed", 0.0), ("decomposed", 0.25), ("fused", 0.0)]


def _row(op, layer, m, method, sm, t):
    return {"op": op, "layer": layer, "M": m, "K": 64, "N": 64, "method": method, "sm_margin": sm,
            "chunks_per_rank": 1, "num_comm_sms": sm, "t_op_ms": t, "k_comm": 1.0, "k_comp": 1.0}


def test_tuned_preset_buckets_round_trip(tmp_path):
    base = load_config(ROOT / "configs" / "h200_tp2.yaml")
    rows = [_row("gemm_rs", layer, m, "fused", sm, t) for layer in ("a", "b")
            for m, sm, t in [(1024, 8, 1.0), (1024, 16, 1.2), (4096, 8, 2.0), (4096, 16, 1.5),
                             (16384, 8, 6.0), (16384, 16, 5.0)]]
    rows += [_row("ag_gemm", "q", m, method, 0, t) for m, method, t in
             [(1024, "decomposed", 0.5), (1024, "fused", 0.4), (16384, "decomposed", 3.0), (16384, "fused", 3.3)]]
    best = best_configs(rows)
    assert [(m, c["sm_margin"]) for m, c in best["gemm_rs"]] == [(1024, 8), (4096, 16), (16384, 16)]
    cfg = tuned_config(base, best, device_name="NVIDIA H200", world=2, num_sms=132)
    path = tmp_path / "tuned.yaml"
    dump_config(cfg, path)
    loaded = load_config(path)
    assert loaded.gemm_rs.default.sm_margin == 16 and [m for m, _ in loaded.gemm_rs.by_m] == [1024]
    assert loaded.op_config("gemm_rs", 1000).sm_margin == 8 and loaded.op_config("gemm_rs", 4096).sm_margin == 16
    assert loaded.op_config("ag_gemm", 1024).method == "fused"
    assert loaded.op_config("ag_gemm", 2048).method == "decomposed"
    assert loaded.node.tp_size == 2 and loaded.node.num_sms == 132
    assert parse_config({"node": vars(loaded.node), "ops": {"ag_gemm": {"method": "fused"},
                                                            "gemm_rs": {"method": "fused"}}})  # still a valid node
    assert gate_failures(rows, 1.15) == []
    rows[0]["k_comm"] = 1.3
    assert gate_failures(rows, 1.15) == ["gemm_rs a M=1024 K=64 N=64 (method=fused, sm_margin=8, num_comm_sms=8): "
                                         "k_comm=1.300 > max_k 1.15"]
    rows[2]["k_comp"] = 1.5   # sm_margin=8 at M=4096 is not the chosen config: `--gate best` ignores it
    assert len(gate_failures(rows, 1.15, best)) == 1 and len(gate_failures(rows, 1.15)) == 2


def _torchrun(args, tmp_path, timeout=180):
    env = {**os.environ, "PYTHONPATH": child_pythonpath(), "OVERLAP_PROGRESS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "tp_overlap.launch.kfactor", "--out-dir", str(tmp_path), *args]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def test_cli_writes_json_plots_traces_and_a_loadable_preset(tmp_path):
    tuned = tmp_path / "tuned.yaml"
    proc = _torchrun(["--reps", "5", "--warmup", "1", "--max-k", "1e9", "--write-config", str(tuned)], tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    doc = json.loads((tmp_path / "kfactor_cpu_tp2.json").read_text())
    assert doc["tp"] == 2 and doc["kind"] == "kfactor" and doc["gate_failures"] == []
    assert doc["grid"] == {"sm_margin": [0, 8], "chunks_per_rank": [1, 2]}
    rows = doc["rows"]
    by_op = {op: [r for r in rows if r["op"] == op] for op in ("ag_gemm", "gemm_rs", "ag_regime")}
    assert len(by_op["ag_gemm"]) == 2 * 4 and len(by_op["gemm_rs"]) == 2 * 2 and len(by_op["ag_regime"]) == 2 * 4
    assert {(r["comm"], r["comp"]) for r in by_op["ag_regime"]} == {(c, p) for c in ("ce", "gloo")
                                                                     for p in ("gemm", "membound")}
    positive = ("t_comm_solo_ms", "t_comp_solo_ms", "t_comm_overlap_ms", "t_total_ms", "k_comm", "k_comp", "E")
    for r in rows:
        assert all(math.isfinite(r[key]) and r[key] > 0 for key in positive), r
        assert r["k_comm"] == pytest.approx(r["t_comm_overlap_ms"] / r["t_comm_solo_ms"])
    assert all(r["t_op_ms"] > 0 for r in by_op["ag_gemm"] + by_op["gemm_rs"])
    for name in ("kfactor_cpu_tp2.png", "kfactor_cpu_tp2_timeline.png"):
        data = (tmp_path / name).read_bytes()
        assert data[:8] == PNG_MAGIC and len(data) > 10_000, name
    for op in ("ag_gemm", "gemm_rs"):
        trace = json.loads((tmp_path / f"kfactor_cpu_tp2_{op}.trace.json").read_text())
        names = {e.get("name") for e in trace["traceEvents"]}
        assert {"kfactor.comm", "kfactor.comp", "aten::mm"} <= names, op
    loaded = load_config(tuned)   # the loader accepts it, and it holds the measured best per M bucket
    assert loaded.node.tp_size == 2
    for op, choices in doc["best"].items():
        for m, fields in choices:
            chosen = loaded.op_config(op, m)
            assert {k: getattr(chosen, k) for k in fields} == fields
    assert "[####################] 20/20" in proc.stderr and "| op | layer |" in proc.stdout


@pytest.mark.parametrize("delay_ms,expect_rc", [(0, 0), (300, 1)])
def test_gate_exits_1_only_when_comm_slows_under_overlap(tmp_path, delay_ms, expect_rc):
    # CPU k values carry host-scheduling noise (GIL, the 1 ms back-off of host waits, barrier skew: the
    # solo gather took 0.5-3.3 ms, k up to ~5 without injection), so the CPU gate is 20: far above that
    # noise and far below what a 300 ms delay under overlap gives (k > 90).
    args = ["--ops", "ag_gemm", "--shapes", "512x256x256", "--sweep", "sm_margin=0", "--sweep", "chunks_per_rank=1",
            "--reps", "5", "--warmup", "1", "--no-plots", "--max-k", "20", "--inject-comm-delay-ms", str(delay_ms)]
    proc = _torchrun(args, tmp_path)
    assert proc.returncode == expect_rc, proc.stderr[-4000:]
    row = json.loads((tmp_path / "kfactor_cpu_tp2.json").read_text())["rows"][0]
    if expect_rc:
        assert row["k_comm"] > 20 and row["t_comm_overlap_ms"] > 300 and row["t_comm_solo_ms"] < 15
        assert "k-factor gate: ag_gemm custom M=512 K=256 N=256 (method=decomposed, sm_margin=0, chunks_per_rank=1, " \
               f"lead_fraction=0.0): k_comm={row['k_comm']:.3f} > max_k 20.0" in proc.stderr
    else:
        assert row["k_comm"] < 20 and "k-factor gate" not in proc.stderr
