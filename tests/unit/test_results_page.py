"""results/ as a stranger reads it: the page is the rendering of the data (up to date, at most 400 lines), every
results file has its words (what was measured, what it means), every experiment not kept is one line with its
commit and no file left in results/, every log is one the results cite, every recorded command runs from a
checkout or says why not, the repository's results speak of the project (no diary), and every figure is drawn
from the data next to it and says what it shows."""

import importlib
import json
import re
import shlex
from pathlib import Path

import pytest
import yaml

from tp_overlap.launch import results_md
from tp_overlap.launch.output import offload_plot as _offload_plot
from tp_overlap.launch.output import plots as _plots
from tp_overlap.launch.output import results_plots as _results_plots
from tp_overlap.launch.output import trace_lanes as _trace_lanes

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "results"
CAPTIONS = yaml.safe_load((RESULTS / "captions.yaml").read_text())
DIARY = re.compile(r"\b(sessions?|issues? \d+|helpers?|next session|seed 000)\b", re.IGNORECASE)


def _results_files() -> list[Path]:
    return sorted(p for p in RESULTS.rglob("*.json") if not p.name.endswith(".trace.json"))


def test_the_page_is_the_rendering_of_the_files():
    page = (RESULTS / "README.md").read_text()
    assert page == results_md.render(RESULTS), "results/README.md is stale: run python -m tp_overlap.launch.results_md"
    assert len(page.splitlines()) <= 400, "results/README.md holds results of record only: at most 400 lines"
    assert "TP0" not in page and "TPNone" not in page and "one one" not in page
    assert "| comm | comp | points | k_comm | k_comp |" in page, "the regimes rows keep their comm and comp columns"


def _captioned() -> dict[str, dict]:
    """Every file a section names: its own entry, and the files measured with it (`with`)."""
    found = {}
    for group in CAPTIONS["groups"]:
        for name, text in group["files"].items():
            found[name] = text
            found.update(text.get("with") or {})
    return found


def test_every_results_file_at_the_top_has_its_words_and_every_caption_its_file():
    captioned = _captioned()
    files = {p.name for p in RESULTS.glob("*.json") if not p.name.endswith(".trace.json")}
    assert files - set(captioned) == set(), "a results file without a section in captions.yaml"
    assert set(captioned) - files == set(), "a section in captions.yaml names no file"
    mains = {name: text for group in CAPTIONS["groups"] for name, text in group["files"].items()}
    for name, text in captioned.items():
        assert {"title", "commit", "what", "means"} <= set(text) if name in mains else {"commit", "what"} <= set(text)
        assert json.loads((RESULTS / name).read_text())["commit"].startswith(str(text["commit"])), name
    figures = [png for t in mains.values() for png in (t.get("figures") or {})] + list(CAPTIONS["logs"]["files"])
    missing = [f for f in figures if not (RESULTS / f).exists() and not (RESULTS / "logs" / f).exists()]
    assert not missing, missing


def test_each_experiment_not_kept_is_one_line_with_its_commit_and_its_files_are_gone():
    rows = CAPTIONS["not_kept"]["rows"]
    assert rows
    for row in rows:
        assert re.fullmatch(r"[0-9a-f]{7}(, [0-9a-f]{7})*", str(row["commit"])), row
        assert "\n" not in row["what"].strip() and "|" not in row["what"], row
        for path in str(row["data"]).split(", "):
            assert "*" in path or "<" in path or "{" in path or not (RESULTS / path).exists(), path
    assert not (RESULTS / "history").exists(), "earlier measurements are listed as not kept, with their commit"


def test_every_log_is_one_a_result_cites():
    listed = set(CAPTIONS["logs"]["files"])
    present = {p.name for p in (RESULTS / "logs").iterdir() if not p.name.startswith("gpu_tests_")}
    assert present == listed, (present - listed, listed - present)
    words = " ".join(json.dumps(text) for text in _captioned().values())
    uncited = [name for name in listed if f"logs/{name}" not in words and not name.startswith(("install_dry_run",
               "numpy_cap", "tp_mlp_llama8b_cpu", "triton371"))]   # these four: docs/USAGE.md cites them
    assert not uncited, uncited


def test_every_figure_is_drawn_from_the_data_next_to_it():
    targets = {png for png, _ in _results_plots._pairs(RESULTS)}
    assert targets and all(png.is_file() for png in targets), [p.name for p in targets if not p.is_file()]
    orphans = [p.name for p in RESULTS.rglob("*.png")
               if p not in targets and not ("_timeline" in p.stem and _results_plots._traces(p))]
    assert not orphans, orphans
    names = {p.name for p in targets}
    for expected in ("tp_mlp_h200_tp2_speedup.png", "ag_gemm_h200_tp2_efficiency.png", "gemm_h200.png",
                     "gemm_rs_h200_tp2_efficiency.png", "gemm_fp8_h200.png", "host_cost_h100.png", "offload_h200.png"):
        assert expected in names, expected


