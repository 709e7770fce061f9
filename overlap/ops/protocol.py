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

The error words are the pool's (symm_mem/_layout.py): a kernel stores the code of an expired wait and the
value it waited for into words 0 and 1 of its rank's control page; word 2 is the group's abort word.
"""

from __future__ import annotations

from typing import NamedTuple

from kernels.constants import CLEAR, SET  # one home: the kernels and these host-side steps read the same values

__all__ = ["SET", "CLEAR", "Flag", "AgFlags", "RsFlags", "initialise"]


class Flag(NamedTuple):
    region: str
    index: int


class AgFlags:
    """Control and device flags of one AgGemm region."""

    def __init__(self, region: str, world_size: int, chunks_per_rank: int):
        self.region, self.world_size, self.chunks_per_rank = region, world_size, chunks_per_rank
        self.num_signals = 2 * world_size
        self.num_device_flags = world_size * chunks_per_rank

    def ready(self, owner: int) -> Flag:
        return Flag(self.region, owner)

    def consumed(self, reader: int) -> Flag:
        return Flag(self.region, self.world_size + reader)

    def initial(self, rank: int) -> dict[int, int]:
        """Control flag values this rank's page starts with."""
        return {self.consumed(r).index: SET for r in range(self.world_size) if r != rank}


class RsFlags:
    """Control and device flags of one GemmRs region."""

    def __init__(self, region: str, world_size: int, flags_per_source: int):
        self.region, self.world_size, self.flags_per_source = region, world_size, flags_per_source
        self.num_signals = 2 * world_size
        self.num_device_flags = world_size * flags_per_source

    def free(self, owner: int) -> Flag:
        return Flag(self.region, owner)

    def pushed(self, source: int) -> Flag:
        return Flag(self.region, self.world_size + source)

    def initial(self, rank: int) -> dict[int, int]:
        return {self.free(o).index: SET for o in range(self.world_size) if o != rank}


def initialise(pool, flags) -> None:
    """Write a region's starting values into this rank's page (before the op's agreement step, which every
    rank passes before any peer can touch these words)."""
    words = pool.signals(flags.region)
    for index, value in flags.initial(pool.rank).items():
        words[index] = value
