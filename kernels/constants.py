"""The values the kernels and their launchers agree on, importable without Triton (the ops read them at
import time; the kernels read their `tl.constexpr` twins).

* Flag values: a writer stores SET ("done") -- the row-block flags of the scatter epilogues carry the call's
  M instead -- and the launcher stores CLEAR after the reader has seen it (overlap/ops/protocol.py).
* SCALE_GROUP: the FP8 scale group -- one fp32 scale per 128 K columns of an activation row, per 128x128
  block of a weight; the FP8 GEMM's BLOCK_K (kernels/quant_fp8.py, kernels/gemm_fp8.py).
* The epilogues of `persistent_gemm_kernel` (kernels/gemm.py); the Gluon GEMM's most split pieces of a tile.
"""

SET = 1
CLEAR = 0

SCALE_GROUP = 128

ROW_BLOCK_M = 128            # rows per row-block flag of the scatter epilogues (their GEMM's BLOCK_M)

EPILOGUE_LOCAL = 0           # store the tile into C
EPILOGUE_SCATTER = 1         # store it into its owner's partials buffer and release the row block's flag
EPILOGUE_SCATTER_REDUCE = 2  # the same for the other owners' rows, then reduce the own rows into C

GLUON_MAX_SPLITS = 8         # K pieces of a split tile in the Gluon GEMM's split tail (kernels/gemm_gluon.py)

__all__ = ["SET", "CLEAR", "SCALE_GROUP", "ROW_BLOCK_M", "EPILOGUE_LOCAL", "EPILOGUE_SCATTER",
           "EPILOGUE_SCATTER_REDUCE", "GLUON_MAX_SPLITS", "scatter_flags_per_source"]


def scatter_flags_per_source(rows_per_rank: int, block_m: int = ROW_BLOCK_M) -> int:
    """Flag words an owner needs per source: its rows can touch cdiv(rows, BLOCK_M) + 1 GEMM row blocks."""
    return -(-rows_per_rank // block_m) + 1
