"""The training loop of `tp_overlap.launch.train`: variants stepped side by side, interleaved step by step on
the same batches, each step timed (CUDA events on GPU, the host clock on CPU); then per-variant tokens/s and
the loss curves compared.

A variant that may fail (async-TP: the compiler) is dropped on every rank together: after each of its steps
the ranks agree (MAX over the group) on whether any of them failed, so no rank is left waiting in a
collective the others never enter. That covers a failure every rank meets at the same point (a compile
error) and one rank's failure after the step's collectives; a rank failing before a collective its peers
enter leaves them waiting there, and the process group's timeout ends the run.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn

from .timing import barrier, progress

__all__ = ["Variant", "any_rank", "make_batch", "run_steps", "gather_step_times", "loss_differences", "summarize"]


@dataclass
class Variant:
    """One model in the race: what to call, its optimizer, and what the run recorded for it."""
    name: str
    model: nn.Module | None               # None once a failed variant is dropped
    optimizer: torch.optim.Optimizer | None
    may_fail: bool = False                        # a failure is recorded and the run goes on without it
    after_step: Callable[[], None] | None = None  # e.g. ours' check of the device error word (not timed)
    close: Callable[[], None] | None = None
    losses: list[float] = field(default_factory=list)
    times_ms: list[float] = field(default_factory=list)
    error: str | None = None
    info: dict = field(default_factory=dict)


def make_batch(step: int, *, seed: int, batch: int, seq: int, vocab: int, device: torch.device) -> torch.Tensor:
    """Random token ids [batch, seq] of a step: drawn on the host from (seed, step), the same on every rank."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
    return torch.randint(0, vocab, (batch, seq), generator=gen).to(device)


def _train_step(variant: Variant, ids: torch.Tensor) -> torch.Tensor:
    variant.optimizer.zero_grad(set_to_none=True)
    loss = variant.model(input_ids=ids, labels=ids).loss
    loss.backward()
    variant.optimizer.step()
    return loss.detach()


def _timed_step(variant: Variant, ids: torch.Tensor, device: torch.device) -> tuple[float, float]:
    """(loss, ms) of one training step: CUDA events around it on GPU, the host clock on CPU."""
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        loss = _train_step(variant, ids)
        end.record()
        end.synchronize()
        return loss.item(), start.elapsed_time(end)
    start = time.perf_counter()
    loss = _train_step(variant, ids)
    return loss.item(), (time.perf_counter() - start) * 1e3


def any_rank(flag: bool, group: dist.ProcessGroup, device: torch.device) -> bool:
    """Whether `flag` holds on any rank of the group (a collective: every rank calls it)."""
    value = torch.tensor([1.0 if flag else 0.0], device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX, group=group)
    return bool(value.item())


def _step_variant(variant: Variant, ids, *, group, device) -> None:
    """One step of `variant`, recorded; a failure of a `may_fail` variant, agreed over the group, drops it."""
    error = None
    try:
        loss, ms = _timed_step(variant, ids, device)
    except Exception as exc:  # noqa: BLE001 - recorded in the results; only may_fail variants get here
        if not variant.may_fail:
            raise
        error = f"{type(exc).__name__}: {' '.join(str(exc).split())[:2000]}"
    if variant.may_fail and any_rank(error is not None, group, device):
        variant.error = error or "failed on another rank of the group (that rank's error is in its log)"
        variant.model = variant.optimizer = None   # its memory goes back to the variants that go on
        return
    variant.losses.append(loss)
    variant.times_ms.append(ms)
    if variant.after_step is not None:
        variant.after_step()


def run_steps(variants: list[Variant], *, steps: int, batch_of: Callable[[int], torch.Tensor],
              group: dist.ProcessGroup, device: torch.device, rank: int) -> None:
    """`steps` training steps of every variant, interleaved: the order rotates each step (clocks drift), the
    ranks meet before each variant's step; rank 0 prints one progress line per step."""
    for step in range(steps):
        ids = batch_of(step)
        live = [v for v in variants if v.error is None]
        shift = step % max(1, len(live))
        for variant in live[shift:] + live[:shift]:
            barrier(group, device)
            _step_variant(variant, ids, group=group, device=device)
            if variant.error is not None:
                progress(f"train: {variant.name} failed at step {step + 1} and is dropped: {variant.error[:300]}",
                         rank=rank)
        parts = [f"{v.name} loss {v.losses[-1]:.5f} ({v.times_ms[-1]:.1f} ms)" for v in variants
                 if v.error is None and len(v.losses) == step + 1]
        progress(f"train: step {step + 1}/{steps}: " + ", ".join(parts), rank=rank)


def gather_step_times(variants: list[Variant], *, group: dist.ProcessGroup, device: torch.device) -> None:
    """Replace each variant's per-step times by their max over the ranks (a step ends when its slowest rank
    does). Every rank holds the same number of steps of each variant: failures were agreed."""
    flat = [ms for v in variants for ms in v.times_ms]
    if not flat or dist.get_world_size(group) == 1:
        return
    table = torch.tensor(flat, dtype=torch.float64, device=device)
    dist.all_reduce(table, op=dist.ReduceOp.MAX, group=group)
    values = table.cpu().tolist()
    for v in variants:
        v.times_ms, values = values[:len(v.times_ms)], values[len(v.times_ms):]


def loss_differences(reference: Variant, other: Variant) -> dict:
    """max over the steps both ran of |loss_other - loss_ref| / |loss_ref|, and the step where it is."""
    pairs = list(zip(reference.losses, other.losses))
    if not pairs:
        return {"max_rel_diff": None, "at_step": None, "steps_compared": 0}
    diffs = [abs(b - a) / abs(a) if a else math.inf for a, b in pairs]
    worst = max(range(len(diffs)), key=diffs.__getitem__)
    return {"max_rel_diff": diffs[worst], "at_step": worst + 1, "steps_compared": len(pairs)}


def summarize(variant: Variant, *, warmup: int, tokens_per_step: int) -> dict:
    """The variant's results: status, median / min / max step time after the warm-up steps, tokens/s."""
    timed = variant.times_ms[warmup:]
    median = statistics.median(timed) if timed else None
    return {"status": "failed" if variant.error else "ok", "error": variant.error,
            "steps_run": len(variant.losses), "timed_steps": len(timed),
            "step_ms_median": median, "step_ms_min": min(timed) if timed else None,
            "step_ms_max": max(timed) if timed else None,
            "tokens_per_s": tokens_per_step / (median / 1e3) if median else None,
            "final_loss": variant.losses[-1] if variant.losses else None, **variant.info}
