"""The fused AllGather consumer's own chunk arithmetic (kernels/gemm.py, kernels/gemm_mainloop.py), under the
Triton interpreter, against the host's chunk plan (overlap/ops/ag_chunks.py: which rows each chunk flag's copy
brings). With every flag SET but one, the kernel must skip exactly the tiles that read a row of that chunk
and record that chunk's code: a row mapped to the wrong chunk either reads rows before they arrive or waits
for a flag nobody sets. (The CPU ops wait for every flag on the host before the interpreted kernel runs, so
no multi-process test can see this arithmetic.)"""

import os

import pytest
import torch

os.environ.setdefault("TRITON_INTERPRET", "1")

from tp_overlap.gemm import ChunkWait, GemmBlocks, launch_gemm  # noqa: E402
from tp_overlap.ops.ag_chunks import plan_chunks  # noqa: E402
from tp_overlap.ops.protocol import SET  # noqa: E402

BLOCK_M, N, K = 16, 16, 16
CODE_BASE = 1000
GEOMETRIES = [  # world size, rows per rank (never a multiple of BLOCK_M), chunks per rank
    (2, 45, 2),   # rows per chunk = cdiv(45, 2) = 23: chunks end inside row blocks
    (3, 23, 2),   # row blocks straddle owners
    (2, 9, 4),    # 3-row chunks: each owner's last chunk is empty (no row, no flag write, never awaited)
    (3, 10, 3),   # 4, 4, 2 rows
    (2, 17, 3),   # 6, 6, 5 rows
]


def _chunk_of_rows(world, rows, chunks):
    """Row -> flag index, as the host's plan copies them (rank 0's view; every rank plans the same rows)."""
    owner_of = {}
    for chunk in plan_chunks(rank=0, world_size=world, m=world * rows, chunks_per_rank=chunks):
        owner_of.update({row: chunk.flag_index for row in range(chunk.first_row, chunk.first_row + chunk.num_rows)})
    return owner_of


def _run(world, rows, chunks, missing):
    """The kernel with every planned chunk's flag SET but `missing` (an empty chunk's flag is never set)."""
    m = world * rows
    gen = torch.Generator().manual_seed(m + chunks)
    a, w = torch.randn(m, K, generator=gen), torch.randn(K, N, generator=gen)
    out = torch.full((m, N), float("nan"))
    flags = torch.zeros(world * chunks, dtype=torch.int32)
    flags[sorted(set(_chunk_of_rows(world, rows, chunks).values()) - {missing})] = SET
    errors = torch.zeros(4, dtype=torch.int32)   # the control page's code, value, abort, observed words
    tiles = -(-m // BLOCK_M)
    launch_gemm(a=a, w=w, out=out, num_programs=tiles, blocks=GemmBlocks(BLOCK_M, N, K, 1, 1, 1),
                chunk_wait=ChunkWait(flags=flags, rows_per_rank=rows, chunks_per_rank=chunks, error_words=errors,
                                     error_code_base=CODE_BASE, timeout_s=0.01))   # one program per tile
    return out, a @ w, int(errors[0])


@pytest.mark.parametrize("world,rows,chunks", GEOMETRIES)
def test_the_kernel_skips_exactly_the_tiles_that_read_a_missing_chunk_and_names_it(world, rows, chunks):
    chunk_of = _chunk_of_rows(world, rows, chunks)
    assert sorted(chunk_of) == list(range(world * rows))   # the plan covers every row once
    out, want, code = _run(world, rows, chunks, None)
    assert code == 0 and torch.allclose(out, want, atol=1e-4)
    for missing in sorted(set(chunk_of.values())):
        out, want, code = _run(world, rows, chunks, missing)
        assert code == CODE_BASE + missing, (missing, code)
        for first in range(0, world * rows, BLOCK_M):
            tile = range(first, min(first + BLOCK_M, world * rows))
            reads_missing = any(chunk_of[row] == missing for row in tile)
            if reads_missing:
                assert torch.isnan(out[first:tile.stop]).all(), f"chunk {missing}: rows {first}.. computed early"
            else:
                assert torch.allclose(out[first:tile.stop], want[first:tile.stop], atol=1e-4), \
                    f"chunk {missing}: rows {first}.. waited for a chunk they do not read"
