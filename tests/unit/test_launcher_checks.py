"""The launchers' argument checks in-process: file and folder arguments, duplicates, sizes against memory (the
bytes needed and the limit), the advice for a TP size no built-in model divides, and rank 0's bounded wait for
the other local ranks (torchrun's siblings) before it exits with a usage error."""

import argparse
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tp_overlap.launch import kfactor
from tp_overlap.launch.cli import common as _cli, limits as _limits, tp_mlp_plan as _tp_mlp_plan
from tests.multiproc import child_pythonpath

ROOT = Path(__file__).resolve().parents[2]


def test_file_and_folder_arguments_are_refused_when_they_cannot_be_what_they_name(tmp_path):
    (tmp_path / "a_file").write_text("x")
    with pytest.raises(argparse.ArgumentTypeError, match="is a directory; give a YAML preset file"):
        _cli.input_file(str(tmp_path))
    with pytest.raises(argparse.ArgumentTypeError, match="no such file"):
        _cli.input_file(str(tmp_path / "missing.yaml"))
    assert _cli.input_file(str(tmp_path / "a_file")) == str(tmp_path / "a_file")
    with pytest.raises(argparse.ArgumentTypeError, match="is a directory; give the path of the file to write"):
        _cli.output_file(str(tmp_path))
    with pytest.raises(argparse.ArgumentTypeError, match="a_file is a file, not a directory"):
        _cli.output_file(str(tmp_path / "a_file" / "out.json"))
    assert _cli.output_file(str(tmp_path / "new" / "out.json")).endswith("out.json")
    with pytest.raises(argparse.ArgumentTypeError, match="a_file is a file, not a directory"):
        _cli.output_dir(str(tmp_path / "a_file"))
    assert _cli.output_dir(str(tmp_path / "new")) == str(tmp_path / "new")


def test_a_value_given_twice_is_refused_by_name():
    _cli.distinct("--model", ["tiny", "llama8b"], "model")
    with pytest.raises(_cli.UsageError, match=r"^--model: tiny is given twice; give each model once$"):
        _cli.distinct("--model", ["tiny", "llama8b", "tiny"], "model")


def _cpu(world_size=1):
    return SimpleNamespace(rank=0, local_rank=0, world_size=world_size, device=torch.device("cpu"), device_name="cpu")


def test_a_size_beyond_memory_names_the_bytes_needed_and_the_limit_shared_by_the_local_ranks(monkeypatch):
    monkeypatch.setattr(_limits, "_host_bytes", lambda: 8 << 30)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert _limits.memory_limit(_cpu()) == (8 << 30, "of host memory")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    limit, what = _limits.memory_limit(_cpu(4))
    assert limit == 2 << 30 and what == "per rank of host memory (8,589,934,592 bytes (8.0 GiB) shared by 4 ranks)"
    _limits.require_fits("x", 2 << 30, _cpu(4), "hint")
    with pytest.raises(_cli.UsageError) as info:
        _limits.require_fits("--tokens 9", (2 << 30) + 1, _cpu(4), "give a smaller --tokens")
    assert str(info.value) == ("--tokens 9 needs at least 2,147,483,649 bytes (2.0 GiB) per rank, more than the "
                               "2,147,483,648 bytes (2.0 GiB) per rank of host memory (8,589,934,592 bytes (8.0 GiB) "
                               "shared by 4 ranks); give a smaller --tokens")


def _tp_mlp_args(**given):
    args = dict(steps=2, warmup=None, tokens=None, sustained=0.0, cuda_graphs=False, trace_dir=None, config=None,
                fp8=False, dtype="bf16", model=None, activation=None, baselines=None)
    return SimpleNamespace(**(args | given))


def test_a_tp_size_no_built_in_model_divides_says_how_to_give_one():
    with pytest.raises(_cli.UsageError) as info:
        _tp_mlp_plan.plan(_tp_mlp_args(), _cpu(3))
    assert str(info.value) == (
        "tiny: ffn_hidden=176 is not divisible by the TP size 3 (each rank holds ffn_hidden/3 columns); no built-in "
        "model fits; give a model of your own in a preset's model section: copy configs/cpu.yaml, add `model: "
        "{name: mine, hidden: 64, ffn_hidden: 192}` and pass it with --config")
    with pytest.raises(_cli.UsageError, match=r"--model llama8b,llama70b fits; or give a model of your own"):
        _tp_mlp_plan.plan(_tp_mlp_args(), _cpu(7))
    with pytest.raises(_cli.UsageError, match=r"^--tokens=100 is not divisible by the TP size 7 .* e.g. --tokens 105$"):
        _tp_mlp_plan.plan(_tp_mlp_args(model="llama8b", tokens=(100,)), _cpu(7))


def test_the_plan_of_a_valid_run_fits_and_keeps_its_defaults():
    plan = _tp_mlp_plan.plan(_tp_mlp_args(tokens=(64, 128)), _cpu(2))
    assert [m.name for m in plan.models] == ["tiny"] and plan.tokens == (64, 128)
    assert plan.baselines == ["nccl"] and plan.warmup == 2


def test_kfactor_refuses_unknown_layers_and_a_shape_list_without_shapes():
    where = _cpu(2)
    with pytest.raises(_cli.UsageError, match=r"^--layers: unknown llama9b.fc1; the shape table has llama70b.fc1"):
        kfactor.points_for(kfactor.parse_args(["--layers", "llama9b.fc1"]), "ag_gemm", 2, False)
    with pytest.raises(_cli.UsageError, match=r"^no gemm_rs shape selected: --layers names none of its table"):
        kfactor.points_for(kfactor.parse_args(["--layers", "llama8b.fc1"]), "gemm_rs", 2, False)
    with pytest.raises(_cli.UsageError, match=r"^--shapes: expected MxKxN"):
        kfactor.points_for(kfactor.parse_args(["--shapes", ","]), "ag_gemm", where.world_size, False)


SIBLING_CHECK = "from launch.cli import common as _cli; print(_cli._a_sibling_runs())"


def _under_a_fresh_parent(code: str, *, with_sibling: bool) -> str:
    """Run `code` as the child of a fresh parent process whose only other child (with_sibling) sleeps: pytest's
    own children (multiprocessing's resource tracker, say) must not count."""
    parent = ("import subprocess, sys, time\n"
              + ("s = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n" if with_sibling
                 else "s = None\n")
              + f"r = subprocess.run([sys.executable, '-c', {code!r}], capture_output=True, text=True)\n"
              + "print(r.stdout.strip() or r.stderr[-500:])\n"
              + "if s: s.kill(); s.wait()\n")
    env = {"PYTHONPATH": child_pythonpath(), "PATH": "/usr/bin:/bin"}
    return subprocess.run([sys.executable, "-c", parent], env=env, capture_output=True, text=True,
                          timeout=60).stdout.strip()


def test_rank_0_sees_a_sibling_that_still_runs_and_waits_for_it_at_most_its_bound():
    assert _under_a_fresh_parent(SIBLING_CHECK, with_sibling=True) == "True"
    code = "import time; from launch.cli import common as _cli; t = time.monotonic(); _cli._wait_for_sibling_ranks(0.5); " \
           "print(round(time.monotonic() - t, 1))"
    waited = _under_a_fresh_parent(code, with_sibling=True)
    assert 0.5 <= float(waited) < 5, waited
    assert _under_a_fresh_parent(SIBLING_CHECK, with_sibling=False) == "False"
    start = time.monotonic()
    _cli._wait_for_sibling_ranks(5.0)   # this process's own siblings are pytest's, if any: bounded anyway
    assert time.monotonic() - start < 6