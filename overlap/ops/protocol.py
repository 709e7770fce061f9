"""The one protocol of the ops: flag layouts, awaited values and handshakes, eager and graphed alike.

Every flag is a toggle. Its writer stores a nonzero value; its one reader waits until it reads exactly that
value and stores CLEAR (0) before the handshake that lets the writer set it again. The awaited value of a
plan never changes, so a stream memory-operation wait captured in a CUDA graph replays the same protocol as
an eager call (a captured memop's compare value is fixed at capture). There are no epochs and no double
buffers: one buffer per op, protected by explicit handshakes.

Two kinds of value:
  SET (1)   flags that only say "done" (the reader's permission to reuse a buffer);
  M         flags that say "this call's data is there": the writer stores the call's M (rows of the whole
            call, >= 1), the reader awaits its own M. Ranks that disagree on M therefore meet a flag at
            another nonzero value: the reader's watchdog (CUDA) or host wait (CPU) reports it to every rank
            at once (PeerMismatchError naming both values). This is the per-call agreement check, done where
            the ranks meet anyway: no host rendezvous per call.

Control flags (host memory, awaited by streams with memory operations, bounded by the pool's watchdog):

  AllGather+GEMM, region `<name>.a` (data [max_m, K]; this rank's rows are its published slot):
    ready[owner]     on the reader's page, value M: owner's rows of this call are in its slot (owner -> reader)
    consumed[reader] on the owner's page, SET: reader has pulled the owner's rows of the last call
                     (reader -> owner); starts SET (nothing to protect before the first call)
  GEMM+ReduceScatter, region `<name>.partials` (data [W, max_m/W, N]: slot s holds source s's partial):
    free[owner]      on the source's page, SET: owner has reduced its slot of this source (owner -> source);
                     starts SET
    pushed[source]   on the owner's page, value M: source's copy-engine push into its slot landed
                     (source -> owner)

Device flags (the symmetric allocation's flag area, polled by kernels, reset by memory operations after the
kernel that read them, before the handshake that lets the writer set them again):

  AllGather+GEMM fused consumer: chunk[owner * chunks_per_rank + c] on this rank, SET: chunk c of owner's rows
    has arrived (written by this rank's comm lane after the pull; reset at the start of the next call).
  GEMM+ReduceScatter scatter epilogue: row_block[source][b] on the owner, value M: every column tile of GEMM
    row block b of the owner's rows has been stored by `source` (written by the source's GEMM, release at
    system scope); a kernel that finds another nonzero value records a disagreement (MISMATCH_BIT).

The error words are the pool's (symm_mem/layout.py): a kernel stores the code of an expired wait and the
value it waited for into words 0 and 1 of its rank's control page; word 2 is the group's abort word.
"""

from __future__ import annotations

from typing import NamedTuple

from tp_overlap.kernels.constants import CLEAR, ROW_BLOCK_M, SET, scatter_flags_per_source  # one home: kernels and host agree

__all__ = ["SET", "CLEAR", "Flag", "AgFlags", "RsFlags", "flags_per_source", "initialise", "ring_order"]


def ring_order(rank: int, world_size: int) -> list[int]:
    """The peers in the order this rank visits them: rank + 1, rank + 2, ..., rank - 1. Every rank starts at its
    next neighbour, so at each step no two ranks read from (or push to) the same peer."""
    return [(rank + step) % world_size for step in range(1, world_size)]


class Flag(NamedTuple):
    region: str
    index: int


def flags_per_source(max_m: int, world_size: int) -> int:
    """Device flags a GemmRs region keeps per source (the row blocks of one owner's rows, + 1 straddling)."""
    return scatter_flags_per_source(max_m // world_size, ROW_BLOCK_M)


class _RegionFlags:
    """The layout both ops share: 2 W control words (W "mine is ready" words indexed by the writer, then W
    "you may write again" words indexed by the reader, the latter starting SET for every peer), and W x
    `per_source` device flags."""
    _starts_second: bool  # which half starts SET for every peer (AgFlags: consumed; RsFlags: free)

    def __init__(self, region: str, world_size: int, per_source: int):
        self.region, self.world_size, self.per_source = region, world_size, per_source
        self.num_signals = 2 * world_size
        self.num_device_flags = world_size * per_source

    def _first(self, rank: int) -> Flag:
        return Flag(self.region, rank)

    def _second(self, rank: int) -> Flag:
        return Flag(self.region, self.world_size + rank)

    def initial(self, rank: int) -> dict[int, int]:
        """Control flag values this rank's page starts with: its peers may write into its region at once."""
        return {self._second(r).index if self._starts_second else self._first(r).index: SET
                for r in range(self.world_size) if r != rank}


class AgFlags(_RegionFlags):
    """AgGemm: ready[owner] (value M: owner's rows are published), consumed[reader] (the reader pulled them:
    the owner may overwrite its slot); a device flag per chunk of each owner's rows (the fused consumer)."""
    _starts_second = True

    def __init__(self, region: str, world_size: int, chunks_per_rank: int):
        super().__init__(region, world_size, chunks_per_rank)
        self.chunks_per_rank = chunks_per_rank

    ready, consumed = _RegionFlags._first, _RegionFlags._second


class RsFlags(_RegionFlags):
    """GemmRs: free[owner] (the owner's slot for this source may be written), pushed[source] (value M:
    source's partial is in); a device flag per ROW_BLOCK_M row block of each source (scatter epilogues)."""
    _starts_second = False

    def __init__(self, region: str, world_size: int, max_m: int):
        super().__init__(region, world_size, flags_per_source(max_m, world_size))
        self.flags_per_source = self.per_source

    free, pushed = _RegionFlags._first, _RegionFlags._second


def initialise(pool, flags) -> None:
    """Write a region's starting values into this rank's page (before the op's agreement step, which every
    rank passes before any peer can touch these words)."""
    words = pool.signals(flags.region)
    for index, value in flags.initial(pool.rank).items():
        words[index] = value
