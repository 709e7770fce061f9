"""AgGemm's schedule on CPU ranks (host pool): the same protocol as on CUDA, with a thread as comm stream."""

from __future__ import annotations

import threading

__all__ = ["run_host"]


def run_host(op, a_shard, w, a, out, lead=None) -> None:
    """AgGemm on the host pool: the comm side is a thread that waits for each owner's ready flag and pulls
    its rows; the caller's thread runs `lead` and the consumer GEMMs (torch.mm), each waiting for its rows."""
    m = a.shape[0]
    chunks = op.chunks(m)
    ready = [threading.Event() for _ in range(len(chunks) + 1)]  # + 1: every chunk has arrived
    failure: list[BaseException] = []
    op._publish(a_shard, a)

    def comm() -> None:
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
    if failure:
        raise failure[0]
