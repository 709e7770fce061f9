"""The GEMM launchers' scratch buffers: one cache, per stream, for every launcher that needs one.

A split-K GEMM (`splitk.py`), a stream-K GEMM (`launch.py`) and the Gluon GEMM's split tail (`gluon_launch.py`)
need an fp32 workspace for partial tiles and int32 counters that every launch leaves at zero. They are
allocated on the first launch of a (stream, key) and reused by every later one: no allocation per call, and
a CUDA graph captured after a warm-up keeps using the same buffers. They are private to a stream, since two
GEMMs running at once must not share counters. `release_workspaces()` forgets them (a sweep over many
shapes; never while a captured graph still uses them).
"""

from __future__ import annotations

import torch

_workspaces: dict[tuple, list[tuple[torch.Tensor, torch.Tensor]]] = {}   # every pair allocated, newest last


def stream_buffers(device: torch.device, key: tuple, workspace_elements: int,
                   counter_words: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp32 workspace of any contents, int32 counters at zero) of at least these sizes for `key` on the current
    stream. A request larger than the buffers held allocates new ones of twice the old size at least (the old
    ones stay held: a CUDA graph captured with them may still replay), so shapes that vary cost a few
    allocations, not one per shape. Callers that share a key must leave the counters at zero."""
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    full_key = (device, stream) + key
    held = _workspaces.get(full_key)
    if held is None or held[-1][0].numel() < workspace_elements or held[-1][1].numel() < counter_words:
        grown = (0, 0) if held is None else (2 * held[-1][0].numel(), 2 * held[-1][1].numel())
        buffers = (torch.empty(max(workspace_elements, grown[0]), dtype=torch.float32, device=device),
                   torch.zeros(max(counter_words, grown[1]), dtype=torch.int32, device=device))
        _workspaces[full_key] = (held or []) + [buffers]
    return _workspaces[full_key][-1]


def release_workspaces() -> None:
    """Forget every launcher's buffers (the caching allocator reuses the memory once no launch holds it):
    never while a CUDA graph captured with them may still replay."""
    _workspaces.clear()
