"""Ablations of kernels/gemm_fp8_gluon.py, written as sibling modules of it (text substitutions), for timing only."""
import importlib
import pathlib

SRC = pathlib.Path(__file__).resolve().parents[1] / "kernels" / "gemm_fp8_gluon.py"

# acc accumulated by the MMA itself (no promotion), the slot released when the MMA retired (0 outstanding)
NOPROMOTE0 = [(
    """        product = _issue_mma(a_bufs, b_bufs, ready, product, step + k - first_k, HALF, NUM_STAGES)
        scale = _group_scales(a_scale_bufs, b_scale_bufs, (step + k - first_k) % NUM_STAGES, k, HALF,
                              gl.SliceLayout(1, mma_layout))
        product = _retire(product, empty, step + k - first_k, NUM_STAGES, 0)
        acc = _promote(acc, product, scale)""",
    """        acc = _issue_mma_acc(a_bufs, b_bufs, ready, acc, step + k - first_k, HALF, NUM_STAGES)
        acc = _retire(acc, empty, step + k - first_k, NUM_STAGES, 0)""")]
# the bf16 kernel's pipeline: one MMA in flight, the previous slot released
NOPROMOTE1 = [(
    """        product = _issue_mma(a_bufs, b_bufs, ready, product, step + k - first_k, HALF, NUM_STAGES)
        scale = _group_scales(a_scale_bufs, b_scale_bufs, (step + k - first_k) % NUM_STAGES, k, HALF,
                              gl.SliceLayout(1, mma_layout))
        product = _retire(product, empty, step + k - first_k, NUM_STAGES, 0)
        acc = _promote(acc, product, scale)""",
    """        acc = _issue_mma_acc(a_bufs, b_bufs, ready, acc, step + k - first_k, HALF, NUM_STAGES)
        acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc, ))
        if k > first_k:
            _barrier()
            mbarrier.arrive(empty.index((step + k - first_k - 1) % NUM_STAGES))
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
    _barrier()
    mbarrier.arrive(empty.index((step + end_k - first_k - 1) % NUM_STAGES))""")]
ISSUE_ACC = ("""@gluon.jit
def _retire(""", """@gluon.jit
def _issue_mma_acc(a_bufs, b_bufs, ready, acc, step, HALF: gl.constexpr, NUM_STAGES: gl.constexpr):
    WG_M: gl.constexpr = a_bufs.type.shape[1] // 2
    slot = step % NUM_STAGES
    mbarrier.wait(ready.index(slot), (step // NUM_STAGES) & 1)
    a_half = a_bufs.index(slot).slice(HALF * WG_M, WG_M, dim=0)
    return warpgroup_mma(a_half, b_bufs.index(slot).permute((1, 0)), acc, use_acc=True, is_async=True)


@gluon.jit
def _retire(""")
# promotion kept, the scales constant (the producer loads no scale boxes)
NOSCALE = [(
    """    STAGE_BYTES: gl.constexpr = (a_desc.block_type.nbytes + b_desc.block_type.nbytes
                                 + a_scale_desc.block_type.nbytes + b_scale_desc.block_type.nbytes)""",
    """    STAGE_BYTES: gl.constexpr = (a_desc.block_type.nbytes + b_desc.block_type.nbytes)"""), (
    """            if a_scale_desc.block_type.shape[0] == 1:  # group-major storage [groups, M]: the group's row
                tma.async_copy_global_to_shared(a_scale_desc, [k, row_block * BLOCK_M], bar, a_scale_bufs.index(slot))
            else:  # row-major [M, groups] (e.g. an AllGather pool): the tile's rows, the box holding the group
                tma.async_copy_global_to_shared(a_scale_desc, [row_block * BLOCK_M, k - k % B_SCALE_BOX], bar,
                                                a_scale_bufs.index(slot))
            tma.async_copy_global_to_shared(b_scale_desc, [col_block_128, k - k % B_SCALE_BOX], bar,
                                            b_scale_bufs.index(slot).slice(0, 1))""", ""), (
    """        scale = _group_scales(a_scale_bufs, b_scale_bufs, (step + k - first_k) % NUM_STAGES, k, HALF,
                              gl.SliceLayout(1, mma_layout))""",
    """        scale = gl.full([WG_M], 1.0, gl.float32, gl.SliceLayout(1, mma_layout))""")]
VARIANTS = {"nopromote0": [ISSUE_ACC] + NOPROMOTE0, "nopromote1": [ISSUE_ACC] + NOPROMOTE1, "noscale": NOSCALE}


