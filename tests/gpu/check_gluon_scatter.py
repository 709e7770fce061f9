"""GPU checks of the Gluon scatter GEMM (kernels/gemm_gluon_scatter.py, GemmRs `fused`) in one process: W owners'
partials buffers and flags on one GPU, one PASS/FAIL line per check, exit status 1 on any FAIL.

    python -m tests.gpu.check_gluon_scatter              # on the GPU machine (~30 s), every case
    python -m tests.gpu.check_gluon_scatter --case 4     # one case (a fault ends the process's CUDA context)

Every owner's buffer starts as NaN. After a launch as source `src`: each owner's slab of `src` holds that
owner's rows of A @ W bitwise as the Gluon GEMM without scatter computes them, every other slab is still NaN
(a slab straddling two owners wrote nothing across), every row-block flag of `src` that the owner's rows touch
holds M and no other flag was written, and the tile counters are back at zero: 2 to 8 owners, rows per rank a
multiple of 128 and not (straddling slabs, fewer rows than a slab), both layouts, N with a column tail; split
tails (`sk1`: every tile split, straddling slabs among them; a partial last wave split), the split counters
back at zero too; tiles two B boxes wide (kernels/gemm_gluon_scatter_boxes.py: 144, 160, 192 columns).
"""

from __future__ import annotations

import sys

import torch

from tests.gpu.checklist import Checks, cuda_device, expect

check = Checks()
# (W, rows per rank, K, N, layout, source, blocks): whole 128-row blocks first, then straddling slabs, column
# tails, every owner's descriptor, the smoke's shape
CASES = ((2, 256, 256, 256, "kn", 0, "128x128x64w4s6gl"), (8, 256, 256, 256, "nk", 5, "128x128x64w4s6gl"),
         (4, 300, 512, 1000, "kn", 1, "128x256x64w4s3gl"), (4, 256, 512, 1000, "nk", 3, "128x256x64w4s3gl"),
         (8, 100, 264, 136, "nk", 0, "128x128x64w4s6gl"), (2, 1000, 1024, 776, "kn", 1, "128x128x64w4s6gl"),
         (2, 100, 264, 136, "kn", 1, "128x256x64w4s3gl"), (4, 100, 2048, 1000, "nk", 2, "128x128x64w4s6sk1gl"),
         (4, 300, 2048, 1664, "kn", 3, "128x128x64w4s6sk1gl"), (2, 512, 4096, 1024, "nk", 0, "128x256x64w4s3sk1gl"),
         (4, 300, 512, 1000, "nk", 1, "128x144x64w4s5gl"), (8, 100, 264, 136, "kn", 0, "128x160x64w4s5gl"),
         (2, 1000, 1024, 776, "kn", 1, "128x192x64w4s4gl"), (8, 128, 1792, 4096, "nk", 6, "128x144x64w4s5gl"))


def _cases(argv) -> tuple:
    """Every case, or those of `--case i[,j...]` (one per process: an illegal instruction ends the context)."""
    args = list(argv if argv is not None else sys.argv[1:])
    if "--case" not in args:
        return CASES
    return tuple(CASES[int(i)] for i in args[args.index("--case") + 1].split(","))


