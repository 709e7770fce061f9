"""CPU (Triton interpreter) tests for kernels/gemm.py: local and scatter epilogues, the AllGather-consumer chunk
waits (WAIT_CHUNKS), the reduction and the bounded waits (the interpreter polls once: USE_TIMER=False).

Flags are toggles (protocol.py): a writer stores SET (1), a waiter waits for SET; the error words are the
pool's control page [code, value, abort]: an expired wait stores its code (a base + the flag's index)."""

import os

import torch

if not torch.cuda.is_available():
    # The interpreter must be chosen before triton is imported anywhere.
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import triton  # noqa: E402

import triton.language as tl  # noqa: E402

from tp_overlap.symm_mem.layout import MISMATCH_BIT  # noqa: E402
from tp_overlap.kernels.gemm import (  # noqa: E402
    EPILOGUE_LOCAL,
    EPILOGUE_SCATTER,
    TIMER_AVAILABLE,
    GemmConfig,
    persistent_gemm_kernel,
    reduce_partials_kernel,
)
from tp_overlap.kernels.constants import (ag_chunk_index, ag_chunk_rows, ag_rows_per_chunk,  # noqa: E402
                                          ag_tile_row_offset, cdiv, scatter_flags_per_source)
from tp_overlap.kernels.gemm_mainloop import tile_coordinates  # noqa: E402

# Triton 3.6's interpreter converts 1-element arrays to scalars, which numpy >= 1.25 deprecates.
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
GEMM_BLOCKS = dict(BLOCK_M=32, BLOCK_N=32, BLOCK_K=32, GROUP_M=2)


def gemm_config(**options):
    return GemmConfig(**GEMM_BLOCKS, **options)
GEMM_REL_TOLERANCE = 1e-2
# Bound of every flag wait on the GPU (USE_TIMER, the default there); the interpreter polls once.
TIMEOUT_NS = 2_000_000_000

if DEVICE == "cuda":
    triton.set_allocator(lambda size, alignment, stream: torch.empty(size, dtype=torch.int8, device=DEVICE))


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return (torch.linalg.norm(actual.float() - expected) / torch.linalg.norm(expected)).item()


def random_matrix(rows, cols, dtype, generator):
    return torch.randn(rows, cols, generator=generator, dtype=torch.float32).to(dtype).to(DEVICE)


def launch_local_gemm(a, b, c, num_programs, tile_row_offset, use_descriptors=True, b_transposed=False):
    m, k = a.shape
    n = c.shape[1]
    persistent_gemm_kernel[(num_programs,)](
        a, b, c, m, n, k, (a.stride(0), b.stride(0), c.stride(0)), tile_row_offset, m, 0, None, None, None, None,
        CONFIG=gemm_config(EPILOGUE=EPILOGUE_LOCAL, USE_DESCRIPTORS=use_descriptors, B_TRANSPOSED=b_transposed))


@pytest.mark.parametrize("num_programs,tile_row_offset", [(1, 0), (3, 2), (3, 5)])
def test_local_epilogue_matches_fp32_reference_with_tails(num_programs, tile_row_offset):
    generator = torch.Generator().manual_seed(num_programs * 10 + tile_row_offset)
    m, n, k = 200, 72, 80  # tails in every dimension for 32-wide blocks
    a = random_matrix(m, k, torch.bfloat16, generator)
    b = random_matrix(k, n, torch.bfloat16, generator)
    c = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    launch_local_gemm(a, b, c, num_programs, tile_row_offset)
    assert relative_error(c, a.float() @ b.float()) <= GEMM_REL_TOLERANCE


def test_local_epilogue_fp16_transposed_b_and_strided_c():
    generator = torch.Generator().manual_seed(7)
    m, n, k = 72, 40, 48
    a = random_matrix(m, k, torch.float16, generator)
    weight = random_matrix(n, k, torch.float16, generator)  # [N, K] like nn.Linear
    c_storage = torch.full((m, n + 8), float("nan"), dtype=torch.float16, device=DEVICE)
    c = c_storage[:, :n]
    launch_local_gemm(a, weight, c, num_programs=2, tile_row_offset=1, b_transposed=True)
    assert relative_error(c, a.float() @ weight.float().T) <= GEMM_REL_TOLERANCE
    assert torch.isnan(c_storage[:, n:]).all(), "the store wrote past N into the padding columns"


