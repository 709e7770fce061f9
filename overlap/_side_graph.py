"""Eager calls with fewer host calls: the prologue and side lanes of a program replayed as one CUDA graph.

A program's compute prologue (the publish: its waits, the copy into the pool slot, the ready signals) and
its side lanes (the pulls and their signals) are a dozen stream operations that depend only on the op, M
and the pointers of the call's input. Recorded once into a CUDA graph from the very same steps, an eager
call issues them with one replay (~4 us of host time) instead of a dozen calls; the consumer's GEMMs stay
eager (their output is a fresh tensor every call) and wait for the replay's external events. The stream
operations are the same either way, so the protocol is too.

Only programs whose side lanes wait for nothing but the prologue and each other qualify (the AllGather's;
a GEMM+RS program's pushes wait for the compute stream's GEMMs, which would be an event from outside the
graph). A graph is keyed by the data pointers of the call tensors that the recorded steps read, recorded on
the second call with a key and replayed from the third; at most MAX_GRAPHS per program are kept.
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from .schedule import COMPUTE, CallContext, CudaDriver, Program

__all__ = ["SideGraphs", "graphable"]

MAX_GRAPHS = 4


def graphable(program: Program) -> bool:
    """Side lanes wait only for events recorded in the prologue or on side lanes, and every compute step
    after the prologue is a consumer step (`after` or `run`)."""
    steps = program.steps
    first_side = next((i for i, s in enumerate(steps) if s.lane != COMPUTE), None)
    if first_side is None:
        return False
    recorded_early = {s.args[0] for s in steps[:first_side] if s.kind == "record"}
    recorded_side = {s.args[0] for s in steps if s.kind == "record" and s.lane != COMPUTE}
    for step in steps[first_side:]:
        if step.lane == COMPUTE and step.kind not in ("after", "run"):
            return False
        if step.lane != COMPUTE and step.kind == "after" and step.args[0] not in recorded_early | recorded_side:
            return False
    return True


class SideGraphs:
    def __init__(self, program: Program, streams: dict, *, priority: int):
        # the same steps with external events, so that records inside the graph are visible outside it
        self.driver = CudaDriver(program, streams, external_events=True)
        self.stream = torch.cuda.Stream(priority=priority)
        self.fork, self.done = torch.cuda.Event(), torch.cuda.Event()
        self.prologue_done = torch.cuda.Event(external=True)
        steps = program.steps
        first_side = next(i for i, s in enumerate(steps) if s.lane != COMPUTE)
        self.num_prologue_items = self.driver.count_items(steps[:first_side])
        self.graphs: OrderedDict = OrderedDict()
        self.seen: set = set()

    def run(self, ctx: CallContext, key) -> bool:
        """Run the call with a replay if one is (or can now be) recorded for `key`; False: run it eagerly."""
        graph = self.graphs.get(key)
        if graph is None:
            if key not in self.seen:
                self.seen.add(key)
                return False
            graph = self._record(ctx)
            self.graphs[key] = graph
            if len(self.graphs) > MAX_GRAPHS:
                self.graphs.popitem(last=False)
        self.graphs.move_to_end(key)
        compute = torch.cuda.current_stream()
        self.fork.record(compute)
        self.stream.wait_event(self.fork)
        with torch.cuda.stream(self.stream):
            graph.replay()
        self.done.record(self.stream)
        compute.wait_event(self.prologue_done)
        self.driver.run_items(ctx, compute, first=self.num_prologue_items, lanes=(COMPUTE,))
        compute.wait_event(self.done)
        return True

    def _record(self, ctx: CallContext) -> torch.cuda.CUDAGraph:
        graph = torch.cuda.CUDAGraph()
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            graph.capture_begin(capture_error_mode="thread_local")
            try:
                self.driver.run_items(ctx, self.stream, last=self.num_prologue_items)
                self.prologue_done.record(self.stream)
                self.driver.run_items(ctx, self.stream, first=self.num_prologue_items, skip_lanes=(COMPUTE,),
                                      join=True)
            finally:
                graph.capture_end()
        return graph
