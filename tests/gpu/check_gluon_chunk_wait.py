"""GPU checks of the Gluon GEMM's chunk wait (kernels/gemm_gluon_wait.py, the fused AllGather consumer's
kernel): one PASS/FAIL line per check, exit status 1 on any FAIL.

    python -m tests.gpu.check_gluon_chunk_wait     # on the GPU machine, one process (~20 s)

The gathered A starts as NaN; another stream writes each chunk's rows late, in arrival order, and sets its
flag after them, while the GEMM (SMs left free for that stream) runs: the output must equal the same GEMM on
the final rows without waits, bitwise, for both layouts, odd rows per rank, an owner whose trailing
chunk is empty (never signalled) and split tails (`sk1`: the pieces of a tile each wait for its rows). A flag
never set: the kernel still ends, within its bound of %globaltimer (0.8 s allowed for 0.5 s), with the
chunk's error code in the control page; with the abort word set it ends at once. The FP8 Gluon kernel
(kernels/gemm_fp8_gluon.py) likewise, its rows and scales written late, with and without a split tail.
"""

from __future__ import annotations

import sys
import time

import torch

from tests.gpu.checklist import Checks, cuda_device, expect

check = Checks()
MARGIN = 16  # SMs the GEMM leaves to the stream that writes the chunks