def variant_module(name: str, edits=None):
    text = SRC.read_text()
    for old, new in (edits if edits is not None else VARIANTS[name]):
        assert text.count(old) == 1, (name, old[:80])
        text = text.replace(old, new)
    path = SRC.parent / f"_probe_{name}.py"
    path.write_text(text)
    return importlib.import_module(f"tp_overlap.kernels._probe_{name}")


def _group(n):
    return [("from .gemm_gluon_walk import tile_coordinates as _tile_coordinates, work_item as _work_item",
             f"""from .gemm_gluon_walk import work_item as _work_item


@gluon.jit
def _tile_coordinates(tile_id, num_row_blocks, num_col_blocks, tile_row_offset):
    tiles_per_group = {n} * num_col_blocks
    first_row_block = (tile_id // tiles_per_group) * {n}
    rows_in_group = gl.minimum(num_row_blocks - first_row_block, {n})
    index_in_group = tile_id % tiles_per_group
    row_block = (first_row_block + index_in_group % rows_in_group + tile_row_offset) % num_row_blocks
    return row_block, index_in_group // rows_in_group""")]


VARIANTS["group4"] = _group(4)
VARIANTS["group16"] = _group(16)

# each warpgroup's product in two 64-column halves: the first half's promotion overlaps the second half's MMA
# (the same 128 registers of accumulators and products); whole tiles only (the split path is dropped)
SPLIT_N = [(
    '''    acc = gl.zeros([WG_M, BLOCK_N], gl.float32, mma_layout)
    product = gl.zeros([WG_M, BLOCK_N], gl.float32, mma_layout)
    for k in range(first_k, end_k):
        product = _issue_mma(a_bufs, b_bufs, ready, product, step + k - first_k, HALF, NUM_STAGES)
        scale = _group_scales(a_scale_bufs, b_scale_bufs, (step + k - first_k) % NUM_STAGES, k, HALF,
                              gl.SliceLayout(1, mma_layout))
        product = _retire(product, empty, step + k - first_k, NUM_STAGES, 0)
        acc = _promote(acc, product, scale)
    return acc''',
    '''    HN: gl.constexpr = BLOCK_N // 2
    half_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                          instr_shape=[16, HN, 32])
    acc0 = gl.zeros([WG_M, HN], gl.float32, half_layout)
    acc1 = gl.zeros([WG_M, HN], gl.float32, half_layout)
    p0 = gl.zeros([WG_M, HN], gl.float32, half_layout)
    p1 = gl.zeros([WG_M, HN], gl.float32, half_layout)
    for k in range(first_k, end_k):
        s = step + k - first_k
        slot = s % NUM_STAGES
        mbarrier.wait(ready.index(slot), (s // NUM_STAGES) & 1)
        a_half = a_bufs.index(slot).slice(HALF * WG_M, WG_M, dim=0)
        b_tile = b_bufs.index(slot)
        p0 = warpgroup_mma(a_half, b_tile.slice(0, HN, dim=0).permute((1, 0)), p0, use_acc=False, is_async=True)
        p1 = warpgroup_mma(a_half, b_tile.slice(HN, HN, dim=0).permute((1, 0)), p1, use_acc=False, is_async=True)
        scale = _group_scales(a_scale_bufs, b_scale_bufs, slot, k, HALF, gl.SliceLayout(1, half_layout))
        p0 = warpgroup_mma_wait(num_outstanding=1, deps=(p0, ))
        acc0 = _promote(acc0, p0, scale)
        p1 = warpgroup_mma_wait(num_outstanding=0, deps=(p1, ))
        _barrier()
        mbarrier.arrive(empty.index(slot))
        acc1 = _promote(acc1, p1, scale)
    return acc0, acc1'''), (
    '''        if unit < 0:
            _staging_free()
            out_smem.store(acc.to(c_desc.dtype))
            _store_staged(out_smem, c_desc, first_row, col_block * BLOCK_N)
        elif _count_partial(acc, unit, tile_id, num_whole_tiles, splits, workspace, counters, HALF, 2):
            _staging_free()
            _sum_partials(workspace, (unit - unit % splits) * 2 + HALF, splits, out_smem, WG_M, BLOCK_N, 2)
            _store_staged(out_smem, c_desc, first_row, col_block * BLOCK_N)''',
    '''        acc0, acc1 = acc
        _staging_free()
        out_smem.slice(0, BLOCK_N // 2, dim=1).store(acc0.to(c_desc.dtype))
        out_smem.slice(BLOCK_N // 2, BLOCK_N // 2, dim=1).store(acc1.to(c_desc.dtype))
        _store_staged(out_smem, c_desc, first_row, col_block * BLOCK_N)''')]
