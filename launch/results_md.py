"""Render results/README.md from the files in results/: per result of record, what was measured, on what
hardware, at which commit, with which command, its numbers and figures, and what it means; then the index of
the experiments not kept (each with the commit that held its code) and the logs the results cite.

    python -m tp_overlap.launch.results_md [--dir results] [--plots] [--headline]

The numbers, the hardware, the commit and the command come from each JSON; the words (what was measured,
what it means, figure captions, the index) from the folder's captions.yaml. `--plots` first draws every PNG
from the data next to it (launch/output/results_plots.py; needs matplotlib). `--headline` also prints the
README's table of headline results (launch/output/headline.py), rendered from the same files.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import yaml

from tp_overlap.launch.cli.common import ArgumentParser, require, run_launcher

from .output import results_tables as tables
from .output.results_tables import current_command

PROG = "tp_overlap.launch.results_md"
CAPTIONS = "captions.yaml"
NOT_KEPT = "Experiments not kept"
LOGS = "Logs (logs/)"
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


def _provenance(name: str, doc: dict) -> list[str]:
    date = f" · {doc['date'][:10]}" if doc.get("date") else ""
    lines = [f"`{name}` · {_on(doc)} · commit `{tables.short_commit(doc.get('commit'))}`{date}  "]
    if doc.get("command"):
        lines.append(f"Command: `{current_command(doc['command'])}`")
    else:
        lines.append(f"Command: none that runs from this checkout ({doc.get('command_note', 'not recorded')})")
    return lines


def _figure(png: str, caption: str | None) -> list[str]:
    return [f"![{png}]({png})", "", f"*{caption.strip()}*" if caption else f"*{png}*", ""]


def _stale(name: str, doc: dict, caption: dict) -> list[str]:
    written = str(caption.get("commit", ""))
    if written and not str(doc.get("commit", "")).startswith(written):
        return [f"(The text on `{name}` was written for the data of commit {written}; the file is from "
                f"{tables.short_commit(doc.get('commit'))}: check that it still holds.)", ""]
    return []


def _numbers(files: list[tuple[str, dict]]) -> list[str]:
    """The summaries and tables of a section's files: one table where they share one kind, else per file."""
    prefixes = {tables._prefix(name) for name, _ in files}
    if len(files) > 1 and len(prefixes) == 1 and "" not in prefixes:
        rows = [{"cuda_graphs": doc.get("cuda_graphs"), **r} for _, doc in files for r in doc.get("rows") or []]
        return [tables._table(rows, tables.COLUMNS[prefixes.pop()]), ""]
    parts = []
    for n, (name, doc) in enumerate(files):
        for i, block in enumerate(tables.file_tables(name, doc)):
            parts += [f"`{name}`: {block}" if len(files) > 1 and i == 0 and not block.startswith("|") else block, ""]
    return parts


def _section(directory: Path, name: str, caption: dict) -> list[str]:
    """One result of record: its file (and the files measured with it), what, the numbers, figures, meaning."""
    files = [(name, caption)] + list((caption.get("with") or {}).items())
    docs = [(n, json.loads((directory / n).read_text()), c) for n, c in files if (directory / n).is_file()]
    parts = [f"### {caption.get('title', name)}", ""]
    provenance = [line for n, doc, _ in docs for line in _provenance(n, doc)]
    parts += [line if line.endswith("  ") else line + "  " for line in provenance[:-1]] + provenance[-1:] + [""]
    for n, doc, c in docs:
        parts += _stale(n, doc, c)
    what = [(c.get("what") or "").strip() for _, _, c in docs]
    if any(what):
        extra = [f"`{n}`: {w}" for (n, _, _), w in zip(docs[1:], what[1:]) if w]
        parts += [f"**Measured.** {' '.join([what[0], *extra]).strip()}", ""]
    parts += _numbers([(n, doc) for n, doc, c in docs if c.get("table", True)])   # table: false -> words only
    figures = dict(caption.get("figures") or {})
    if (directory / f"{Path(name).stem}.png").is_file():
        figures.setdefault(f"{Path(name).stem}.png", None)
    for png, text in figures.items():
        parts += _figure(png, text)
    if caption.get("means"):
        parts += [f"**What it means.** {caption['means'].strip()}", ""]
    return parts


def _anchor(heading: str) -> str:
    keep = "".join(c for c in heading.lower() if c.isalnum() or c in " -_")
    return keep.replace(" ", "-")


def _groups(directory: Path, captions: dict) -> list[dict]:
    """The caption groups, plus one for the results files no caption names."""
    groups = [g for g in captions.get("groups", [])]
    named = {n for g in groups for name, c in g["files"].items() for n in [name, *((c or {}).get("with") or {})]}
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
    if not rows:
        return []
    return ["## Recorded commands that do not run from this checkout", "",
            "Each of these files keeps the command it ran as `command_recorded`; `command` is empty because what it "
            "ran is not in the repository. Every other file's command runs from a checkout.", "",
            tables.format_table(rows, ["file", "why", "recorded"]), ""]


def _not_kept(captions: dict) -> list[str]:
    about = captions.get("not_kept") or {}
    rows = [{"experiment": r["what"], "code": f"`{r['commit']}`", "data": r.get("data", "-")}
            for r in about.get("rows") or []]
    if not rows:
        return []
    return ["## " + NOT_KEPT, "", (about.get("about") or "").strip(), "",
            tables.format_table(rows, ["experiment", "code", "data"]), ""]


def _logs(directory: Path, captions: dict) -> list[str]:
    logs = directory / "logs"
    if not logs.is_dir():
        return []
    about = captions.get("logs", {})
    lines = [f"* `logs/{name}`: {text}" for name, text in (about.get("files") or {}).items()]
    lines += [f"* `logs/{p.name}`: {about.get('gpu_tests', 'the GPU test suite')} ({tables.suite_line(p)})."
              for p in sorted(logs.glob("gpu_tests_*.xml"))]
    return ["## " + LOGS, "", (about.get("about") or "").strip(), "", *lines, ""]


def render(directory: Path) -> str:
    captions_path = directory / CAPTIONS
    captions = yaml.safe_load(captions_path.read_text()) if captions_path.is_file() else {}
    groups = _groups(directory, captions)
    appendix = _undone_commands(directory) + _not_kept(captions) + _logs(directory, captions)
    extra = [line[3:] for line in appendix if line.startswith("## ")]
    parts = [HEADER, "", "# Results of record", "", (captions.get("intro") or "").strip(), "", "Contents:", ""]
    parts += [f"* [{h}](#{_anchor(h)})" for h in [g["heading"] for g in groups] + extra] + [""]
    for group in groups:
        parts += [f"## {group['heading']}", ""]
        if group.get("about"):
            parts += [group["about"].strip(), ""]
        for name, caption in group["files"].items():
            if (directory / name).is_file():
                parts += _section(directory, name, caption or {})
    parts += appendix
    return "\n".join(parts).rstrip() + "\n"


def make_parser() -> ArgumentParser:
    p = ArgumentParser(PROG, description=__doc__)
    p.add_argument("--dir", default="results", help="the results folder to render (its README.md is rewritten)")
    p.add_argument("--plots", action="store_true", help="redraw every PNG from its data first (needs matplotlib)")
    p.add_argument("--headline", action="store_true",
                   help="also print the README's headline table, rendered from the same files")
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
    if args.headline:
        from .output.headline import headline
        print(headline(directory))
    return 0


def main(argv=None) -> int:
    return run_launcher(PROG, parse_args, _run, argv)


if __name__ == "__main__":
    sys.exit(main())
