"""The GPU scripts (tests/gpu/, never run by CI) import only names that exist: every `from tp_overlap... import
name` in them, at module level or inside a function, resolves on CPU. A module the packages renamed or a helper
they moved would otherwise surface only on the GPU machine."""

import ast
import importlib
from pathlib import Path

import pytest

GPU_SCRIPTS = sorted((Path(__file__).resolve().parents[1] / "gpu").glob("*.py"))


def _imports(path: Path) -> list[tuple[int, str, str]]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("tp_overlap"):
            found += [(node.lineno, node.module, alias.name) for alias in node.names]
    return found


@pytest.mark.parametrize("path", GPU_SCRIPTS, ids=lambda p: p.name)
def test_every_name_a_gpu_script_imports_from_the_packages_exists(path):
    missing = []
    for line, module, name in _imports(path):
        try:
            owner = importlib.import_module(module)
        except ImportError as exc:
            missing.append(f"{path.name}:{line}: {module} ({exc})")
            continue
        if not hasattr(owner, name):
            try:
                importlib.import_module(f"{module}.{name}")   # a submodule
            except ImportError:
                missing.append(f"{path.name}:{line}: {module}.{name}")
    assert not missing, missing