def main(argv=None) -> int:
    dev = cuda_device(argv, "the Gluon scatter GEMM")
    if dev is None:
        return 1
    from tp_overlap.gemm import GemmBlocks, Scatter, num_sms
    from tp_overlap.gemm.gluon_launch import launch_gluon_gemm, launch_gluon_scatter, scatter_descriptors, split_buffers
    from tp_overlap.gemm.gluon_launch import split_plan
    from tp_overlap.gemm.launch import b_operand
    from tp_overlap.kernels.constants import ROW_BLOCK_M, scatter_flags_per_source

    gen = torch.Generator(device=dev).manual_seed(0)
    programs = num_sms(dev) - 16

    def one_case(world, rows, k, n, layout, src, blocks, buffers, flags, counters, splits):
        m = world * rows
        a = torch.randn(m, k, generator=gen, device=dev).bfloat16()
        w = (torch.randn(n, k, generator=gen, device=dev) / k ** 0.5).bfloat16()
        w = w.t() if layout == "nk" else w.t().contiguous()
        views = [buf[:world * rows * n].view(world, rows, n) for buf in buffers[:world]]
        for buf in buffers:
            buf.fill_(float("nan"))
        for f in flags:
            f.zero_()
        fps = scatter_flags_per_source(rows)
        flag_ptrs = torch.tensor([f.data_ptr() for f in flags], dtype=torch.int64, device=dev)
        dst_ptrs = torch.tensor([v.data_ptr() for v in views], dtype=torch.int64, device=dev)
        scatter = Scatter(dst_ptrs=dst_ptrs, flag_ptrs=flag_ptrs, tile_counters=counters, rows_per_rank=rows,
                          src_rank=src, flags_per_source=fps, error_words=counters, error_code_base=0, timeout_s=1.0)
        descriptors = scatter_descriptors([v[src] for v in views], blocks)
        expect(descriptors is not None, "TMA refused the slabs")
        launch_gluon_scatter(a=a, w=w, descriptors=descriptors, scatter=scatter, blocks=blocks, num_programs=programs,
                             tile_row_offset=((src + 1) % world) * rows // ROW_BLOCK_M, split_buffers=splits)
        b, _, transposed = b_operand(w)
        ref = torch.empty(m, n, dtype=torch.bfloat16, device=dev)
        # the same split plan (the same buffers): the sum of a split tile's pieces is bitwise the same
        launch_gluon_gemm(a=a, b=b, b_transposed=transposed, out=ref, blocks=blocks, num_programs=programs,
                          split_buffers=splits)
        torch.cuda.synchronize(dev)
        what = f"{blocks.name} {layout} W={world} rows={rows} N={n} src={src}"
        if blocks.stream_k:
            tiles = -(-m // 128) * -(-n // blocks.block_n)
            whole, pieces = split_plan(tiles, programs, -(-k // 64), 2 * 128 * blocks.block_n * k,
                                       splits[0].numel() // (128 * blocks.block_n))
            expect(pieces > 1, f"{what}: no split tail ({tiles} tiles on {programs} programs)")
            expect(int(splits[1].abs().sum()) == 0, f"{what}: split counters left at {splits[1].tolist()}")
            what += f" ({whole} whole + {tiles - whole} x {pieces})"
        for owner, view in enumerate(views):
            mine = view[src]
            want_rows = ref[owner * rows:(owner + 1) * rows]
            expect(torch.equal(mine, want_rows),
                   f"{what}: owner {owner}'s slab differs in {(mine != want_rows).sum()} values")
            others = torch.cat([view[s] for s in range(world) if s != src])
            expect(torch.isnan(others).all(), f"{what}: owner {owner}: another source's slab was written")
            first_block, last_block = owner * rows // ROW_BLOCK_M, ((owner + 1) * rows - 1) // ROW_BLOCK_M
            want = torch.zeros(world * fps, dtype=torch.int32, device=dev)
            first_flag = src * fps
            want[first_flag:first_flag + last_block - first_block + 1] = m
            got = flags[owner][:world * fps]
            expect(torch.equal(got, want), f"{what}: owner {owner}'s flags {got.tolist()}, expected {want.tolist()}")
        expect(int(counters.abs().sum()) == 0, f"{what}: tile counters left at {counters.tolist()}")
        return what

    @check("slabs bitwise the GEMM's rows, nothing across owners, flags hold M, counters back at zero")
    def _():
        notes = []
        buffers = [torch.empty(8 * 1024 * 1024, dtype=torch.bfloat16, device=dev) for _ in range(8)]
        flags = [torch.zeros(1024, dtype=torch.int32, device=dev) for _ in range(8)]
        counters = torch.zeros(1024, dtype=torch.int32, device=dev)
        splits = split_buffers(dev, programs)
        for world, rows, k, n, layout, src, name in _cases(argv):
            notes.append(one_case(world, rows, k, n, layout, src, GemmBlocks.parse(name), buffers, flags, counters,
                                  splits))
        return "; ".join(notes)

    return check.summary()


if __name__ == "__main__":
    sys.exit(main())
