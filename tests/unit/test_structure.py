"""The codebase's shape, checked from the source: one public surface, one exception root, no import cycles
(deferred imports included), imports that only point down the layers (LAYERS), no launcher importing
another, no private cross-package imports, private modules that export nothing, and files and functions a
reader can take in at once."""

import ast
import importlib
import pkgutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = ("overlap", "symm_mem", "ipc", "kernels", "launch", "configs")
SUBPACKAGES = ("symm_mem", "ipc", "kernels", "launch", "configs")   # tp_overlap.<folder>
MAX_FILE_LINES, MAX_FUNCTION_LINES = 400, 60
# The parts of the project from the top down: a module imports its own part and the parts below it, never one
# above (deferred imports included). The entry points of launch/ (`tp_overlap.launch.<name>`) sit on top and
# share what is in launch/measure, launch/cli and launch/output; `tp_overlap` is the user surface
# (overlap/__init__.py) over its subpackages; kernels/ imports nothing of ours.
LAYERS = ("tp_overlap.launch", "tp_overlap.launch.measure", "tp_overlap.launch.cli", "tp_overlap.launch.output",
          "tp_overlap", "tp_overlap.model", "tp_overlap.ops", "tp_overlap.offload", "tp_overlap.config",
          "tp_overlap.gemm", "tp_overlap.symm_mem", "tp_overlap.ipc", "tp_overlap.kernels")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    parts = ["tp_overlap", *parts[1:]] if parts[0] == "overlap" else ["tp_overlap", *parts]
    return ".".join(parts).removesuffix(".__init__")


def _modules() -> dict[str, Path]:
    return {_module_name(path): path for folder in FOLDERS for path in sorted((ROOT / folder).rglob("*.py"))}


def _package(module: str) -> str:
    """The top-level folder a module lives in, by import name: `tp_overlap.kernels`, ... or `tp_overlap`
    (overlap/)."""
    parts = module.split(".")
    return f"tp_overlap.{parts[1]}" if len(parts) > 1 and parts[1] in SUBPACKAGES else "tp_overlap"


MODULES = _modules()


def _is_private(module: str) -> bool:
    return any(part.startswith("_") for part in module.split(".")[1:])


def _imports(module: str, path: Path) -> set[str]:
    """Project modules imported anywhere in `module` (function-level imports too); `from pkg import mod`
    counts as importing pkg.mod, not pkg."""
    is_package = path.name == "__init__.py"
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".") if is_package else module.split(".")[:-1]
                base = base[:len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module
            subs = {f"{target}.{alias.name}" for alias in node.names} & MODULES.keys()
            found |= subs if len(subs) == len(node.names) else {target} | subs
    return {name for name in found if name in MODULES and name != module}


def test_the_user_surface_is_one_import_of_at_most_26_names():
    import tp_overlap as overlap
    assert len(overlap.__all__) <= 26
    assert len(set(overlap.__all__)) == len(overlap.__all__)
    for name in overlap.__all__:
        assert getattr(overlap, name) is not None, name
    for name in ("AgGemm", "GemmRs", "TPMLP", "SymmetricPool", "pool_requirements", "OverlapConfig", "load_preset",
                 "OverlapError", "enable_offload"):
        assert name in overlap.__all__


def test_every_exception_of_the_project_derives_from_the_one_root():
    from tp_overlap.ipc.errors import OverlapError
    seen = []
    for folder in FOLDERS:
        prefix = "tp_overlap." if folder == "overlap" else f"tp_overlap.{folder}."
        for info in pkgutil.walk_packages([str(ROOT / folder)], prefix=prefix):
            module = importlib.import_module(info.name)
            for obj in vars(module).values():
                if isinstance(obj, type) and issubclass(obj, BaseException) and obj.__module__ == info.name:
                    seen.append(obj)
                    assert issubclass(obj, OverlapError), f"{info.name}.{obj.__name__} does not derive from OverlapError"
    assert len(seen) >= 20  # the walk really found the project's exceptions


def test_no_import_cycles_deferred_imports_included():
    graph = {name: _imports(name, path) for name, path in MODULES.items()}
    index, low, stack, on_stack, cycles = {}, {}, [], set(), []

    def visit(v):  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    assert cycles == []


def _layer(module: str) -> str:
    """The LAYERS part a module belongs to: the longest one its name starts with."""
    return max((part for part in LAYERS if module == part or module.startswith(part + ".")), key=len)


def _import_edges():
    return [(name, target) for name, path in MODULES.items() for target in sorted(_imports(name, path))]


def test_every_module_belongs_to_a_layer():
    assert all(_layer(name) for name in MODULES)
    assert {_layer(name) for name in MODULES} == set(LAYERS), "a layer without modules: LAYERS is stale"


def test_imports_point_down_the_layers_only():
    rank = {part: i for i, part in enumerate(LAYERS)}
    upward = [f"{name} -> {target}" for name, target in _import_edges()
              if rank[_layer(target)] < rank[_layer(name)]]
    assert upward == [], "an import from a lower part to a higher one (LAYERS)"


def test_kernels_import_nothing_of_ours_and_no_entry_point_imports_another():
    kernels = [f"{n} -> {t}" for n, t in _import_edges() if _layer(n) == "tp_overlap.kernels"
               and _layer(t) != "tp_overlap.kernels"]
    entries = [f"{n} -> {t}" for n, t in _import_edges()
               if _layer(n) == _layer(t) == "tp_overlap.launch"]
    assert kernels == [] and entries == [], (kernels, entries)


def test_no_package_imports_another_packages_private_modules():
    wrong = [f"{name} -> {target}" for name, path in MODULES.items() for target in _imports(name, path)
             if _package(target) != _package(name) and _is_private(target)]
    assert wrong == []


def test_private_modules_export_nothing():
    exporting = [name for name, path in MODULES.items() if _is_private(name)
                 and any(isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "__all__" for t in node.targets)
                         for node in ast.parse(path.read_text()).body)]
    assert exporting == []


def test_files_and_functions_are_short():
    long_files = [f"{name}: {n}" for name, path in MODULES.items()
                  if (n := len(path.read_text().splitlines())) > MAX_FILE_LINES]
    long_functions = []
    for name, path in MODULES.items():
        if name.startswith("tp_overlap.kernels."):  # Triton kernels may be longer: one kernel is one GPU program
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                if (n := node.end_lineno - node.lineno + 1) > MAX_FUNCTION_LINES:
                    long_functions.append(f"{name}.{node.name}: {n}")
    assert long_files == [] and long_functions == []


@pytest.mark.parametrize("folder", SUBPACKAGES)
def test_the_top_level_folders_other_than_overlap_are_namespace_portions(folder):
    # an __init__.py would make a checkout's root on sys.path shadow another project's `kernels`, `launch`, ...
    assert not (ROOT / folder / "__init__.py").exists()
    module = importlib.import_module(f"tp_overlap.{folder}")
    assert str(ROOT / folder) in list(module.__path__)
