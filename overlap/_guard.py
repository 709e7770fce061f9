"""Serialises the calls of one op context: ops are collective, so every rank must issue them in one order.

* Two host threads calling the same op at once would interleave epochs differently on different ranks:
  the second caller is refused with a clear error (never silently serialised).
* On CUDA, a call issued on another stream than the previous call first waits for the previous call to
  finish on the device (its buffers are reused two calls later), so switching streams is supported.
"""

from __future__ import annotations

import threading

import torch

from ._validate import OpInputError

__all__ = ["CallGuard"]


class CallGuard:
    def __init__(self, name: str, device: torch.device):
        self.name = name
        self._lock = threading.Lock()
        self._cuda = device.type == "cuda"
        self._done = torch.cuda.Event() if self._cuda else None
        self._last_stream = None

    def __enter__(self) -> "CallGuard":
        if not self._lock.acquire(blocking=False):
            raise OpInputError(f"{self.name} is already running on another thread; op calls are collective "
                               f"and must be issued in one order on every rank (use one thread per op)")
        if self._cuda:
            stream = torch.cuda.current_stream()
            # Inside a CUDA-graph capture an event recorded outside it cannot be waited on; capture on the
            # stream the op was warmed up on (or after a synchronize).
            capturing = torch.cuda.is_current_stream_capturing()
            if self._last_stream is not None and stream != self._last_stream and not capturing:
                stream.wait_event(self._done)
            self._last_stream = stream
        return self

    def busy(self) -> bool:
        """A call of this op is in flight (on some thread)."""
        return self._lock.locked()

    def __exit__(self, *exc) -> None:
        try:
            if self._cuda:
                self._done.record(torch.cuda.current_stream())
        finally:
            self._lock.release()
