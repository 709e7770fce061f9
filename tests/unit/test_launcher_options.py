"""The launchers' command lines in-process: help shows defaults, option names survive torchrun, argument
errors are one line, run folders, the labels of CPU and one-rank runs, and the progress ticker."""

import argparse
import importlib

import pytest

from tp_overlap.launch.cli import common as _cli
from tp_overlap.launch.measure import timing
from tp_overlap.launch.output.report import CPU_NOTE, ONE_RANK_NOTE, run_labels

LAUNCHERS = ("tp_mlp", "bench", "kfactor", "offload_bench", "train")


def _parser(name: str) -> argparse.ArgumentParser:
    return importlib.import_module(f"tp_overlap.launch.{name}").make_parser()


def _visible_options(parser) -> list[str]:
    return [s for a in parser._actions if a.help is not argparse.SUPPRESS for s in a.option_strings]


@pytest.mark.parametrize("name", LAUNCHERS)
def test_help_shows_every_default_and_no_m_option(name):
    parser = _parser(name)
    text = parser.format_help()
    assert " --m " not in text and "[--m " not in text, "torchrun swallows --m as an ambiguous option"
    for action in parser._actions:
        if (not action.option_strings or action.help is argparse.SUPPRESS or action.default is None
                or action.default is argparse.SUPPRESS or isinstance(action.default, bool)):
            continue
        help_text = parser._get_formatter()._expand_help(action)
        assert "default" in help_text, (name, action.option_strings, help_text)


@pytest.mark.parametrize("name", LAUNCHERS)
def test_no_visible_option_is_an_abbreviation_of_a_torchrun_option(name):
    # torchrun parses the whole command line first: an option of ours that is a prefix of one of its own
    # options (`--m`: --master-addr, --max-restarts, ...) is an "ambiguous option" error there
    from torch.distributed.run import get_args_parser

    torchrun = [s for a in get_args_parser()._actions for s in a.option_strings]
    for option in _visible_options(_parser(name)):
        clashes = [t for t in torchrun if t.startswith(option) and t != option]
        assert not clashes, (name, option, clashes)


def test_bench_and_kfactor_keep_m_as_a_hidden_alias_of_tokens():
    from tp_overlap.launch import bench, kfactor

    assert bench.parse_args(["--m", "64,128"]).tokens == (64, 128)
    assert bench.parse_args(["--tokens", "64"]).tokens == (64,)
    assert kfactor.parse_args(["--m", "256"]).m == (256,)


@pytest.mark.parametrize("argv,message", [
    (["--tokens", "x"], "argument --tokens: expected comma-separated integers, got 'x'"),
    (["--tokens", "64,,128"], "argument --tokens: expected comma-separated integers, got '64,,128'"),
    (["--steps", "two"], "argument --steps/--reps: invalid int value: 'two'"),
    (["--dtype", "fp8"], "argument --dtype: invalid choice: 'fp8' (choose from bf16, fp32)"),
    (["--tok", "64"], "unrecognized arguments: --tok 64"),   # no abbreviations
])
def test_argument_errors_are_usage_errors_without_internal_names(argv, message):
    from tp_overlap.launch import tp_mlp

    with pytest.raises(_cli.UsageError) as info:
        tp_mlp.parse_args(argv)
    assert str(info.value).replace("'bf16', 'fp32'", "bf16, fp32") == message
    assert "_ints" not in str(info.value) and "int_list" not in str(info.value)


