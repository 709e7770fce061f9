"""The README and docs/ against the code: the README's two commands are the CI's and pin versions inside
pyproject's bounds, every test they name exists, every launcher option their commands use exists, every env var
is documented, every file they link exists, the README stays short and its headline table is the rendering of
results/."""

import importlib
import re
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")  # Python >= 3.11

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
ARCHITECTURE = ROOT / "docs" / "ARCHITECTURE.md"
DOCS = ["README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))]


def _bash_lines(text: str) -> list[str]:
    blocks = re.findall(r"```bash\n(.*?)```", text, flags=re.S)
    joined = [b.replace("\\\n", " ") for b in blocks]
    return [line.strip() for b in joined for line in b.splitlines() if line.strip()]


def _two_commands() -> tuple[str, str]:
    commands = [line for line in _bash_lines(README) if line.startswith("python3 -m venv .venv")]
    (main_job,) = [c for c in commands if c.endswith("-m tp_overlap.launch.tp_mlp")]
    (tests,) = [c for c in commands if c.endswith("-m pytest -q")]
    return main_job, tests


def test_the_two_commands_share_the_install_and_ci_runs_the_test_command_as_written():
    main_job, tests = _two_commands()
    install = tests.rsplit(" && ", 1)[0]
    assert main_job.rsplit(" && ", 1)[0] == install
    assert 'pip install -q torch==2.13.0 triton==3.7.1 -e ".[test,hf]"' in install
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert tests in ci, "the CI must run the README's test command exactly"


def test_the_pins_are_inside_the_pyproject_bounds():
    from packaging.requirements import Requirement

    _, tests = _two_commands()
    pins = dict(re.findall(r"\b(torch|triton)==([\w.]+)", tests))
    deps = {Requirement(d).name: Requirement(d) for d in tomllib.loads((ROOT / "pyproject.toml").read_text())
            ["project"]["dependencies"]}
    for name, version in pins.items():
        assert deps[name].specifier.contains(version), (name, version, str(deps[name].specifier))
    # the versions of the GPU machine (torch 2.11 + Triton 3.6.0) are inside the bounds too
    assert deps["torch"].specifier.contains("2.11.0") and deps["triton"].specifier.contains("3.6.0")


def _referenced_tests(text: str) -> list[tuple[str, str | None]]:
    """(file, test name or None) for every `tests/...py[::name]` and every `::name` after a file in a line."""
    refs = []
    for line in text.splitlines():
        last = None
        for path, name, cont in re.findall(r"`(tests/[\w/]+\.py)(?:::([\w*]+))?[^`]*`|`::([\w*]+)[^`]*`", line):
            if path:
                last = path
                refs.append((path, name or None))
            elif last:
                refs.append((last, cont))
    return refs


@pytest.mark.parametrize("doc", DOCS)
def test_every_test_the_docs_name_exists(doc):
    refs = _referenced_tests((ROOT / doc).read_text())
    assert refs or doc != "README.md"
    for path, name in refs:
        source = ROOT / path
        assert source.is_file(), path
        if name:
            pattern = r"def " + name.replace("*", r"\w*") + r"\b"
            assert re.search(pattern, source.read_text()), f"{path}::{name} does not exist"


def test_every_launcher_option_in_the_readme_and_docs_exists():
    checked = 0
    for line in [line for doc in DOCS for line in _bash_lines((ROOT / doc).read_text())]:
        match = re.search(r"-m tp_overlap\.launch\.(\w+)(.*)", line)
        if not match:
            continue
        name, rest = match.groups()
        assert (ROOT / "launch" / f"{name}.py").is_file(), name
        module = importlib.import_module(f"tp_overlap.launch.{name}")
        if not hasattr(module, "make_parser"):
            continue
        known = {s for a in module.make_parser()._actions for s in a.option_strings}
        used = re.findall(r"(?<![\w-])(--[\w-]+)", rest.split("#")[0])
        unknown = [u for u in used if u not in known]
        assert not unknown, (line, unknown)
        assert "--m" not in used, line
        checked += 1
    assert checked >= 8


def test_every_env_var_is_documented_in_one_table_and_the_architecture_is_in_the_repo():
    names = set(re.findall(r"\"(OVERLAP_\w+)\"", (ROOT / "overlap" / "config" / "envs.py").read_text()))
    assert names
    configuration = (ROOT / "docs" / "CONFIGURATION.md").read_text()
    for name in names:
        assert f"| `{name}` |" in configuration, name
    assert "(docs/CONFIGURATION.md)" in README
    assert "../shared" not in README and "(docs/ARCHITECTURE.md)" in README and ARCHITECTURE.is_file()


@pytest.mark.parametrize("doc", DOCS)
def test_every_file_the_docs_link_or_name_exists(doc):
    text = (ROOT / doc).read_text()
    base = (ROOT / doc).parent
    links = [t for t in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text) if "://" not in t]
    missing = [t for t in links if not (base / t).exists()]
    folders = "docs|results|configs|tests|kernels|overlap|launch|symm_mem|ipc"
    named = re.findall(rf"(?<![\w/.])((?:{folders})/[\w./*<>{{}}-]*[\w*>}}])", text)
    missing += [t for t in named if not set("<*{") & set(t) and not (ROOT / t).exists()]
    assert not missing, missing


def test_the_readme_is_short_and_opens_with_what_it_is_the_two_commands_and_the_model_example():
    lines = README.splitlines()
    assert len(lines) <= 250, len(lines)
    headings = [line for line in lines if line.startswith("## ")]
    assert headings[:3] == ["## Words used here", "## The two commands", "## Use it in your model"], headings
    words = README[:README.index("## The two commands")]
    assert all(term in words for term in ("**TP, W, M.**", "sm_margin", "**E and k.**")), "terms defined first"


def test_the_readme_headline_table_is_the_rendering_of_the_results():
    from tp_overlap.launch.output.headline import headline
    table = headline(ROOT / "results")
    assert table.count("\n") >= 6
    assert table in README, "the README's table is stale: python -m tp_overlap.launch.results_md --headline"


def test_the_headline_rounds_a_minimum_down_never_up():
    from tp_overlap.launch.output.headline import _floor

    assert _floor(0.9378) == "0.93" and _floor(0.7789) == "0.77"   # "at least 0.94" would overstate 0.9378
    assert _floor(0.57) == "0.57" and _floor(0.29) == "0.29"       # exact values stay (0.57 * 100 < 57 in floats)
