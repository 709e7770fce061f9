"""Our six top-level packages have import names other PyPI projects use too (`kernels`, `launch`, `configs`,
`ipc`, `overlap`). Installed next to such a project in one environment, pip mixes the two projects' files in
one folder; `import overlap` must then refuse at once, naming the other distribution, whichever was
installed last. Alone, the same wheel imports and runs. Real installs: our wheel built from this checkout,
a stand-in project that installs `kernels`, fresh virtualenvs."""

import importlib.util
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
OTHER = "other-kernels"


@pytest.fixture(scope="module")
def wheels(tmp_path_factory):
    out = tmp_path_factory.mktemp("wheels")
    source = tmp_path_factory.mktemp("source")  # a copy: a build writes build/ and *.egg-info where it runs
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    for package in ("overlap", "symm_mem", "ipc", "kernels", "launch", "configs"):
        shutil.copytree(ROOT / package, source / package, ignore=shutil.ignore_patterns("__pycache__"))
    build = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(out), str(source)]
    if importlib.util.find_spec("setuptools"):  # else pip fetches the build backend itself
        build.insert(5, "--no-build-isolation")
    subprocess.run(build, check=True, timeout=600, capture_output=True)
    ours = next(out.glob("tp_overlap-*.whl"))
    return ours, _other_wheel(out)


def _other_wheel(folder: Path) -> Path:
    """A minimal wheel of another project whose top-level package is `kernels` (as Hugging Face's is)."""
    path = folder / "other_kernels-1.0-py3-none-any.whl"
    files = {"kernels/__init__.py": 'WHO = "other-kernels"\n',
             "other_kernels-1.0.dist-info/METADATA": "Metadata-Version: 2.1\nName: other-kernels\nVersion: 1.0\n",
             "other_kernels-1.0.dist-info/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
                                                  "Tag: py3-none-any\n",
             "other_kernels-1.0.dist-info/top_level.txt": "kernels\n"}
    record = "".join(f"{name},,\n" for name in files) + "other_kernels-1.0.dist-info/RECORD,,\n"
    with zipfile.ZipFile(path, "w") as archive:
        for name, text in files.items():
            archive.writestr(name, text)
        archive.writestr("other_kernels-1.0.dist-info/RECORD", record)
    return path


def _venv(tmp_path: Path, *wheels_in_order: Path) -> Path:
    env = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env)], check=True, timeout=120)
    python = env / "bin" / "python"
    for wheel in wheels_in_order:
        subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps",
                        "--no-index", str(wheel)], check=True, timeout=300, capture_output=True)
    return python


def _run(python: Path, code: str) -> subprocess.CompletedProcess:
    # torch and the other dependencies from this environment; our packages only from the fresh one
    deps = sysconfig.get_paths()["purelib"]
    return subprocess.run([str(python), "-c", code], capture_output=True, text=True, timeout=300, cwd="/",
                          env={"PYTHONPATH": deps, "PATH": "/usr/bin:/bin", "TRITON_INTERPRET": "1"})


def test_alone_our_wheel_imports_and_runs(wheels, tmp_path):
    python = _venv(tmp_path, wheels[0])
    done = _run(python, "import overlap, kernels.gemm, launch.tp_mlp; print(overlap.__file__, len(overlap.__all__))")
    assert done.returncode == 0, done.stderr[-2000:]
    assert str(tmp_path / "venv") in done.stdout and done.stdout.split()[-1] == "25"


@pytest.mark.parametrize("order", ["ours_first", "theirs_first"])
def test_next_to_another_kernels_package_import_overlap_refuses_and_names_it(wheels, tmp_path, order):
    ours, theirs = wheels
    python = _venv(tmp_path, *((ours, theirs) if order == "ours_first" else (theirs, ours)))
    done = _run(python, "import overlap")
    assert done.returncode != 0
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: tp-overlap:") and "virtualenv of its own" in last, last
    if order == "ours_first":  # theirs overwrote our kernels/__init__.py: we say whose `kernels` was found
        assert "'kernels'" in last and "is not tp-overlap's" in last
    else:                      # ours overwrote theirs: we name the other distribution
        assert f"'{OTHER}' (kernels)" in last