def test_run_launcher_prints_one_line_and_picks_the_exit_status(capsys, monkeypatch):
    from tp_overlap import ConfigError, OpInputError

    def parse(argv):
        return argv

    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    cases = [(_cli.UsageError("--tokens must be > 0, got 0"), 2, "prog: --tokens must be > 0, got 0"),
             (ConfigError("unknown model 'x'", file="", key="model"), 2, "prog: model: unknown model 'x'"),
             (ConfigError("got 3; allowed: 1", file="<config>", key="ops.ag_gemm.x"), 2,
              "prog: ops.ag_gemm.x: got 3; allowed: 1"),
             (ConfigError("no such file", file="/x.yaml"), 2, "prog: /x.yaml: no such file"),
             (OpInputError("M differs\non the ranks"), 1, "prog: OpInputError: M differs on the ranks"),
             (RuntimeError("boom"), 1, "prog: RuntimeError: boom")]
    for exc, status, line in cases:
        def body(args, exc=exc):
            raise exc
        assert _cli.run_launcher("prog", parse, body, []) == status
        err = capsys.readouterr().err
        assert err.splitlines() == [line], err
    # rank 1 under torchrun: silent on errors every rank raises the same way; exit 0 on a usage error (rank 0
    # fails the job), 1 otherwise; an error of its own is printed with its rank
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "x")
    from tp_overlap.symm_mem.errors import PeerAbortError
    from tp_overlap.symm_mem.layout import CALL_FAILED_REASON, INTERRUPTED_REASON
    for exc, status, out in [(_cli.UsageError("bad"), 0, ""), (OpInputError("same everywhere"), 1, ""),
                             (RuntimeError("mine"), 1, "prog: rank 1: RuntimeError: mine\n"),
                             (PeerAbortError(0, CALL_FAILED_REASON), 1, ""),
                             # Ctrl-C: its own, or a peer's whose abort came first; one line either way
                             (KeyboardInterrupt(), 130, "prog: rank 1: interrupted (Ctrl-C)\n"),
                             (PeerAbortError(0, INTERRUPTED_REASON), 130,
                              "prog: rank 1: interrupted (Ctrl-C on rank 0)\n")]:
        def body(args, exc=exc):
            raise exc
        assert _cli.run_launcher("prog", parse, body, []) == status
        assert capsys.readouterr().err == out
    # --debug: the traceback as well
    monkeypatch.setenv("RANK", "0")
    assert _cli.run_launcher("prog", parse, lambda a: 1 / 0, ["--debug"]) == 1
    err = capsys.readouterr().err
    assert "Traceback" in err and err.splitlines()[-1] == "prog: ZeroDivisionError: division by zero"


def test_a_torchrun_rank_run_as_a_program_exits_by_os_exit_after_flushing(capsys, monkeypatch):
    exits = []

    class Exited(Exception):
        pass

    def fake_exit(status):
        exits.append((status, capsys.readouterr().out))
        raise Exited

    monkeypatch.setattr(_cli.os, "_exit", fake_exit)
    monkeypatch.setattr(_cli.sys, "argv", ["prog"])
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "x")
    with pytest.raises(Exited):
        _cli.run_launcher("prog", lambda argv: argv, lambda args: print("done") or 0)
    with pytest.raises(Exited):
        _cli.run_launcher("prog", lambda argv: argv, lambda args: 1 / 0)
    assert exits == [(0, "done\n"), (1, "")]
    # in-process calls (argv given) and runs outside torchrun return their status
    assert _cli.run_launcher("prog", lambda argv: argv, lambda args: 0, []) == 0
    monkeypatch.delenv("TORCHELASTIC_RUN_ID")
    assert _cli.run_launcher("prog", lambda argv: argv, lambda args: 3) == 3
    assert len(exits) == 2


def test_run_dir_is_new_per_call_and_under_runs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    first, second = _cli.run_dir("tp_mlp"), _cli.run_dir("tp_mlp")
    assert first != second and first.is_dir() and second.is_dir()
    assert first.parent == second.parent == tmp_path.joinpath("runs").relative_to(tmp_path)
    assert first.name.startswith("tp_mlp-") and first.name.endswith("Z")
    assert not (tmp_path / "results").exists()


def test_labels_say_what_a_run_measured():
    assert run_labels("cuda", 2) == ("measurement", [])
    assert run_labels("cpu", 2) == ("CPU check", [CPU_NOTE])
    assert run_labels("cuda", 1) == ("1 rank", [ONE_RANK_NOTE])
    assert run_labels("cpu", 1) == ("CPU check, 1 rank", [CPU_NOTE, ONE_RANK_NOTE])
    assert CPU_NOTE.startswith("CPU run: functional check, not a performance measurement")


def test_ticker_reports_phase_starts_last_calls_and_at_most_one_line_per_interval(monkeypatch):
    lines, now = [], [0.0]
    monkeypatch.setattr(timing, "progress", lambda message, rank=0: lines.append(message))
    monkeypatch.setattr(timing.time, "monotonic", lambda: now[0])
    tick = timing.Ticker("p: ")
    for i in range(10):              # a call every 0.5 s: a line at the start, every 2 s, and at the end
        tick("timed step", i, 10, "v")
        now[0] += 0.5
    assert lines == ["p: timed step 1/10 (v)", "p: timed step 5/10 (v)", "p: timed step 9/10 (v)",
                     "p: timed step 10/10 (v)"]
    lines.clear()
    tick("k", 0, 3, "v")                # a new phase always reports
    assert lines == ["p: k 1/3 (v)"]
    silent = timing.Ticker("")
    silent("timed step", 0, 1, "v")
    assert lines == ["p: k 1/3 (v)"]
