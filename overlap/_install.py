"""Where the project's packages are found, from an install and from a checkout (standard library only: this
runs before torch is imported).

Every import name of the project lives under `tp_overlap`: the folder `overlap/` is `tp_overlap`, and the
other top-level folders (`kernels/`, `symm_mem/`, `ipc/`, `launch/`, `configs/`) are its subpackages
`tp_overlap.kernels`, ... . Their generic names are other projects' import names too (`kernels` is Hugging
Face's, which `transformers` needs), so those folders carry no `__init__.py`: when a checkout's root is on
`sys.path` (any `python -m ...` run from it), a plain `import kernels` passes over them as namespace portions
and finds the installed distribution. In a checkout they are not inside `overlap/`, so `tp_overlap` adds the
checkout's root to its own `__path__`; a wheel installs them inside `tp_overlap/`."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import sys
from pathlib import Path

PACKAGE = "tp_overlap"
SUBPACKAGES = ("kernels", "symm_mem", "ipc", "launch", "configs")


def checkout_root(init_file: str) -> Path | None:
    """The checkout whose `overlap/__init__.py` this is, or None for an installed copy."""
    root = Path(init_file).resolve().parent.parent
    is_checkout = (root / "pyproject.toml").is_file() and all((root / name).is_dir() for name in SUBPACKAGES)
    return root if is_checkout else None


def defer_to_other_overlap(name: str, init_file: str) -> None:
    """`overlap/` was imported as `overlap` (the checkout's root is on sys.path): hand the name to another
    distribution's `overlap` if one is installed, else refuse, naming the right import."""
    root = Path(init_file).resolve().parent.parent
    path = [entry for entry in sys.path if _resolved(entry) != root]
    spec = importlib.machinery.PathFinder.find_spec(name, path)
    if spec is None or spec.loader is None:
        del sys.modules[name]
        raise ModuleNotFoundError(f"No module named {name!r} (the folder {root / name} of the tp-overlap "
                                  f"checkout is the package {PACKAGE!r}: `import {PACKAGE}`)", name=name)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # the import statement returns what sys.modules holds once this file has run
    spec.loader.exec_module(module)


def _resolved(entry: str) -> Path:
    try:
        return Path(entry or ".").resolve()
    except OSError:
        return Path(entry)