@pytest.mark.parametrize("b_transposed", [False, True])
def test_pointer_fallback_handles_unaligned_strides(b_transposed):
    generator = torch.Generator().manual_seed(11)
    m, n, k = 50, 37, 45  # row lengths not multiples of 8: descriptors would be rejected
    a = random_matrix(m, k, torch.bfloat16, generator)
    b = random_matrix(n, k, torch.bfloat16, generator) if b_transposed else random_matrix(k, n, torch.bfloat16,
                                                                                         generator)
    c = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    launch_local_gemm(a, b, c, num_programs=3, tile_row_offset=1, use_descriptors=False, b_transposed=b_transposed)
    reference = a.float() @ (b.float().T if b_transposed else b.float())
    assert relative_error(c, reference) <= GEMM_REL_TOLERANCE


class ScatterWorld:
    """Owner buffers, flags and per-source counters of a simulated tensor-parallel group, all in one process."""

    def __init__(self, world_size, rows_per_rank, n, flags_per_source, max_row_blocks):
        self.world_size = world_size
        self.partials = [torch.empty(world_size, rows_per_rank, n, dtype=torch.bfloat16, device=DEVICE)
                         for _ in range(world_size)]
        self.flags = [torch.zeros(world_size, flags_per_source, dtype=torch.int32, device=DEVICE)
                      for _ in range(world_size)]
        self.tile_counters = [torch.zeros(max_row_blocks, dtype=torch.int32, device=DEVICE)
                              for _ in range(world_size)]
        self.dst_ptrs = torch.tensor([p.data_ptr() for p in self.partials], dtype=torch.int64, device=DEVICE)
        self.flag_ptrs = torch.tensor([f.data_ptr() for f in self.flags], dtype=torch.int64, device=DEVICE)


def run_scatter_gemm(world, a, b, src_rank, rows_per_rank, num_programs, use_descriptors=True, chunk_wait=None):
    m, k = a.shape
    n = b.shape[1]
    scatter = (world.dst_ptrs, world.flag_ptrs, world.tile_counters[src_rank], world.flags[0].shape[1],
               control_page(), CODE_BASE, TIMEOUT_NS)
    persistent_gemm_kernel[(num_programs,)](
        a, b, world.partials[src_rank], m, n, k, (a.stride(0), b.stride(0), n), src_rank * 3, rows_per_rank, src_rank,
        scatter, chunk_wait, None, None,
        CONFIG=gemm_config(EPILOGUE=EPILOGUE_SCATTER, USE_DESCRIPTORS=use_descriptors))


def expected_flag_indices(owner, rows_per_rank, block_m):
    first = (owner * rows_per_rank) // block_m
    last = ((owner + 1) * rows_per_rank - 1) // block_m
    return last - first + 1


