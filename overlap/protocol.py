"""The one protocol of the ops: flag layouts, awaited values and handshakes, eager and graphed alike.

Every flag is a toggle. Its writer stores SET (1); its one reader waits until it reads SET and stores CLEAR
(0) before the handshake that lets the writer set it again. The awaited value is the same in every call,
so a stream memory-operation wait captured in a CUDA graph replays the same protocol as an eager call
(a captured memop's compare value is fixed at capture). There are no epochs and no double buffers: one
buffer per op, protected by explicit handshakes.

Control flags (host memory, awaited by streams with memory operations, bounded by the pool's watchdog):

  AllGather+GEMM, region `<name>.a` (data [max_m, K]; this rank's rows are its published slot):
    ready[owner]     on the reader's page: owner's rows of this call are in its slot     (owner -> reader)
    consumed[reader] on the owner's page: reader has pulled the owner's rows of the last call (reader -> owner)
                     starts SET (nothing to protect before the first call)
  GEMM+ReduceScatter, region `<name>.partials` (data [W, max_m/W, N]: slot s holds source s's partial):
    free[owner]      on the source's page: owner has reduced its slot of this source      (owner -> source)
                     starts SET
    pushed[source]   on the owner's page: source's copy-engine push into its slot landed (source -> owner)
  Both regions end with CALL_WORDS words where each rank posts (call number, M) of its calls, so that a
  rank whose M differs from its peers' raises on every rank before anything is enqueued (`check_call`).

Device flags (the symmetric allocation's flag area, polled by kernels, reset by memory operations after the
kernel that read them, before the handshake that lets the writer set them again):

  AllGather+GEMM fused consumer: chunk[owner * chunks_per_rank + c] on this rank: chunk c of owner's rows has
    arrived (written by this rank's comm lane after the pull; reset at the start of the next call).
  GEMM+ReduceScatter scatter epilogue: row_block[source][b] on the owner: every column tile of GEMM row block
    b of the owner's rows has been stored by `source` (written by the source's GEMM, release at system scope).

The error words are the pool's (symm_mem/_layout.py): a kernel stores the code of an expired wait and the
value it waited for into words 0 and 1 of its rank's control page; word 2 is the group's abort word.
"""

from __future__ import annotations

from typing import NamedTuple

from symm_mem._layout import ABORT_WORD, ERROR_CODE_WORD, ERROR_VALUE_WORD  # noqa: F401 (the error layout)

__all__ = ["SET", "CLEAR", "CALL_WORDS", "Flag", "AgFlags", "RsFlags", "check_call"]

SET, CLEAR = 1, 0
CALL_WORDS = 4  # two (call number, M) pairs: call c posts into pair c % 2


class Flag(NamedTuple):
    region: str
    index: int


class AgFlags:
    """Control and device flags of one AgGemm region."""

    def __init__(self, region: str, world_size: int, chunks_per_rank: int):
        self.region, self.world_size, self.chunks_per_rank = region, world_size, chunks_per_rank
        self.num_signals = 2 * world_size + CALL_WORDS
        self.num_device_flags = world_size * chunks_per_rank
        self.call_word = 2 * world_size

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
        self.num_signals = 2 * world_size + CALL_WORDS
        self.num_device_flags = world_size * flags_per_source
        self.call_word = 2 * world_size

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


def check_call(pool, flags, call: int, m: int, *, op: str) -> None:
    """Post (call, M) and wait until every rank has posted this call; raise OpInputError on every rank if
    the Ms differ. Host memory only (no CUDA call): a few microseconds when the ranks are in step."""
    from ._validate import OpInputError

    first = flags.call_word + 2 * (call % 2)
    own = pool.signals(flags.region)
    own[first + 1] = m
    own[first] = call  # posted after M: a reader that sees the call number sees its M
    pages = [pool.signals(flags.region, r) for r in range(pool.world_size)]

    def everyone_posted() -> bool:
        return all(page[first] == call for page in pages)

    def timed_out():
        from symm_mem import SignalTimeout
        late = [r for r, page in enumerate(pages) if page[first] != call]
        observed = int(pages[late[0]][first])
        pool.record_timeout(flags.region, first, call, observed)
        return SignalTimeout(region=flags.region, index=first, expected=call, observed=observed,
                             timeout_s=pool.timeout_s, peer=late[0], op=op,
                             detail=f"rank {late[0]} has not issued call {call} of this op (it is stuck in an "
                                    f"earlier call, or calls the op fewer times than this rank)")

    pool.host_wait(everyone_posted, waiting_for=f"{op}: call {call} on every rank", on_timeout=timed_out)
    ms = [int(page[first + 1]) for page in pages]
    if len(set(ms)) > 1:
        raise OpInputError(f"{op}: call {call} has different M on the ranks of the group ("
                           + ", ".join(f"rank {r}: {v}" for r, v in enumerate(ms))
                           + "); every rank must pass the same number of rows (M = rows per rank x W)")
