"""Undo what Triton's interpreter leaves patched in `triton.language`, between tests of one process.

Triton's interpreter swaps the language's builtins (`tl.core.add`, `tl.range`, the tensor operators, ...)
for numpy versions while an interpreted kernel runs. A kernel launch restores what it swapped, but a device
function called from inside it (`tl.cdiv`, `tl.sum`: `InterpretedFunction.__call__`, Triton 3.7) swaps the
builtins of the modules *it* sees and never restores them: after any interpreted kernel that calls one,
`triton.language.core` keeps the interpreter's builtins for the rest of the process. A later real compile
in that process (the Gluon compile tests, for sm_90, without a GPU) then generates code through numpy
semantics and fails ("'block_argument' object has no attribute 'dtype'" in `gl.cdiv`) -- but only when the
compile misses Triton's on-disk cache (a fresh clone, a changed kernel): hence a test that failed now and
then, and only after others in the same process.
"""

from __future__ import annotations

import sys

_MISSING = object()


def _objects() -> tuple:
    """What the interpreter patches: the language modules, their math module and the classes it swaps
    members of."""
    tl = sys.modules.get("triton.language")
    if tl is None:
        return ()
    core = tl.core
    return (tl, core, tl.math, core.tensor, core.dtype, core.tensor_descriptor_base)


def snapshot() -> list:
    """The current members of every patched object (take it before any interpreted kernel ran)."""
    return [(obj, dict(vars(obj))) for obj in _objects()]


def restore(saved: list) -> list[str]:
    """Put back every member that differs from `saved` and remove the members the interpreter added to the
    classes (`tensor.__repr__`, which shadowed the inherited one); the names restored."""
    restored = []
    for obj, members in saved:
        current = vars(obj)
        for name, value in members.items():
            if current.get(name, _MISSING) is not value:
                setattr(obj, name, value)
                restored.append(f"{getattr(obj, '__name__', obj)}.{name}")
        if isinstance(obj, type):  # (a module may gain members legitimately: a submodule imported later)
            for name in [n for n in current if n not in members and n != "__annotations__"]:
                delattr(obj, name)
                restored.append(f"{obj.__name__}.{name}")
    return restored