VARIANTS["split_n"] = SPLIT_N

# the two consumer warpgroups issue their MMAs in strict alternation (an mbarrier pair `turn`): the tensor cores
# take one warpgroup's group while the other promotes, instead of both finishing together and promoting at once
PINGPONG = [(
    '''    acc = gl.zeros([WG_M, BLOCK_N], gl.float32, mma_layout)
    product = gl.zeros([WG_M, BLOCK_N], gl.float32, mma_layout)
    for k in range(first_k, end_k):
        product = _issue_mma(a_bufs, b_bufs, ready, product, step + k - first_k, HALF, NUM_STAGES)
''', '''    ready, turn = ready
    acc = gl.zeros([WG_M, BLOCK_N], gl.float32, mma_layout)
    product = gl.zeros([WG_M, BLOCK_N], gl.float32, mma_layout)
    for k in range(first_k, end_k):
        s = step + k - first_k
        mbarrier.wait(turn.index(HALF), (s & 1) ^ (1 - HALF))  # warpgroup 0 first
        product = _issue_mma(a_bufs, b_bufs, ready, product, s, HALF, NUM_STAGES)
        _barrier()  # every warp of this warpgroup has issued
        mbarrier.arrive(turn.index(1 - HALF))
'''), (
    '''    ready, empty = init_ring(NUM_STAGES, 2)  # one `empty` arrival per consumer warpgroup
''', '''    ready, empty = init_ring(NUM_STAGES, 2)  # one `empty` arrival per consumer warpgroup
    turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2):
        mbarrier.init(turn.index(i), count=1)
'''), (
    '''    mma_args = (a_bufs, b_bufs, a_scale_rows, b_scale_rows, ready, empty, c_desc, c_smem, M, N, K, tile_row_offset,''',
    '''    mma_args = (a_bufs, b_bufs, a_scale_rows, b_scale_rows, (ready, turn), empty, c_desc, c_smem, M, N, K,
                tile_row_offset,''')]
VARIANTS["pingpong"] = PINGPONG

# Since the kernel reads the scales before issuing the MMA ("scale_first" above, now the kernel's order),
# the variants below are edits of that order.
NEW_SCALE = """        scale = _group_scales(a_scale_bufs, b_scale_bufs, slot, k, HALF, gl.SliceLayout(1, mma_layout))"""
CONST_SCALE = """        scale = gl.full([WG_M], 1.0, gl.float32, gl.SliceLayout(1, mma_layout))"""
VARIANTS["noscale"] = NOSCALE[:2] + [(NEW_SCALE, CONST_SCALE)]
# which half of "noscale" pays: the consumer's scale reads (scale_tma_only keeps the producer's scale loads,
# the consumer multiplies by 1) or the producer's scale loads (scale_lds_only: no scale TMA, the consumer
# still reads the slot's scales)
VARIANTS["scale_tma_only"] = [(NEW_SCALE, CONST_SCALE)]
VARIANTS["scale_lds_only"] = NOSCALE[:2]
# the previous order: the MMA issued, then the scales read (ptxas puts their loads between the wgmma instructions)
VARIANTS["scale_after"] = [(
    """        scale = _group_scales(a_scale_bufs, b_scale_bufs, slot, k, HALF, gl.SliceLayout(1, mma_layout))
        product = _issue_mma(a_bufs, b_bufs, slot, product, HALF)""",
    """        product = _issue_mma(a_bufs, b_bufs, slot, product, HALF)
        scale = _group_scales(a_scale_bufs, b_scale_bufs, slot, k, HALF, gl.SliceLayout(1, mma_layout))""")]
# the scales read after the group's MMA retired, just before the promotion (their shared loads never meet this
# warpgroup's wgmma operand reads)
VARIANTS["scale_late"] = [(
    """        scale = _group_scales(a_scale_bufs, b_scale_bufs, slot, k, HALF, gl.SliceLayout(1, mma_layout))
        product = _issue_mma(a_bufs, b_bufs, slot, product, HALF)
        product = _retire(product, empty, step + k - first_k, NUM_STAGES, 0)""",
    """        product = _issue_mma(a_bufs, b_bufs, slot, product, HALF)
        product = warpgroup_mma_wait(num_outstanding=0, deps=(product, ))
        scale = _group_scales(a_scale_bufs, b_scale_bufs, slot, k, HALF, gl.SliceLayout(1, mma_layout))
        _barrier()
        mbarrier.arrive(empty.index(slot))""")]
