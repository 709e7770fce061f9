"""Every import name of the project is under `tp_overlap`; the top-level folders other than overlap/ carry no
`__init__.py`, so nothing of ours shadows another distribution's `kernels` (Hugging Face's, which
`transformers` requires), `launch`, `configs`, ... — from an installed wheel and from a checkout whose root is
on sys.path (every `python -m ...` run from it). Real installs: our wheel built from this checkout, fresh
virtualenvs; the real `kernels` and `transformers` where this environment has them (the `hf` extra), else a
stand-in project that installs `kernels`."""

import importlib.util
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

from tests.multiproc import child_pythonpath

ROOT = Path(__file__).resolve().parents[2]
HAVE_TRANSFORMERS = importlib.util.find_spec("transformers") is not None
NO_TRANSFORMERS = "transformers is not installed here (pip install -e '.[hf]'): the real `kernels` is not checked"


@pytest.fixture(scope="module")
def wheels(tmp_path_factory):
    out = tmp_path_factory.mktemp("wheels")
    source = tmp_path_factory.mktemp("source")  # a copy: a build writes build/ and *.egg-info where it runs
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, source / name)
    for package in ("overlap", "symm_mem", "ipc", "kernels", "launch", "configs"):
        shutil.copytree(ROOT / package, source / package, ignore=shutil.ignore_patterns("__pycache__"))
    build = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(out), str(source)]
    if importlib.util.find_spec("setuptools"):  # else pip fetches the build backend itself
        build.insert(5, "--no-build-isolation")
    subprocess.run(build, check=True, timeout=600, capture_output=True)
    return next(out.glob("tp_overlap-*.whl")), _other_wheel(out)


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


def _run(python: Path, code: str, cwd: Path = Path("/")) -> subprocess.CompletedProcess:
    # torch and the other dependencies from this environment, after the fresh one's site-packages (its .pth
    # files, our editable install among them, are not read from PYTHONPATH); our packages only from the fresh one
    deps = sysconfig.get_paths()["purelib"]
    code = f"import sys; sys.path.append(sys.path.pop(sys.path.index({deps!r})))\n{code}"
    return subprocess.run([str(python), "-c", code], capture_output=True, text=True, timeout=300, cwd=cwd,
                          env={"PYTHONPATH": deps, "PATH": "/usr/bin:/bin", "TRITON_INTERPRET": "1"})


def test_the_wheel_says_its_license_and_authors_and_carries_the_license(wheels):
    with zipfile.ZipFile(wheels[0]) as archive:
        names = archive.namelist()
        metadata = archive.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    assert "License-Expression: MIT" in metadata and "Author: The tp-overlap developers" in metadata, metadata[:800]
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names), names


def test_alone_our_wheel_imports_and_runs(wheels, tmp_path):
    python = _venv(tmp_path, wheels[0])
    done = _run(python, "import tp_overlap, tp_overlap.kernels.gemm, tp_overlap.launch.tp_mlp\n"
                        "from tp_overlap.config.presets import load_preset\n"
                        "print(tp_overlap.__file__, len(tp_overlap.__all__), load_preset('cpu', world_size=2) is not None)")
    assert done.returncode == 0, done.stderr[-2000:]
    where, count, preset = done.stdout.split()
    assert where.startswith(str(tmp_path / "venv")) and int(count) >= 25 and preset == "True"


@pytest.mark.parametrize("order", ["ours_first", "theirs_first"])
def test_next_to_another_kernels_package_both_import(wheels, tmp_path, order):
    ours, theirs = wheels
    python = _venv(tmp_path, *((ours, theirs) if order == "ours_first" else (theirs, ours)))
    done = _run(python, "import kernels, tp_overlap, tp_overlap.kernels.gemm as ours\n"
                        "print(kernels.WHO, ours.__file__)")
    assert done.returncode == 0, done.stderr[-2000:]
    who, where = done.stdout.split()
    assert who == "other-kernels" and "/tp_overlap/kernels/gemm.py" in where


@pytest.mark.skipif(not HAVE_TRANSFORMERS, reason=NO_TRANSFORMERS)
def test_our_wheel_next_to_the_real_kernels_and_transformers(wheels, tmp_path):
    python = _venv(tmp_path, wheels[0])
    done = _run(python, "import tp_overlap\nfrom transformers import LlamaForCausalLM\nimport kernels\n"
                        "print(kernels.__file__)")
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().startswith(sysconfig.get_paths()["purelib"]), done.stdout


def _in_checkout(code: str, *args: str) -> subprocess.CompletedProcess:
    """`python -c code` (or `python -m ...`) from the checkout's root: the root is on sys.path."""
    argv = [sys.executable, *args] if args else [sys.executable, "-c", code]
    return subprocess.run(argv, capture_output=True, text=True, timeout=300, cwd=ROOT,
                          env={"PYTHONPATH": child_pythonpath(), "PATH": "/usr/bin:/bin", "TRITON_INTERPRET": "1"})


def test_from_the_checkout_root_our_folders_shadow_nothing():
    done = _in_checkout("import sys, kernels, launch, configs, ipc, symm_mem\n"
                        "import tp_overlap.kernels.gemm\n"
                        "for m in (kernels, launch, configs, ipc, symm_mem):\n"
                        "    assert getattr(m, '__file__', None) is None or 'site-packages' in m.__file__, m\n"
                        "print(sys.path[0] == '', tp_overlap.kernels.gemm.__file__)")
    assert done.returncode == 0, done.stderr[-2000:]
    first_is_cwd, where = done.stdout.split()
    assert first_is_cwd == "True" and where == str(ROOT / "kernels" / "gemm.py")


def test_from_the_checkout_root_import_overlap_names_the_package_to_import():
    done = _in_checkout("import overlap")
    assert done.returncode != 0
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("ModuleNotFoundError: No module named 'overlap'") and "`import tp_overlap`" in last


@pytest.mark.skipif(not HAVE_TRANSFORMERS, reason=NO_TRANSFORMERS)
def test_from_the_checkout_root_transformers_finds_the_real_kernels():
    done = _in_checkout("import tp_overlap\nfrom transformers import LlamaForCausalLM\nimport kernels\n"
                        "print(kernels.__file__)")
    assert done.returncode == 0, done.stderr[-2000:]
    assert not done.stdout.strip().startswith(str(ROOT / "kernels")), done.stdout
