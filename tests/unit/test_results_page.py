"""results/ as a stranger reads it: the page is the rendering of the data (up to date), every results file has
its words (what was measured, what it means), every recorded command runs from a checkout or says why not,
the repository's results speak of the project (no diary), and the plots say what they show."""

import importlib
import json
import re
import shlex
from pathlib import Path

import pytest
import yaml

from tp_overlap.launch import results_md
from tp_overlap.launch.measure import timeline as _timeline
from tp_overlap.launch.output import plots as _plots

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "results"
CAPTIONS = yaml.safe_load((RESULTS / "captions.yaml").read_text())
DIARY = re.compile(r"\b(sessions?|issues? \d+|helpers?|next session|seed 000)\b", re.IGNORECASE)


def _results_files() -> list[Path]:
    return sorted(p for p in RESULTS.rglob("*.json") if not p.name.endswith(".trace.json"))


def test_the_page_is_the_rendering_of_the_files():
    page = (RESULTS / "README.md").read_text()
    assert page == results_md.render(RESULTS), "results/README.md is stale: run python -m tp_overlap.launch.results_md"
    assert "TP0" not in page and "TPNone" not in page and "one one" not in page
    assert "| layer | M | K | N | comm | comp |" in page, "the regimes rows keep their comm and comp columns"


def test_every_results_file_at_the_top_has_its_words_and_every_caption_its_file():
    captioned = {name: text for group in CAPTIONS["groups"] for name, text in group["files"].items()}
    files = {p.name for p in RESULTS.glob("*.json") if not p.name.endswith(".trace.json")}
    assert files - set(captioned) == set(), "a results file without a section in captions.yaml"
    assert set(captioned) - files == set(), "a section in captions.yaml names no file"
    for name, text in captioned.items():
        assert {"title", "commit", "what", "means"} <= set(text), name
        assert json.loads((RESULTS / name).read_text())["commit"].startswith(str(text["commit"])), name
    figures = [png for g in CAPTIONS["groups"] for t in g["files"].values() for png in (t.get("figures") or {})]
    figures += list(CAPTIONS["traces"]["figures"]) + list(CAPTIONS["logs"]["files"])
    missing = [f for f in figures if not (RESULTS / f).exists() and not (RESULTS / "logs" / f).exists()]
    assert not missing, missing


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
    assert _timeline.lane_roles(lanes) == {"stream 7": "GEMM + elementwise / other",
                                           "stream 21": "copy + flag wait / signal", "stream 22": "copy",
                                           "stream 30": "NCCL collective"}
    assert _timeline.event_kind("reduce_partials_kernel") == "reduction of partials"
    assert _timeline.event_kind("at::cuda::spin_kernel") == "device hold (spin)"
