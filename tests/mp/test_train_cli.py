"""`tp_overlap.launch.train` end to end under torchrun on 2 CPU ranks (gloo + host pool): the tiny Llama trained
by ours, DTensor TP and the unconverted model side by side; its usage errors; and the loop's agreement on
dropping a variant that fails on one rank only."""

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.multiproc import child_pythonpath, run_ranks

ROOT = Path(__file__).resolve().parents[2]
PROG = "tp_overlap.launch.train"
pytestmark = pytest.mark.skipif(importlib.util.find_spec("transformers") is None,
                                reason="transformers is not installed (pip install -e '.[hf]')")


def _env():
    return {**os.environ, "PYTHONPATH": child_pythonpath(), "OVERLAP_PROGRESS": "1", "CUDA_VISIBLE_DEVICES": "",
            "OMP_NUM_THREADS": "1"}


def _torchrun(args, cwd, ranks=2, timeout=180):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks),
           "-m", PROG, *args]
    return subprocess.run(cmd, cwd=cwd, env=_env(), capture_output=True, text=True, timeout=timeout)


def _rel(a, b):
    return abs(a - b) / abs(b)


def test_train_two_cpu_ranks_ours_matches_dtensor_and_the_unconverted_model(tmp_path):
    out = tmp_path / "train.json"
    steps = 4
    proc = _torchrun(["--variants", "ours,dtensor,full", "--steps", str(steps), "--out", str(out)], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["tp"] == 2 and doc["device"] == "cpu" and doc["op"] == "train" and doc["run_kind"] == "CPU check"
    assert f"-m {PROG} --variants ours,dtensor,full --steps {steps}" in doc["command"]
    assert doc["commit"] == os.environ.get("OVERLAP_GIT_COMMIT") or re.fullmatch(r"[0-9a-f]{40}(\+dirty)?",
                                                                                 doc["commit"]), doc["commit"]
    assert doc["model"]["name"] == "tiny" and doc["dtype"] == "fp32" and doc["optimizer"] == "adamw"
    assert [row["step"] for row in doc["rows"]] == list(range(1, steps + 1))
    for row in doc["rows"]:   # every step of every variant, from the rows themselves (not the launcher's summary)
        for name in ("dtensor", "full"):
            assert _rel(row[f"loss_{name}"], row["loss_ours"]) < 1e-4, (name, row)
        assert all(row[f"step_ms_{name}"] > 0 for name in ("ours", "dtensor", "full")), row
    # the steps train every weight: an optimizer holding the pre-conversion parameters (the blocks' weights
    # replaced by the conversion) still moves the loss, but away from the unconverted model's
    losses = [row["loss_ours"] for row in doc["rows"]]
    assert len({round(loss, 6) for loss in losses}) == steps, losses
    comparison = doc["loss_comparison"]
    assert comparison["reference"] == "ours" and comparison["ours_agrees_with"] == {"dtensor": True, "full": True}
    assert comparison["by_variant"]["dtensor"]["steps_compared"] == steps
    for name in ("ours", "dtensor", "full"):
        summary = doc["variants"][name]
        assert summary["status"] == "ok" and summary["steps_run"] == steps and summary["timed_steps"] == steps - 1
        assert summary["tokens_per_s"] == pytest.approx(2 * 32 / (summary["step_ms_median"] / 1e3))
    assert doc["variants"]["ours"]["pool_bytes"] > 0
    assert f"train: step {steps}/{steps}: ours loss" in proc.stderr and "| ours | ok |" in proc.stdout
    assert "functional check, not a performance measurement" in proc.stdout


def test_train_bad_arguments_are_refused_in_one_line_with_exit_2(tmp_path):
    proc = subprocess.run([sys.executable, "-m", PROG, "--variants", "ours,bogus"], cwd=tmp_path, env=_env(),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip() == (f"{PROG}: --variants: unknown 'bogus'; allowed: ours, dtensor, async_tp, full")
    # under torchrun: the same single line from rank 0, whose exit status is 2; nothing written
    proc = _torchrun(["--seq", "31"], tmp_path)
    lines = [line for line in proc.stderr.splitlines() if line.startswith(PROG + ":")]
    assert lines == [f"{PROG}: --seq must be a positive multiple of the TP size 2 (every variant splits the "
                     f"sequence evenly), got 31; try --seq 32"], proc.stderr
    assert "exitcode  : 2 " in proc.stderr and not (tmp_path / "runs").exists()


def _one_variant_fails_on_rank_1(rank, world_size):
    import torch
    import torch.distributed as dist
    from tp_overlap.launch.measure.train_loop import Variant, run_steps

    class Model(torch.nn.Module):
        def __init__(self, fail_on_rank):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.ones(4))
            self.fail_on_rank, self.calls = fail_on_rank, 0

        def forward(self, input_ids, labels):
            self.calls += 1
            loss = (self.weight * input_ids.float()).sum()
            dist.all_reduce(loss.detach())   # a collective each step, as a TP model has
            if rank == self.fail_on_rank and self.calls == 2:   # its second step, on one rank only
                raise RuntimeError("compile failed here")
            return type("Out", (), {"loss": loss})()

    variants = []
    for name, fail in (("flaky", 1), ("steady", None)):
        model = Model(fail)
        variants.append(Variant(name, model, torch.optim.SGD(model.parameters(), lr=0.1), may_fail=name == "flaky"))
    run_steps(variants, steps=3, batch_of=lambda step: torch.full((4,), float(step + 1)), group=dist.group.WORLD,
              device=torch.device("cpu"), rank=rank)
    return [(v.name, len(v.losses), v.error) for v in variants]


def test_a_variant_failing_on_one_rank_is_dropped_on_every_rank():
    results = run_ranks(_one_variant_fails_on_rank_1, 2, timeout_s=60)
    for rank, ((flaky, flaky_steps, error), (steady, steady_steps, steady_error)) in enumerate(results):
        assert (flaky, flaky_steps, steady, steady_steps, steady_error) == ("flaky", 1, "steady", 3, None)
        expected = "RuntimeError: compile failed here" if rank == 1 else "failed on another rank of the group"
        assert error.startswith(expected), (rank, error)


class _Op:
    """A stand-in call_function target printed as a torch op is (the symm_mem ops exist only in CUDA builds)."""

    def __init__(self, name):
        self.name, self.__name__ = name, name.split(".")[1]

    def __call__(self, *args):
        return None

    def __str__(self):
        return self.name


def test_the_fusion_counter_counts_fused_ops_and_the_collectives_left():
    import torch
    from tp_overlap.launch.measure.train_models import FusionCounter

    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    for name in ("symm_mem.fused_all_gather_matmul.default", "symm_mem.fused_matmul_reduce_scatter.default",
                 "symm_mem.fused_matmul_reduce_scatter.default", "_c10d_functional.all_gather_into_tensor.default",
                 "_c10d_functional.wait_tensor.default", "aten.mm.default"):
        graph.call_function(_Op(name), (x,))
    counter = FusionCounter()
    counter(graph)
    counter(torch.fx.Graph())
    summary = counter.summary()
    assert summary["graphs"] == 2 and summary["fused_ops"] == 3
    assert summary["counts"] == {"fused_all_gather_matmul": 1, "fused_all_gather_scaled_matmul": 0,
                                 "fused_matmul_reduce_scatter": 2, "fused_scaled_matmul_reduce_scatter": 0,
                                 "all_gather_into_tensor": 1, "reduce_scatter_tensor": 0, "all_reduce": 0}


def test_the_defaults_follow_the_device():
    from tp_overlap.launch.train import _defaults, parse_args

    cpu, gpu = parse_args([]), parse_args([])
    _defaults(cpu, cuda=False)
    _defaults(gpu, cuda=True)
    assert (cpu.model, cpu.variants, cpu.dtype, cpu.batch, cpu.seq) == ("tiny", ["ours", "dtensor"], "fp32", 2, 32)
    assert (gpu.model, gpu.variants, gpu.dtype) == ("llama1b-ish", ["ours", "dtensor", "async_tp"], "bf16")
    assert gpu.warmup < gpu.steps and (gpu.batch, gpu.seq) == (4, 2048)
