"""AgGemm's schedule on CPU ranks (host pool): the same protocol as on CUDA, with a thread as comm stream."""

from __future__ import annotations

import threading
import time

__all__ = ["run_host"]


def run_host(op, a_shard, w, a, out, lead=None) -> None:
    """AgGemm on the host pool: the comm side is a thread that waits for each owner's ready flag and pulls
    its rows; the caller's thread runs `lead` and the consumer GEMMs (torch.mm), each waiting for its rows."""
    m = a.shape[0]
    chunks = op.chunks(m)
    ready = [threading.Event() for _ in range(len(chunks) + 1)]  # + 1: every chunk has arrived
    failure: list[BaseException] = []
    trace = op._trace  # host clock marks: call start, comm start, comm end, call end (as the CUDA events)
    if trace:
        trace[0] = time.perf_counter()
    op._publish(a_shard, a)

    def comm() -> None:
        if trace:
            trace[1] = time.perf_counter()
        try:
            waited = set()
            for i, chunk in enumerate(chunks):
                owner = chunk[0]
                if owner != op.rank and owner not in waited:
                    op.pool.wait(f"{op.name}.a", owner, op._epoch, peer=owner, op=op.name)
                    waited.add(owner)
                if owner != op.rank:
                    op._pull(chunk, a, host=True)
                ready[i].set()
            if trace:
                trace[2] = time.perf_counter()
            ready[-1].set()
        except BaseException as exc:  # surfaced on the caller's thread
            failure.append(exc)
            for event in ready:
                event.set()

    def wait(i: int) -> None:
        ready[i].wait()
        if failure:
            raise failure[0]

    thread = threading.Thread(target=comm, name=f"{op.name}-comm", daemon=True)
    thread.start()
    try:
        if lead is not None:
            lead()
        if w is not None:
            op._consume(op.consumer_gemms(m, whole=lead is not None), a_shard, a, w, out, wait)
    finally:
        thread.join()
    if trace:
        trace[3] = time.perf_counter()
    if failure:
        raise failure[0]