@pytest.mark.parametrize("world_size,rows_per_rank_by_epoch", [(2, [45, 45]), (3, [40, 23])])
def test_scatter_epilogue_stores_rows_at_owners_and_sets_their_flags(world_size, rows_per_rank_by_epoch):
    # rows_per_rank is never a multiple of BLOCK_M, so tiles straddle owners; the second launch changes M
    # to check that flags and counters stay consistent across shape changes (the owners reset their flags
    # between launches, as the protocol's memory operations do).
    generator = torch.Generator().manual_seed(world_size)
    n, k = 40, 48
    block_m = GEMM_BLOCKS["BLOCK_M"]
    flags_per_source = max(scatter_flags_per_source(r, block_m) for r in rows_per_rank_by_epoch)
    max_row_blocks = max(cdiv(world_size * r, block_m) for r in rows_per_rank_by_epoch)
    world = ScatterWorld(world_size, max(rows_per_rank_by_epoch), n, flags_per_source, max_row_blocks)

    for rows_per_rank in rows_per_rank_by_epoch:
        for partials, flags in zip(world.partials, world.flags):
            partials.fill_(float("nan"))
            flags.zero_()
        m = world_size * rows_per_rank
        products = []
        for src in range(world_size):
            a = random_matrix(m, k, torch.bfloat16, generator)
            b = random_matrix(k, n, torch.bfloat16, generator)
            products.append(a.float() @ b.float())
            run_scatter_gemm(world, a, b, src, rows_per_rank, num_programs=1 + src)

        for owner in range(world_size):
            # The buffer is sized for the largest epoch; this epoch's layout is [world, rows_per_rank, n].
            owner_view = world.partials[owner].view(-1)[: world_size * rows_per_rank * n].view(
                world_size, rows_per_rank, n)
            for src in range(world_size):
                expected = products[src][owner * rows_per_rank:(owner + 1) * rows_per_rank]
                assert relative_error(owner_view[src], expected) <= GEMM_REL_TOLERANCE, (owner, src)
            used = expected_flag_indices(owner, rows_per_rank, block_m)
            assert (world.flags[owner][:, :used] == m).all(), world.flags[owner]  # the call's M
            assert (world.flags[owner][:, used:] == 0).all(), "a flag outside the owner's rows was set"
        for counters in world.tile_counters:
            assert (counters == 0).all(), "tile counters must return to zero for the next launch"


def test_scatter_epilogue_pointer_fallback():
    generator = torch.Generator().manual_seed(5)
    world_size, rows_per_rank, n, k = 2, 21, 27, 35
    world = ScatterWorld(world_size, rows_per_rank, n, scatter_flags_per_source(rows_per_rank, 32),
                         cdiv(world_size * rows_per_rank, 32))
    a = random_matrix(world_size * rows_per_rank, k, torch.bfloat16, generator)
    b = random_matrix(k, n, torch.bfloat16, generator)
    run_scatter_gemm(world, a, b, src_rank=1, rows_per_rank=rows_per_rank, num_programs=2,
                     use_descriptors=False)
    product = a.float() @ b.float()
    for owner in range(world_size):
        expected = product[owner * rows_per_rank:(owner + 1) * rows_per_rank]
        assert relative_error(world.partials[owner][1], expected) <= GEMM_REL_TOLERANCE
        used = expected_flag_indices(owner, rows_per_rank, 32)
        assert (world.flags[owner][1, :used] == len(a)).all() and (world.flags[owner][0] == 0).all()


CODE_BASE = 100  # the error code of flag 0 (the pool passes its device word's code)


def run_reduction(partials, out, flags, error, wait, timeout_ns=TIMEOUT_NS, owner_rank=1, gemm_block_m=32):
    world_size, rows_per_rank, n = partials.shape
    waits = (flags, flags.shape[1], error, CODE_BASE, timeout_ns) if wait else None
    reduce_partials_kernel[(3,)](partials, out, rows_per_rank, n, out.stride(0), world_size, owner_rank, waits,
                                 BLOCK_M=16, BLOCK_N=16, GEMM_BLOCK_M=gemm_block_m)


def arrived_flags(world_size, rows_per_rank):
    """Row-block flags of every source as the scatter epilogue leaves them: the call's M."""
    return torch.full((world_size, scatter_flags_per_source(rows_per_rank, 32)), world_size * rows_per_rank,
                      dtype=torch.int32, device=DEVICE)


def sequential_fp32_sum(partials):
    total = torch.zeros(partials.shape[1:], dtype=torch.float32, device=partials.device)
    for source_partial in partials:
        total += source_partial.float()
    return total


def control_page():
    return torch.zeros(4, dtype=torch.int32, device=DEVICE)  # [code, value, abort, seen]