def main(argv=None) -> int:
    dev = cuda_device(argv, "the Gluon chunk wait")
    if dev is None:
        return 1
    from tp_overlap.gemm import ChunkWait, GemmBlocks, num_sms
    from tp_overlap.gemm.gluon_launch import launch_gluon_gemm, split_buffers
    from tp_overlap.gemm.launch import b_operand
    from tp_overlap.kernels.constants import ag_chunk_rows, ag_tile_row_offset

    gen = torch.Generator(device=dev).manual_seed(0)
    programs = num_sms(dev) - MARGIN
    writer = torch.cuda.Stream(dev)

    def setup(world, rows, chunks, k, n, layout):
        m = world * rows
        final = torch.randn(m, k, generator=gen, device=dev).bfloat16()
        w = (torch.randn(n, k, generator=gen, device=dev) / k ** 0.5).bfloat16()
        w = w.t() if layout == "nk" else w.t().contiguous()
        gathered = torch.full((m, k), float("nan"), dtype=torch.bfloat16, device=dev)
        flags = torch.zeros(world * chunks, dtype=torch.int32, device=dev)
        errors = torch.zeros(8, dtype=torch.int32, device=dev)
        return final, w, gathered, flags, errors

    splits = split_buffers(dev, programs)  # a split tail's pieces (`sk1`), as the op owns them

    def launch(gathered, w, out, blocks, rank, rows, chunks, flags, errors, timeout_s):
        b, _, transposed = b_operand(w)
        wait = ChunkWait(flags=flags, rows_per_rank=rows, chunks_per_rank=chunks, error_words=errors,
                         error_code_base=1000, timeout_s=timeout_s)
        launch_gluon_gemm(a=gathered, b=b, b_transposed=transposed, out=out, blocks=blocks, num_programs=programs,
                          tile_row_offset=ag_tile_row_offset(rank, rows, blocks.block_m), chunk_wait=wait,
                          split_buffers=splits)

    def expected(final, w, blocks, rank, rows):
        """The same launch without waits: the same row rotation, so the same tiles are split (bitwise)."""
        b, _, transposed = b_operand(w)
        out = torch.empty(final.shape[0], w.shape[1], dtype=torch.bfloat16, device=dev)
        launch_gluon_gemm(a=final, b=b, b_transposed=transposed, out=out, blocks=blocks, num_programs=programs,
                          tile_row_offset=ag_tile_row_offset(rank, rows, blocks.block_m), split_buffers=splits)
        return out

    def late_chunks(world, rows, chunks, rank, final, gathered, flags, skip=()):
        """On `writer`: after a sleep, each owner's chunks in ring order from rank + 1 (the local one first),
        rows then flag; empty chunks get no flag; chunks in `skip` are never written."""
        with torch.cuda.stream(writer):
            torch.cuda._sleep(2_000_000)  # ~1 ms: the GEMM is waiting before the first rows land
            for step in range(world):
                owner = (rank + step) % world
                for c in range(chunks):
                    index = owner * chunks + c
                    first, count = ag_chunk_rows(index, rows, chunks)
                    if count == 0 or index in skip:
                        continue
                    gathered[first:first + count].copy_(final[first:first + count])
                    flags[index:index + 1].fill_(1)

    @check("late chunks, written while the GEMM waits: bitwise the GEMM without waits (both layouts, tails, "
           "split tails)")
    def _():
        notes = []
        for world, rows, chunks, k, n, layout, name in (
                (4, 300, 3, 1024, 1536, "kn", "128x256x64w4s3gl"), (4, 300, 3, 1024, 1536, "nk", "128x128x64w4s6gl"),
                (8, 9, 4, 264, 136, "kn", "128x128x64w4s6gl"), (2, 1000, 2, 2048, 776, "nk", "192x128x64w4s4gl"),
                (4, 300, 3, 4096, 1536, "nk", "128x128x64w4s6sk1gl"),
                (2, 256, 2, 4096, 1024, "kn", "128x256x64w4s3sk1gl")):
            blocks = GemmBlocks.parse(name)
            for rank in (0, world - 1):
                final, w, gathered, flags, errors = setup(world, rows, chunks, k, n, layout)
                out = torch.full((world * rows, w.shape[1]), float("nan"), dtype=torch.bfloat16, device=dev)
                ref = expected(final, w, blocks, rank, rows)
                torch.cuda.synchronize(dev)
                late_chunks(world, rows, chunks, rank, final, gathered, flags)
                launch(gathered, w, out, blocks, rank, rows, chunks, flags, errors, timeout_s=10)
                torch.cuda.synchronize(dev)
                expect(errors[0].item() == 0, f"{name} W={world} rank {rank}: error code {errors[0].item()}")
                expect(torch.equal(out, ref), f"{name} {layout} W={world} rows={rows} rank {rank}: "
                       f"{(out != ref).sum().item()} values differ from the GEMM without waits")
                expect(int(splits[1].abs().sum()) == 0, f"{name}: split counters left at {splits[1].tolist()}")
            notes.append(f"{name} {layout} W={world} rows/rank={rows} chunks={chunks}")
        return "; ".join(notes)

    @check("a flag never set: the kernel ends within the bound with the chunk's code; abort word: ends at once")
    def _():
        world, rows, chunks, blocks = 4, 256, 2, GemmBlocks.parse("128x256x64w4s3gl")
        notes = []
        # untimed, every flag set: a 0.5 s bound passes timeout_ns as int32 where the other checks' 10 s pass
        # int64, so the first launch with it JIT-compiles (~2 s on an H100), which is not the wait's time
        final, w, gathered, flags, errors = setup(world, rows, chunks, 512, 1024, "kn")
        late_chunks(world, rows, chunks, 0, final, gathered, flags)
        launch(gathered, w, torch.empty(world * rows, 1024, dtype=torch.bfloat16, device=dev), blocks, 0, rows,
               chunks, flags, errors, timeout_s=0.5)
        torch.cuda.synchronize(dev)
        expect(errors[0].item() == 0, f"the warm-up launch recorded error code {errors[0].item()}")
        for abort in (False, True):
            final, w, gathered, flags, errors = setup(world, rows, chunks, 512, 1024, "kn")
            errors[2] = int(abort)
            out = torch.empty(world * rows, 1024, dtype=torch.bfloat16, device=dev)
            missing = 5  # owner 2's second chunk
            torch.cuda.synchronize(dev)
            start = time.monotonic()
            late_chunks(world, rows, chunks, 0, final, gathered, flags, skip=(missing,))
            launch(gathered, w, out, blocks, 0, rows, chunks, flags, errors, timeout_s=0.5)
            torch.cuda.synchronize(dev)
            elapsed = time.monotonic() - start
            code, waited = errors[0].item(), errors[1].item()
            # aborted, the first wait to give up records its chunk, whichever it is
            right = 1000 <= code < 1000 + world * chunks if abort else code == 1000 + missing
            expect(right and waited == 1, f"abort={abort}: control page {errors.tolist()}")
            expect(elapsed < (0.5 if abort else 0.8), f"abort={abort}: the kernel took {elapsed:.2f} s")
            notes.append(f"{'abort word set' if abort else 'bound 0.5 s'}: ended after {elapsed:.2f} s, code ok")
        return "; ".join(notes)

    @check("FP8 Gluon consumer: rows and scales written late, bitwise the same kernel without waits (split tails "
           "too); a lost flag")
    def _():
        from tp_overlap.gemm import fp8
        from tp_overlap.gemm.fp8_gluon_launch import SPLIT_BUILD_SLOWDOWN
        from tp_overlap.gemm.gluon_launch import split_tail

        notes = []
        for name, world, rows, chunks, k, n in (("128x128x128w4s4gl", 4, 300, 3, 1024, 1536),
                                                ("128x128x128w4s4gl", 8, 64, 2, 512, 640),
                                                ("128x128x128w4s4sk1gl", 4, 300, 3, 8192, 1536),
                                                ("128x256x128w4s3gl", 4, 300, 3, 1024, 1664)):
            blocks, m = GemmBlocks.parse(name), world * rows
            cut = split_tail(blocks, m, n, k, programs, dev, splits, operand_bytes=1,
                             split_build_slowdown=SPLIT_BUILD_SLOWDOWN)[2]  # as the launcher plans it
            expect(cut > 1 or not blocks.stream_k, f"{name} M={m} N={n} K={k}: no split on {programs} programs")
            x8, xs = fp8.quantize_activation(torch.randn(m, k, generator=gen, device=dev))
            w8, ws = fp8.quantize_weight(torch.randn(n, k, generator=gen, device=dev) / k ** 0.5)
            for rank in (0, world - 1):
                # the same row rotation without waits: the same tiles are split (bitwise)
                ref = fp8.fp8_gemm(a8=x8, a_scales=xs, w8=w8, w_scales=ws, blocks=blocks, num_programs=programs,
                                   tile_row_offset=ag_tile_row_offset(rank, rows, 128), split_buffers=splits)
                g8, gs = torch.zeros_like(x8), torch.full_like(xs, float("nan"))
                flags = torch.zeros(world * chunks, dtype=torch.int32, device=dev)
                errors = torch.zeros(8, dtype=torch.int32, device=dev)
                torch.cuda.synchronize(dev)
                with torch.cuda.stream(writer):
                    torch.cuda._sleep(2_000_000)
                    for step in range(world):
                        for c in range(chunks):
                            index = ((rank + step) % world) * chunks + c
                            first, count = ag_chunk_rows(index, rows, chunks)
                            if count:
                                g8[first:first + count].copy_(x8[first:first + count])
                                gs[first:first + count].copy_(xs[first:first + count])
                                flags[index:index + 1].fill_(1)
                wait = ChunkWait(flags=flags, rows_per_rank=rows, chunks_per_rank=chunks, error_words=errors,
                                 error_code_base=1000, timeout_s=10)
                out = fp8.fp8_gemm(a8=g8, a_scales=gs, w8=w8, w_scales=ws, blocks=blocks, num_programs=programs,
                                   chunk_wait=wait, tile_row_offset=ag_tile_row_offset(rank, rows, 128),
                                   split_buffers=splits)
                torch.cuda.synchronize(dev)
                expect(errors[0].item() == 0, f"{name} W={world} rank {rank}: error code {errors[0].item()}")
                expect(torch.equal(out, ref), f"{name} W={world} rank {rank}: {(out != ref).sum().item()} values "
                       "differ")
                expect(int(splits[1].abs().sum()) == 0, f"{name}: split counters left at {splits[1].tolist()}")
            notes.append(f"{name} W={world} rows/rank={rows} chunks={chunks}" + (f", {cut} splits" if cut > 1 else ""))
        flags[:] = 1
        flags[1] = 0
        errors.zero_()
        fp8.fp8_gemm(a8=g8, a_scales=gs, w8=w8, w_scales=ws, blocks=blocks, num_programs=programs,
                     chunk_wait=ChunkWait(flags=flags, rows_per_rank=rows, chunks_per_rank=chunks, error_words=errors,
                                          error_code_base=1000, timeout_s=0.2), split_buffers=splits)
        torch.cuda.synchronize(dev)
        expect(errors[0].item() == 1001, f"a lost flag: control page {errors.tolist()}")
        return "; ".join(notes) + "; a lost flag recorded"

    return check.summary()


if __name__ == "__main__":
    sys.exit(main())
