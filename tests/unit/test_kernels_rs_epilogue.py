"""EPILOGUE 2 of the persistent GEMM (scatter the other owners' rows, reduce the own rows in the epilogue)
under the Triton interpreter: the tile walk, the sums and the bounded waits (the row-block flags carry the call's M)."""

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from tp_overlap.kernels.constants import scatter_flags_per_source  # noqa: E402
from tp_overlap.kernels.gemm import EPILOGUE_SCATTER_REDUCE, GemmConfig, persistent_gemm_kernel  # noqa: E402
from tp_overlap.kernels.rs_epilogue import owner_last_tile  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BLOCKS = dict(BLOCK_M=32, BLOCK_N=32, BLOCK_K=32, GROUP_M=2)
CODE_BASE = 100  # the error code of flag 0


@triton.jit
def _walk_kernel(out_ptr, num_row_blocks, num_col_blocks, own_first, own_count, GROUP_M: tl.constexpr):
    for tile_id in range(0, num_row_blocks * num_col_blocks):
        row_block, col_block = owner_last_tile(tile_id, num_row_blocks, num_col_blocks, own_first, own_count,
                                               GROUP_M)
        tl.store(out_ptr + 2 * tile_id, row_block)
        tl.store(out_ptr + 2 * tile_id + 1, col_block)


@pytest.mark.parametrize("world_size,blocks_per_rank,num_col_blocks,rank", [(2, 3, 4, 0), (3, 2, 5, 1),
                                                                            (4, 1, 3, 3)])
def test_walk_visits_every_tile_once_other_owners_first_from_the_next_owner(world_size, blocks_per_rank,
                                                                            num_col_blocks, rank):
    num_row_blocks = world_size * blocks_per_rank
    out = torch.full((num_row_blocks * num_col_blocks, 2), -1, dtype=torch.int32, device=DEVICE)
    _walk_kernel[(1,)](out, num_row_blocks, num_col_blocks, rank * blocks_per_rank, blocks_per_rank, GROUP_M=2)
    tiles = [tuple(t) for t in out.tolist()]
    assert sorted(tiles) == [(r, c) for r in range(num_row_blocks) for c in range(num_col_blocks)]
    owners = [row // blocks_per_rank for row, _ in tiles]
    other = (world_size - 1) * blocks_per_rank * num_col_blocks
    assert all(o != rank for o in owners[:other]) and all(o == rank for o in owners[other:])
    assert owners[0] == (rank + 1) % world_size


class World:
    """Owner buffers [W, rows, N], flags [W, fps], per-source tile counters, outputs and error words."""

    def __init__(self, world_size, rows_per_rank, n, k, generator):
        self.w, self.rows, self.n = world_size, rows_per_rank, n
        m = world_size * rows_per_rank
        self.a = [torch.randn(m, k, generator=generator).bfloat16().to(DEVICE) for _ in range(world_size)]
        self.b = [torch.randn(k, n, generator=generator).bfloat16().to(DEVICE) for _ in range(world_size)]
        fps = scatter_flags_per_source(rows_per_rank, BLOCKS["BLOCK_M"])
        self.fps = fps
        self.partials = [torch.full((world_size, rows_per_rank, n), float("nan"), dtype=torch.bfloat16,
                                    device=DEVICE) for _ in range(world_size)]
        self.flags = [torch.zeros(world_size, fps, dtype=torch.int32, device=DEVICE) for _ in range(world_size)]
        self.counters = [torch.zeros(m // BLOCKS["BLOCK_M"] + 1, dtype=torch.int32, device=DEVICE)
                         for _ in range(world_size)]
        self.out = [torch.full((rows_per_rank, n), float("nan"), dtype=torch.bfloat16, device=DEVICE)
                    for _ in range(world_size)]
        self.errors = [torch.zeros(3, dtype=torch.int32, device=DEVICE) for _ in range(world_size)]  # control pages
        self.dst_ptrs = torch.tensor([p.data_ptr() for p in self.partials], dtype=torch.int64, device=DEVICE)
        self.flag_ptrs = torch.tensor([f.data_ptr() for f in self.flags], dtype=torch.int64, device=DEVICE)

    def run(self, src, num_programs=3):
        m, k = self.a[src].shape
        scatter = (self.dst_ptrs, self.flag_ptrs, self.counters[src], self.fps, self.errors[src], CODE_BASE, 10**9)
        persistent_gemm_kernel[(num_programs,)](
            self.a[src], self.b[src], self.out[src], m, self.n, k, (k, self.n, self.n), 0, self.rows, src,
            scatter, None, None, None, CONFIG=GemmConfig(**BLOCKS, EPILOGUE=EPILOGUE_SCATTER_REDUCE))

    def expected(self, owner):
        rows = slice(owner * self.rows, (owner + 1) * self.rows)
        return sum(self.a[s].double()[rows] @ self.b[s].double() for s in range(self.w))


def _rel(out, ref):
    return ((out.double() - ref).norm() / ref.norm()).item()


@pytest.mark.parametrize("world_size", [2, 3])
def test_own_rows_are_the_sum_of_every_source_and_a_missing_partial_is_an_error(world_size):
    # The interpreter polls once (no timer), so sources run one after the other: a source whose peers have
    # not run yet records the first missing flag and leaves its own rows unwritten; run again, it completes.
    world = World(world_size, rows_per_rank=64, n=40, k=48, generator=torch.Generator().manual_seed(world_size))
    for round_ in (1, 2):
        for out, flags in zip(world.out, world.flags):
            out.fill_(float("nan"))
            flags.zero_()   # the launcher resets the flags after each call (protocol.py)
        for src in range(world_size):
            world.run(src)
        code, value, abort = world.errors[0].tolist()
        # source 0 ran before source 1 wrote its partials: the code names one of source 1's row-block flags
        assert CODE_BASE + world.fps <= code < CODE_BASE + 2 * world.fps and (value, abort) == (1, 0), code
        assert torch.isnan(world.out[0].float()).all(), "own rows must not be written after a failed wait"
        for src in range(world_size):
            if world.errors[src][0].item():
                world.errors[src].zero_()
                world.run(src)
        for owner in range(world_size):
            assert world.errors[owner].tolist() == [0, 0, 0]
            err = _rel(world.out[owner], world.expected(owner))
            assert err < 1e-2, (round_, owner, err)
            others = [s for s in range(world_size) if s != owner]
            assert (world.flags[owner][others][:, :2] == world_size * world.rows).all()  # the call's M
        for counters in world.counters:
            assert (counters == 0).all()
