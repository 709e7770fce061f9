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
