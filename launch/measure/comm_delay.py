"""A test aid for the k-factor: a comm side slowed down only while the overlapped steps run."""

from __future__ import annotations

import threading
import time
from typing import Callable

import torch

def inject_comm_delay(comm_fn: Callable[[], object], *, delay_ms: float, active: threading.Event,
                      device: torch.device) -> Callable[[], object]:
    """Test aid: comm_fn slowed by `delay_ms` only while `active` is set (measure_pair sets it during the
    overlapped steps only), so k_comm rises and the solo times stay. CPU: a sleep on the comm thread;
    CUDA: a spin kernel on the comm stream ahead of the comm work."""
    cycles_per_ms = _cycles_per_ms(device) if device.type == "cuda" else 0.0

    def delayed():
        if active.is_set():
            if device.type == "cuda":
                torch.cuda._sleep(int(delay_ms * cycles_per_ms))
            else:
                time.sleep(delay_ms / 1e3)
        return comm_fn()
    return delayed


def _cycles_per_ms(device: torch.device) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(10_000_000)
    end.record()
    end.synchronize()
    return 10_000_000 / max(start.elapsed_time(end), 1e-3)
