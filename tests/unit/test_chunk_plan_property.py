"""The AllGather's chunk plan (who pulls which rows, which flag it sets) is the fused kernel's chunk geometry
(which rows a chunk flag covers): a split that differs leaves rows that no flag covers, or a flag that is
never set. Property test over odd rows per rank (the last chunk shorter or empty) and 2-4 chunks."""

from hypothesis import given, settings
from hypothesis import strategies as st

from tp_overlap.kernels.constants import ag_chunk_index, ag_chunk_rows
from tp_overlap.ops.ag_chunks import plan_chunks


@settings(max_examples=300, deadline=None, derandomize=True, database=None)
@given(world=st.integers(1, 8), half=st.integers(0, 200), chunks=st.integers(2, 4), data=st.data())
def test_the_plan_splits_every_owner_exactly_as_the_fused_kernel_maps_rows_to_chunks(world, half, chunks, data):
    rows = 2 * half + 1   # odd rows per rank
    rank = data.draw(st.integers(0, world - 1))
    plan = plan_chunks(rank=rank, world_size=world, m=rows * world, chunks_per_rank=chunks)
    # every chunk the kernel has rows for is planned once, with the kernel's rows, and nothing else is
    kernel = {index: ag_chunk_rows(index, rows, chunks) for index in range(world * chunks)}
    assert {c.flag_index: (c.first_row, c.num_rows) for c in plan} == \
        {index: span for index, span in kernel.items() if span[1] > 0}
    assert len({c.flag_index for c in plan}) == len(plan)
    for chunk in plan:
        assert chunk.owner == chunk.flag_index // chunks
        # each of its rows maps to its flag in the kernel
        for row in {chunk.first_row, chunk.first_row + chunk.num_rows - 1}:
            assert ag_chunk_index(row, rows, chunks) == chunk.flag_index
    # arrival order: this rank's chunks first, then the owners in ring order from rank + 1
    owners = [c.owner for c in plan]
    assert owners == sorted(owners, key=lambda o: (o - rank) % world)
