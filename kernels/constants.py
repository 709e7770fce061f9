"""The values the kernels and their launchers agree on, importable without Triton (the ops read them at
import time; the kernels read their `tl.constexpr` twins).

* Flag values: a writer stores SET ("done") -- the row-block flags of the scatter epilogues carry the call's
  M instead -- and the launcher stores CLEAR after the reader has seen it (overlap/ops/protocol.py).
* SCALE_GROUP: the FP8 scale group -- one fp32 scale per 128 K columns of an activation row, per 128x128
  block of a weight; the FP8 GEMM's BLOCK_K (kernels/quant_fp8.py, kernels/gemm_fp8.py).
* MISMATCH_BIT: set in the error code a kernel records when a flag held another nonzero value than the one it
  awaited (a peer called with another M); symm_mem's watchdog decodes it.
* The epilogues of `persistent_gemm_kernel` (kernels/gemm.py); the Gluon GEMM's most split pieces of a tile.
* The AllGather consumer's chunk geometry (kernels/gemm.py, WAIT_CHUNKS): which gathered rows each chunk flag
  covers, and where the tile walk starts. The kernel computes the same in its own code;
  overlap/ops/ag_chunks.py plans the copies with these functions.
"""

SET = 1
CLEAR = 0

SCALE_GROUP = 128

ROW_BLOCK_M = 128            # rows per row-block flag of the scatter epilogues (their GEMM's BLOCK_M)

MISMATCH_BIT = 1 << 30       # above every code a wait records (symm_mem/layout.py: DEVICE_CODE_BASE, FAILURE_CODE_BASE)

EPILOGUE_LOCAL = 0           # store the tile into C
EPILOGUE_SCATTER = 1         # store it into its owner's partials buffer and release the row block's flag
EPILOGUE_SCATTER_REDUCE = 2  # the same for the other owners' rows, then reduce the own rows into C

GLUON_MAX_SPLITS = 8         # K pieces of a split tile in the Gluon GEMM's split tail (kernels/gemm_gluon.py)

__all__ = ["SET", "CLEAR", "SCALE_GROUP", "ROW_BLOCK_M", "MISMATCH_BIT", "EPILOGUE_LOCAL", "EPILOGUE_SCATTER",
           "EPILOGUE_SCATTER_REDUCE", "GLUON_MAX_SPLITS", "cdiv", "scatter_flags_per_source", "ag_rows_per_chunk",
           "ag_chunk_index", "ag_chunk_rows", "ag_tile_row_offset"]


def cdiv(numerator: int, denominator: int) -> int:
    return -(-numerator // denominator)


def scatter_flags_per_source(rows_per_rank: int, block_m: int = ROW_BLOCK_M) -> int:
    """Flag words an owner needs per source: its rows can touch cdiv(rows, BLOCK_M) + 1 GEMM row blocks."""
    return cdiv(rows_per_rank, block_m) + 1


def ag_rows_per_chunk(rows_per_rank: int, chunks_per_rank: int) -> int:
    """Rows of every chunk of an owner block but the last, which may be shorter or empty."""
    return cdiv(rows_per_rank, chunks_per_rank)


def ag_chunk_index(row: int, rows_per_rank: int, chunks_per_rank: int) -> int:
    """Index into the chunk flags of the chunk holding gathered row ``row`` (owner-major: owner *
    chunks_per_rank + chunk of that owner, not arrival order)."""
    return ((row // rows_per_rank) * chunks_per_rank
            + (row % rows_per_rank) // ag_rows_per_chunk(rows_per_rank, chunks_per_rank))


def ag_chunk_rows(chunk_index: int, rows_per_rank: int, chunks_per_rank: int) -> tuple[int, int]:
    """(first row, row count) in the gathered A of chunk ``chunk_index``; the count may be 0."""
    owner, chunk = divmod(chunk_index, chunks_per_rank)
    per_chunk = ag_rows_per_chunk(rows_per_rank, chunks_per_rank)
    first = min(chunk * per_chunk, rows_per_rank)
    last = min(first + per_chunk, rows_per_rank)
    return owner * rows_per_rank + first, last - first


def ag_tile_row_offset(rank: int, rows_per_rank: int, block_m: int) -> int:
    """tile_row_offset of the AllGather consumer: the first row block starting at or after the first local row
    (local rows first, then the peers in arrival order; the block straddling rank - 1 and rank last)."""
    return cdiv(rank * rows_per_rank, block_m)
