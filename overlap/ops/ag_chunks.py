"""AgGemm's chunks: which rows arrive in which order (and which chunk flag each sets), and which GEMMs the
decomposed consumer runs over them.

Pure functions of (rank, world size, M, config): the CUDA and the host programs, the fused consumer's chunk
flags and the k-factor's compute alone all use the same chunks.
"""

from __future__ import annotations

import math
from typing import NamedTuple

from tp_overlap.kernels.constants import ag_chunk_rows

from .protocol import ring_order

__all__ = ["Chunk", "ConsumerGemm", "LEAD_ROW_ALIGN", "plan_chunks", "plan_consumer_gemms"]


LEAD_ROW_ALIGN = 128  # lead GEMM rows are rounded up to this (a cuBLAS-friendly row count)


class Chunk(NamedTuple):
    owner: int        # rank whose shard these rows are
    first_row: int    # in the gathered a
    num_rows: int
    flag_index: int   # owner-major: owner * chunks_per_rank + chunk within the owner


class ConsumerGemm(NamedTuple):
    first_row: int    # in the gathered a (and in out)
    num_rows: int
    wait: int         # index into chunks(m) of the chunk it waits for; len(chunks): all; -1: a_shard only


def plan_chunks(*, rank: int, world_size: int, m: int, chunks_per_rank: int) -> list[Chunk]:
    """Chunks of the gathered [m, K] in arrival order: `rank`'s own first, then the peers in ring order. An
    owner's empty trailing chunk (the split leaves it no row) is not planned: no copy, no flag write."""
    rows = m // world_size
    out = []
    for owner in [rank, *ring_order(rank, world_size)]:
        for c in range(chunks_per_rank):
            index = owner * chunks_per_rank + c   # the fused kernel's chunk flag of these rows
            first_row, num_rows = ag_chunk_rows(index, rows, chunks_per_rank)
            if num_rows:
                out.append(Chunk(owner, first_row, num_rows, index))
    return out


def plan_consumer_gemms(*, rank: int, world_size: int, m: int, chunks_per_rank: int, lead_fraction: float,
                        one_gemm: bool = False) -> list[ConsumerGemm]:
    """The decomposed consumer's GEMMs in issue order; together they cover rows [0, m) once.

    lead_fraction 0: one GEMM per chunk, each waiting for its own chunk (local ones read a_shard).
    lead_fraction f > 0: a lead GEMM over f of the local rows (rounded up to LEAD_ROW_ALIGN), then one
    GEMM on each side of it over the rows that wait for every chunk.
    one_gemm=True (a call whose lead work or lead weight-grad GEMM takes the time the pulls run in): one GEMM
    over every row, once every chunk has arrived.
    """
    chunks = plan_chunks(rank=rank, world_size=world_size, m=m, chunks_per_rank=chunks_per_rank)
    if one_gemm:
        return [ConsumerGemm(0, m, len(chunks))]
    if not lead_fraction:
        return [ConsumerGemm(lo, count, -1 if owner == rank else i)
                for i, (owner, lo, count, _) in enumerate(chunks)]
    rows = m // world_size
    lead = min(rows, -(-max(1, math.ceil(lead_fraction * rows)) // LEAD_ROW_ALIGN) * LEAD_ROW_ALIGN)
    # the lead sits at the edge of the local rows that keeps the rest contiguous when it can
    last_rank = rank == world_size - 1 and world_size > 1
    lead_lo = m - lead if last_rank else rank * rows
    plan = [ConsumerGemm(lead_lo, lead, -1)]
    for lo, hi in ((0, lead_lo), (lead_lo + lead, m)):
        if hi > lo:  # local rows from the pool and peer rows: wait for every chunk (index len(chunks))
            plan.append(ConsumerGemm(lo, hi - lo, len(chunks)))
    return plan