@pytest.mark.parametrize("world_size,wait", [(2, False), (3, False), (3, True)])
def test_reduction_sums_partials_in_fp32(world_size, wait):
    generator = torch.Generator().manual_seed(20 + world_size)
    rows_per_rank, n = 37, 40
    partials = torch.randn(world_size, rows_per_rank, n, generator=generator).to(torch.bfloat16).to(DEVICE)
    out = torch.full((rows_per_rank, n), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    flags = arrived_flags(world_size, rows_per_rank)
    error = control_page()
    run_reduction(partials, out, flags, error, wait)
    assert error.tolist() == [0, 0, 0, 0]
    torch.testing.assert_close(out, sequential_fp32_sum(partials).to(torch.bfloat16), rtol=1e-2, atol=1e-2)
    assert (flags == world_size * rows_per_rank).all(), "the reduction must not reset flags: the launcher does"


@pytest.mark.parametrize("stale_value", [0, 2])
def test_reduction_wait_times_out_with_error_code_of_the_missing_flag(stale_value):
    """A row-block flag still 0 is an expired wait (its code, the value awaited); a flag at another nonzero
    value is a source that called with another M: the same code with MISMATCH_BIT, both values."""
    world_size, rows_per_rank, n = 3, 37, 40
    partials = torch.randn(world_size, rows_per_rank, n).to(torch.bfloat16).to(DEVICE)
    out = torch.full((rows_per_rank, n), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    flags = arrived_flags(world_size, rows_per_rank)
    flags[1, 1] = stale_value  # source 1 has not finished one row block (or wrote another call's M)
    error = control_page()
    run_reduction(partials, out, flags, error, wait=True, timeout_ns=100_000)
    code = CODE_BASE + 1 * flags.shape[1] + 1
    if stale_value == 0:
        assert error[0].item() == code and error[1].item() == 1
    else:
        assert error.tolist() == [code | MISMATCH_BIT, world_size * rows_per_rank, 0, stale_value]


def test_timer_is_used_exactly_when_not_interpreting():
    assert TIMER_AVAILABLE == (os.environ.get("TRITON_INTERPRET") != "1")


# ----- AllGather consumer: WAIT_CHUNKS ------------------------------------------------------------------------

def test_chunk_geometry_helpers_partition_the_rows_owner_major():
    for rows_per_rank, chunks_per_rank in [(45, 1), (45, 2), (23, 2), (10, 3), (9, 4), (7, 7)]:
        world_size = 3
        per_chunk = ag_rows_per_chunk(rows_per_rank, chunks_per_rank)
        covered = []
        for chunk in range(world_size * chunks_per_rank):
            first, count = ag_chunk_rows(chunk, rows_per_rank, chunks_per_rank)
            assert 0 <= count <= per_chunk
            assert all(ag_chunk_index(r, rows_per_rank, chunks_per_rank) == chunk for r in range(first, first + count))
            covered.extend(range(first, first + count))
        assert covered == list(range(world_size * rows_per_rank))
    assert ag_chunk_rows(3, 9, 4) == (9, 0)  # 9 rows in chunks of 3: the owner's last chunk is empty
    assert ag_chunk_rows(5, 10, 3) == (18, 2)  # owner 1, chunk 2: rows 10 + 8 .. 10 + 9
    assert ag_tile_row_offset(0, 45, 32) == 0 and ag_tile_row_offset(1, 45, 32) == 2
    assert ag_tile_row_offset(2, 64, 32) == 4  # aligned owners: the owner's first row block


@triton.jit
def _record_tile_order_kernel(out_ptr, num_tiles, num_row_blocks, num_col_blocks, tile_row_offset,
                              GROUP_M: tl.constexpr):
    for tile_id in range(num_tiles):
        row_block, col_block = tile_coordinates(tile_id, num_row_blocks, num_col_blocks, tile_row_offset, GROUP_M)
        tl.store(out_ptr + 2 * tile_id, row_block)
        tl.store(out_ptr + 2 * tile_id + 1, col_block)


@pytest.mark.parametrize("num_row_blocks,num_col_blocks,group_m,offset", [(7, 3, 2, 3), (9, 2, 4, 5), (5, 4, 8, 2)])
def test_tile_walk_is_rotated_row_major_by_group(num_row_blocks, num_col_blocks, group_m, offset):
    num_tiles = num_row_blocks * num_col_blocks
    order = torch.full((num_tiles, 2), -1, dtype=torch.int32, device=DEVICE)
    _record_tile_order_kernel[(1,)](order, num_tiles, num_row_blocks, num_col_blocks, offset, GROUP_M=group_m)
    order = order.cpu().tolist()
    assert sorted(map(tuple, order)) == [(r, c) for r in range(num_row_blocks) for c in range(num_col_blocks)]
    # Position of each tile's row block in the rotated walk; it may only run GROUP_M - 1 blocks ahead of
    # the first tile's block of the group, and groups never go back.
    rotated = [(row_block - offset) % num_row_blocks for row_block, _ in order]
    groups = [position // group_m for position in rotated]
    assert groups == sorted(groups)
    assert rotated[0] == 0


def launch_ag_gemm(a, b, c, chunk_flags, error, *, rows_per_rank, chunks_per_rank, rank, num_programs,
                   use_descriptors=True):
    m, k = a.shape
    n = c.shape[1]
    persistent_gemm_kernel[(num_programs,)](
        a, b, c, m, n, k, (a.stride(0), b.stride(0), c.stride(0)),
        ag_tile_row_offset(rank, rows_per_rank, GEMM_BLOCKS["BLOCK_M"]), rows_per_rank, 0,
        None, (chunk_flags, chunks_per_rank, error, CODE_BASE, TIMEOUT_NS), None, None,
        CONFIG=gemm_config(EPILOGUE=EPILOGUE_LOCAL, USE_DESCRIPTORS=use_descriptors))


def ag_inputs(world_size, rows_per_rank, n, k, seed):
    generator = torch.Generator().manual_seed(seed)
    a = random_matrix(world_size * rows_per_rank, k, torch.bfloat16, generator)
    b = random_matrix(k, n, torch.bfloat16, generator)
    c = torch.full((world_size * rows_per_rank, n), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    return a, b, c


# rows_per_rank is never a multiple of BLOCK_M (32), so row blocks straddle owners and chunks.
AG_CASES = [  # world_size, rows_per_rank, chunks_per_rank, rank, num_programs
    (2, 45, 1, 1, 3),
    (2, 45, 2, 0, 2),
    (3, 23, 2, 2, 3),
    (3, 40, 1, 1, 1),
    (3, 40, 2, 0, 4),
]


@pytest.mark.parametrize("world_size,rows_per_rank,chunks_per_rank,rank,num_programs", AG_CASES)
def test_ag_consumer_with_ready_chunks_matches_fp32_reference(world_size, rows_per_rank, chunks_per_rank, rank,
                                                              num_programs):
    n, k = 40, 48  # tails for 32-wide blocks, and descriptor-friendly strides
    a, b, c = ag_inputs(world_size, rows_per_rank, n, k, seed=100 * world_size + rows_per_rank + chunks_per_rank)
    chunk_flags = torch.ones(world_size * chunks_per_rank, dtype=torch.int32, device=DEVICE)
    error = control_page()
    launch_ag_gemm(a, b, c, chunk_flags, error, rows_per_rank=rows_per_rank, chunks_per_rank=chunks_per_rank,
                   rank=rank, num_programs=num_programs)
    assert error.tolist() == [0, 0, 0, 0]
    assert relative_error(c, a.float() @ b.float()) <= GEMM_REL_TOLERANCE


def test_ag_consumer_pointer_fallback_with_unaligned_shapes():
    world_size, rows_per_rank, chunks_per_rank = 3, 17, 2
    a, b, c = ag_inputs(world_size, rows_per_rank, n=37, k=45, seed=3)
    chunk_flags = torch.ones(world_size * chunks_per_rank, dtype=torch.int32, device=DEVICE)
    error = control_page()
    launch_ag_gemm(a, b, c, chunk_flags, error, rows_per_rank=rows_per_rank, chunks_per_rank=chunks_per_rank,
                   rank=1, num_programs=3, use_descriptors=False)
    assert error.tolist() == [0, 0, 0, 0]
    assert relative_error(c, a.float() @ b.float()) <= GEMM_REL_TOLERANCE


def test_ag_consumer_never_waits_for_empty_chunks():
    # 9 rows per owner in 4 chunks of cdiv(9, 4) = 3 rows: every owner's last chunk holds no row, so a producer
    # may leave its flag alone.
    world_size, rows_per_rank, chunks_per_rank = 3, 9, 4
    a, b, c = ag_inputs(world_size, rows_per_rank, n=40, k=48, seed=21)
    chunk_flags = torch.ones(world_size * chunks_per_rank, dtype=torch.int32, device=DEVICE)
    chunk_flags[chunks_per_rank - 1::chunks_per_rank] = 0
    error = control_page()
    launch_ag_gemm(a, b, c, chunk_flags, error, rows_per_rank=rows_per_rank, chunks_per_rank=chunks_per_rank,
                   rank=2, num_programs=2)
    assert error.tolist() == [0, 0, 0, 0]
    assert relative_error(c, a.float() @ b.float()) <= GEMM_REL_TOLERANCE


@pytest.mark.parametrize("world_size,rows_per_rank,chunks_per_rank,stale_chunk", [
    (2, 45, 2, 3),   # the last chunk of owner 1
    (3, 23, 2, 2),   # owner 1's first chunk, in a row block shared with owner 0
    (3, 40, 1, 0),
])
def test_ag_consumer_stale_chunk_records_its_error_code(world_size, rows_per_rank, chunks_per_rank, stale_chunk):
    a, b, c = ag_inputs(world_size, rows_per_rank, n=40, k=48, seed=stale_chunk)
    chunk_flags = torch.ones(world_size * chunks_per_rank, dtype=torch.int32, device=DEVICE)
    chunk_flags[stale_chunk] = 0
    error = control_page()
    launch_ag_gemm(a, b, c, chunk_flags, error, rows_per_rank=rows_per_rank, chunks_per_rank=chunks_per_rank,
                   rank=1, num_programs=3)
    assert error[0].item() == CODE_BASE + stale_chunk and error[1].item() == 1
    first, count = ag_chunk_rows(stale_chunk, rows_per_rank, chunks_per_rank)
    assert torch.isnan(c[first:first + count]).all(), "a tile reading the missing chunk was computed"


def test_a_program_whose_wait_expired_skips_its_remaining_tiles():
    world_size, rows_per_rank, chunks_per_rank = 2, 45, 2
    a, b, c = ag_inputs(world_size, rows_per_rank, n=40, k=48, seed=9)
    chunk_flags = torch.ones(world_size * chunks_per_rank, dtype=torch.int32, device=DEVICE)
    chunk_flags[2] = 0  # owner 1's first chunk: rank 0's single program meets it right after its own rows
    error = control_page()
    launch_ag_gemm(a, b, c, chunk_flags, error, rows_per_rank=rows_per_rank, chunks_per_rank=chunks_per_rank,
                   rank=0, num_programs=1)
    assert error[0].item() == CODE_BASE + 2
    # the walk starts with row block 0, column block 0 (rank 0's rows); row block 1 needs the missing chunk
    assert not torch.isnan(c[:32, :32]).any(), "the tile before the expired wait was skipped"
    assert torch.isnan(c[32:]).all(), "tiles after the expired wait were computed"


def test_chunk_waits_also_work_with_the_scatter_epilogue():
    generator = torch.Generator().manual_seed(13)
    world_size, rows_per_rank, n, k = 3, 23, 40, 48
    world = ScatterWorld(world_size, rows_per_rank, n, scatter_flags_per_source(rows_per_rank, 32),
                         cdiv(world_size * rows_per_rank, 32))
    a = random_matrix(world_size * rows_per_rank, k, torch.bfloat16, generator)
    b = random_matrix(k, n, torch.bfloat16, generator)
    chunk_flags = torch.ones(world_size * 2, dtype=torch.int32, device=DEVICE)
    error = control_page()
    run_scatter_gemm(world, a, b, src_rank=2, rows_per_rank=rows_per_rank, num_programs=2,
                     chunk_wait=(chunk_flags, 2, error, CODE_BASE, TIMEOUT_NS))
    assert error.tolist() == [0, 0, 0, 0]
    product = a.float() @ b.float()
    for owner in range(world_size):
        expected = product[owner * rows_per_rank:(owner + 1) * rows_per_rank]
        assert relative_error(world.partials[owner][2], expected) <= GEMM_REL_TOLERANCE
        used = expected_flag_indices(owner, rows_per_rank, 32)
        assert (world.flags[owner][2, :used] == len(a)).all()
