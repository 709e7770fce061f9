"""Benchmark variants as CUDA-graph replays: what each one costs the GPU once the host is out of the way.

Every variant is warmed up and captured on one side stream, in the same order on every rank (collectives
inside are captured too), and replaced by its graph's `replay`. A variant whose capture fails on any rank
is dropped on every rank, with the reason printed.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist

from tp_overlap.launch.measure.timing import progress

WARMUP_CALLS = 3  # on the capture stream, so that every kernel is compiled before the capture


def graph_variants(variants: dict[str, Callable[[], object]], *, group, rank: int) -> dict[str, Callable]:
    """{name: graph.replay} for every variant that could be captured; the graphs stay alive with them."""
    side = torch.cuda.Stream()
    replays = {}
    for name, fn in variants.items():
        problem = None
        try:
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(WARMUP_CALLS):
                    fn()
            torch.cuda.synchronize()
            dist.barrier(group=group)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=side):
                fn()
            torch.cuda.synchronize()
            replays[name] = graph.replay
        except Exception as exc:
            problem = f"{type(exc).__name__}: {str(exc)[:160]}"
        found = [None] * dist.get_world_size(group)
        dist.all_gather_object(found, problem, group=group)
        if any(found):
            replays.pop(name, None)
            progress(f"{name}: not captured, dropped ({next(p for p in found if p)})", rank=rank)
    return replays
