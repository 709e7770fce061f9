"""Refuse to run on a mixed installation. The project's six top-level packages have generic import names
that other PyPI projects use too (`kernels`, `launch`, `configs`, `ipc`, `overlap`); installed side by side,
pip writes both projects' files into one folder, and on `sys.path` the first one found wins. Rather than
fail later on a missing attribute, `import overlap` checks once (stdlib only, before torch is imported)
that every one of the six names resolves to this project's package, and that no other installed
distribution claims one of them."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

NAMES = ("overlap", "symm_mem", "ipc", "kernels", "launch", "configs")
PROJECT = "tp-overlap"
MARKER = f'__project__ = "{PROJECT}"'
_FIX = (f"install {PROJECT} in a virtualenv of its own (pip cannot keep two projects' files apart when they "
        f"share an import name), or run it from its checkout with the checkout first on PYTHONPATH")


def check_import_names() -> None:
    """Raise ImportError naming the conflict when a top-level name of ours is another project's."""
    home = Path(__file__).resolve().parent.parent
    for name in NAMES:
        init = _init_file(name)
        if init is None or init.parent.parent != home or MARKER not in init.read_text(errors="replace"):
            where = init if init is not None else "nowhere on sys.path"
            raise ImportError(f"{PROJECT}: the package {name!r} found first on sys.path is not {PROJECT}'s "
                              f"(it is at {where}; ours should be in {home}); {_FIX}")
    if home.name in ("site-packages", "dist-packages"):
        others = _other_distributions(home)
        if others:
            listed = ", ".join(f"{dist!r} ({', '.join(sorted(names))})" for dist, names in sorted(others.items()))
            raise ImportError(f"{PROJECT}: other installed distributions use the same top-level import names: "
                              f"{listed}; their files and ours are mixed in {home}; {_FIX}")


def _init_file(name: str) -> Path | None:
    module = sys.modules.get(name)
    spec = module.__spec__ if module is not None else importlib.util.find_spec(name)
    origin = getattr(spec, "origin", None)
    return Path(origin).resolve() if origin and origin.endswith("__init__.py") else None


def _other_distributions(site: Path) -> dict[str, set[str]]:
    """{distribution: our names it installs} over the .dist-info folders next to our packages."""
    found: dict[str, set[str]] = {}
    for info in site.glob("*.dist-info"):
        dist = info.name.split("-")[0].replace("_", "-").lower()
        if dist == PROJECT:
            continue
        top = info / "top_level.txt"
        if top.is_file():
            names = set(top.read_text().split())
        elif (info / "RECORD").is_file():
            names = {line.split("/", 1)[0] for line in (info / "RECORD").read_text().splitlines() if "/" in line}
        else:
            continue
        clash = names.intersection(NAMES)
        if clash:
            found[dist] = clash
    return found