def test_offload_budgets_that_chose_one_plan_share_one_label():
    row = {"model": "m", "layers": 2, "M": 64, "pred_step_ms": 10.0, "pred_peak_bytes": 5, "pred_act_peak_bytes": 3,
           "decisions": ["h=offload"], "t_step_ms": 10.1}
    rows = [dict(row, variant="planner"), dict(row, variant="planner[+0%]", t_step_ms=10.3),
            dict(row, variant="planner[+5%]", pred_step_ms=11.0, decisions=["h=offload", "a=recompute"]),
            dict(row, variant="none")]
    groups = _offload_plot._plans(rows)
    assert [[r["variant"] for r in g] for g in groups] == [["planner", "planner[+0%]"], ["planner[+5%]"]]


def _module_and_args(command: str) -> tuple[str, list[str]]:
    words = shlex.split(command)
    start = words.index("-m") + 1 if "-m" in words else next(i for i, w in enumerate(words) if w.endswith(".py"))
    return words[start], words[start + 1:]


@pytest.mark.parametrize("path", _results_files(), ids=lambda p: str(p.relative_to(RESULTS)))
def test_every_recorded_command_runs_from_a_checkout_or_says_why_not(path, monkeypatch):
    doc = json.loads(path.read_text())
    assert doc.get("commit"), "no commit recorded"
    if not doc.get("command"):
        assert doc.get("command_note") and doc.get("command_recorded"), "an empty command says why"
        return
    module, args = _module_and_args(doc["command"])
    if module.startswith("launch."):   # recorded before the import names moved under tp_overlap
        module = f"tp_overlap.{module}"
    path = module.removeprefix("tp_overlap.")
    source = ROOT / (path.replace(".", "/") + ".py" if not path.endswith(".py") else path)
    assert source.is_file(), f"{module}: not in the checkout"
    monkeypatch.chdir(ROOT)   # --config paths are relative to a checkout
    is_launcher = module.startswith("tp_overlap.launch.")
    parser = getattr(importlib.import_module(module), "make_parser", None) if is_launcher else None
    if parser is not None:
        parser().parse_args(args)
    else:   # a script with argparse of its own: every option it is given exists in it
        text = source.read_text()
        assert all(f'"{a}"' in text for a in args if a.startswith("--")), args


def test_the_results_speak_of_the_project_not_of_how_the_numbers_came_about():
    texts = [RESULTS / "README.md", *RESULTS.rglob("*.yaml"), *(RESULTS / "logs").glob("*.txt")]
    found = [(str(p.relative_to(ROOT)), m.group(0)) for p in texts for m in DIARY.finditer(p.read_text())]
    code = [p for p in (ROOT / "launch").glob("*.py")]   # "helper" is a plain word in code
    found += [(str(p.relative_to(ROOT)), m.group(0)) for p in code for m in DIARY.finditer(p.read_text())
              if not m.group(0).lower().startswith("helper")]
    assert not found, found
    assert not (RESULTS / "NOTES.md").exists()


def test_a_sweep_with_nothing_numeric_swept_plots_one_point_per_shape_not_one_point_lines():
    rows = [{"op": "ag_gemm", "layer": "l", "M": m, "K": 8, "N": 8, "method": method, "sm_margin": 0,
             "chunks_per_rank": 1, "k_comm": 20.0 if method == "decomposed" else 1.05, "k_comp": 1.0, "E": 0.9}
            for m in (64, 128) for method in ("decomposed", "fused")]
    assert _plots._swept_key(rows) is None
    swept = [dict(r, sm_margin=s) for r in rows for s in (0, 16)]
    assert _plots._swept_key(swept) == "sm_margin"


def test_the_k_axis_is_logarithmic_and_covers_one_outlier_without_flattening_the_rest():
    plt = _plots._pyplot()
    fig, ax = plt.subplots()
    _plots._log_k_axis(ax, [1.02, 1.05, 1.1, 20.3], 1.15)
    low, high = ax.get_ylim()
    assert ax.get_yscale() == "log" and low < 1.0 and high > 20.3
    assert [t.get_text() for t in ax.get_yticklabels()] == ["1", "1.25", "1.5", "2", "3", "5", "10", "20"]
    plt.close(fig)


def test_timeline_lanes_are_named_by_what_they_ran_not_by_stream_number():
    lanes = {"stream 7": [(0, 5, "nvjet_sm90_tst_192x192"), (5, 6, "vectorized_elementwise_kernel")],
             "stream 21": [(0, 1, "Memcpy PtoP (Device -> Device)"), (1, 1.01, "wait_kernel")],
             "stream 22": [(1, 2, "Memcpy DtoD (Device -> Device)")],
             "stream 30": [(0, 2, "ncclDevKernel_AllGather_RING_LL")]}
    assert _trace_lanes.lane_roles(lanes) == {"stream 7": "GEMM + elementwise / other",
                                           "stream 21": "copy + flag wait / signal", "stream 22": "copy",
                                           "stream 30": "NCCL collective"}
    assert _trace_lanes.event_kind("reduce_partials_kernel") == "reduction of partials"
    assert _trace_lanes.event_kind("at::cuda::spin_kernel") == "device hold (spin)"
