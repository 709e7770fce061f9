"""Render results/README.md from the files in results/: per results file, what was measured, on what hardware,
at which commit, with which command, its table and figures, and what it means.

    python -m tp_overlap.launch.results_md [--dir results] [--plots]

The numbers, the hardware, the commit and the command come from each JSON; the words (what was measured,
what it means, figure captions) from the folder's captions.yaml. `--plots` first redraws every PNG from
the data next to it (launch/output/results_plots.py; needs matplotlib).
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import yaml

from tp_overlap.launch.cli.common import ArgumentParser, require, run_launcher

from .output import results_tables as tables

PROG = "tp_overlap.launch.results_md"
CAPTIONS = "captions.yaml"
HEADER = ("<!-- Rendered by `python -m tp_overlap.launch.results_md` from the files in this folder: edit captions.yaml (the "
          "words) or the JSON (the numbers), not this page. -->")


def _on(doc: dict) -> str:
    """The hardware a file ran on, as a reader would say it."""
    device, tp = doc.get("device"), doc.get("tp")
    one = f"one {device}" if device else "one GPU"
    if doc.get("op") in ("gemm", "gemm_fp8"):   # launch.gemm_bench: one GPU, the local shapes of TP sizes
        return f"{one}; the local GEMMs of TP {', '.join(map(str, doc.get('tp_sizes') or [tp]))}"
    if not tp or tp == 1:
        return one
    return f"{tp} ranks, {device}"


def current_command(recorded: str) -> str:
    """A recorded command as it runs from this checkout: files written before the import names moved under
    `tp_overlap` recorded `-m launch.<name>`."""
    return re.sub(r"(-m )launch\.", r"\1tp_overlap.launch.", recorded)


def _provenance(name: str, doc: dict) -> list[str]:
    date = f" · {doc['date'][:10]}" if doc.get("date") else ""
    lines = [f"`{name}` · {_on(doc)} · commit `{tables.short_commit(doc.get('commit'))}`{date}  "]
    if doc.get("command"):
        lines.append(f"Command: `{current_command(doc['command'])}`")
    else:
        lines.append(f"Command: none that runs from this checkout ({doc.get('command_note', 'not recorded')})")
    return lines


def _figure(directory: Path, png: str, caption: str | None) -> list[str]:
    return [f"![{png}]({png})", "", f"*{caption.strip()}*" if caption else f"*{png}*", ""]


def _section(directory: Path, name: str, caption: dict) -> list[str]:
    doc = json.loads((directory / name).read_text())
    parts = [f"### {caption.get('title', name)}", "", *_provenance(name, doc), ""]
    written = str(caption.get("commit", ""))
    if written and not str(doc.get("commit", "")).startswith(written):
        parts += [f"(The text of this section was written for the data of commit {written}; this file is from "
                  f"{tables.short_commit(doc.get('commit'))}: check that it still holds.)", ""]
    if caption.get("what"):
        parts += [f"**Measured.** {caption['what'].strip()}", ""]
    for block in tables.file_tables(name, doc):
        parts += [block, ""]
    stem = Path(name).stem
    figures = dict(caption.get("figures") or {})
    for png in (f"{stem}.png", f"{stem}_timeline.png"):
        if (directory / png).is_file():
            figures.setdefault(png, None)
    for png, text in figures.items():
        parts += _figure(directory, png, text)
    if caption.get("means"):
        parts += [f"**What it means.** {caption['means'].strip()}", ""]
    return parts


def _anchor(heading: str) -> str:
    keep = "".join(c for c in heading.lower() if c.isalnum() or c in " -_")
    return keep.replace(" ", "-")


def _groups(directory: Path, captions: dict) -> list[dict]:
    """The caption groups, plus one for the results files no caption names."""
    groups = [g for g in captions.get("groups", [])]
    named = {name for g in groups for name in g["files"]}
    other = sorted(p.name for p in directory.glob("*.json") if not p.name.endswith(".trace.json")
                   and p.name not in named)
    if other:
        groups.append({"heading": "Other results (no text yet in captions.yaml)", "files": {n: {} for n in other}})
    return groups


def _undone_commands(directory: Path) -> list[str]:
    rows = []
    for path in sorted(p for p in directory.rglob("*.json") if not p.name.endswith(".trace.json")):
        doc = json.loads(path.read_text())
        if isinstance(doc, dict) and "command" in doc and not doc["command"]:
            rows.append({"file": str(path.relative_to(directory)), "why": doc.get("command_note", ""),
                         "recorded": f"`{doc.get('command_recorded', '')}`"})
    return [tables.format_table(rows, ["file", "why", "recorded"])] if rows else []


def _appendix(directory: Path, captions: dict) -> list[str]:
    parts = ["## Recorded commands that do not run from this checkout", "",
             "Each of these files keeps the command it ran as `command_recorded`; `command` is empty because "
             "what it ran is not in the repository. Every other file's command runs from a checkout.", "",
             *_undone_commands(directory), ""]
    history = directory / "history"
    if history.is_dir():
        steps, ops, other = tables.history_tables(history)
        parts += ["## Earlier measurements (history/)", "", captions.get("history", "").strip(), "",
                  "TP MLP training steps:", "", steps, "", "Op benchmarks (best method per point):", "", ops, "",
                  "Other measurements:", "", other, ""]
    traces = directory / "traces"
    if traces.is_dir():
        about = captions.get("traces", {})
        parts += ["## Profiles of one step (traces/)", "", about.get("about", "").strip(), "",
                  tables.trace_table(traces), ""]
        for png, text in (about.get("figures") or {}).items():
            parts += _figure(directory, png, text)
    logs = directory / "logs"
    if logs.is_dir():
        about = captions.get("logs", {})
        parts += ["## Logs (logs/)", "", about.get("gpu_tests", "").strip(), "", tables.suite_table(logs), ""]
        parts += [f"* `logs/{name}`: {text}" for name, text in (about.get("files") or {}).items()] + [""]
    return parts


def render(directory: Path) -> str:
    captions_path = directory / CAPTIONS
    captions = yaml.safe_load(captions_path.read_text()) if captions_path.is_file() else {}
    groups = _groups(directory, captions)
    extra = ["Recorded commands that do not run from this checkout", "Earlier measurements (history/)",
             "Profiles of one step (traces/)", "Logs (logs/)"]
    parts = [HEADER, "", "# Measured results", "", (captions.get("intro") or "").strip(), "", "Contents:", ""]
    parts += [f"* [{h}](#{_anchor(h)})" for h in [g["heading"] for g in groups] + extra] + [""]
    for group in groups:
        parts += [f"## {group['heading']}", ""]
        for name, caption in group["files"].items():
            if (directory / name).is_file():
                parts += _section(directory, name, caption or {})
    parts += _appendix(directory, captions)
    return "\n".join(parts).rstrip() + "\n"


def make_parser() -> ArgumentParser:
    p = ArgumentParser(PROG, description=__doc__)
    p.add_argument("--dir", default="results", help="the results folder to render (its README.md is rewritten)")
    p.add_argument("--plots", action="store_true", help="redraw every PNG from its data first (needs matplotlib)")
    return p


def parse_args(argv=None):
    args = make_parser().parse_args(argv)
    require(Path(args.dir).is_dir(), f"--dir {args.dir}: no such directory (give the results folder, e.g. results)")
    require(any(Path(args.dir).glob("*.json")), f"--dir {args.dir}: no results JSON in it; nothing to render")
    return args


def _run(args) -> int:
    directory = Path(args.dir)
    if args.plots:
        from .output.results_plots import redraw
        done, missing = redraw(directory)
        print(f"redrew {len(done)} PNG(s)" + (f"; no data for {', '.join(missing)}" if missing else ""))
    (directory / "README.md").write_text(render(directory))
    print(f"wrote {directory / 'README.md'}")
    return 0


def main(argv=None) -> int:
    return run_launcher(PROG, parse_args, _run, argv)


if __name__ == "__main__":
    sys.exit(main())
