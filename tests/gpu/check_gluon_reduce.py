"""GPU checks of the Gluon scatter-reduce GEMM (kernels/gemm_gluon_reduce.py, GemmRs `epilogue_reduce`) in one
process: W ranks' partials buffers, flags and output shards on one GPU, their kernels launched at once on W
streams (each on at most (SMs - 4) / W programs: all resident), one PASS/FAIL line per check, exit status 1 on
any FAIL.

    python -m tests.gpu.check_gluon_reduce              # on the GPU machine (~30 s)

Every buffer and output starts as NaN. After the W launches: each rank's output shard is the sum over every
rank's a @ w of its rows (relative Frobenius error <= 1e-2 against fp64), each other source's slab in a rank's
buffer holds that source's rows bitwise as the Gluon GEMM computes them, the rank's own slab is never written,
every flag of another source for the rank's row blocks holds M and its own stay zero, tile counters are back at
zero and no error is recorded: 2, 4 and 8 ranks, both layouts, 128- and 256-wide tiles, a column tail. A source
that never runs: the others' own tiles give up within the bound, with that source's flag code.
"""

from __future__ import annotations

import os
import sys
import time

# a hardware queue per stream (8 by default): W ranks' kernels that shared one would run one after another, and
# the first rank's waits would expire
os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "32")

import torch  # noqa: E402

from tests.gpu.checklist import Checks, cuda_device, expect, rel  # noqa: E402

check = Checks()
# (W, rows per rank (a multiple of 128), K, N, layout, blocks)
CASES = ((2, 256, 512, 1000, "kn", "128x256x64w4s3gl"), (4, 256, 512, 1024, "nk", "128x128x64w4s6gl"),
         (8, 128, 264, 136, "nk", "128x128x64w4s6gl"), (4, 384, 1024, 776, "kn", "128x128x64w4s6gl"),
         (2, 512, 2048, 2048, "nk", "128x256x64w4s3gl"))
CODE_BASE = 1000


def main(argv=None) -> int:
    dev = cuda_device(argv, "the Gluon scatter-reduce GEMM")
    if dev is None:
        return 1
    from tp_overlap.gemm import GemmBlocks, Scatter, num_sms
    from tp_overlap.gemm.gluon_launch import (launch_gluon_gemm, launch_gluon_scatter_reduce, reduce_descriptors,
                                              scatter_descriptors)
    from tp_overlap.gemm.launch import b_operand
    from tp_overlap.kernels.constants import ROW_BLOCK_M, scatter_flags_per_source

    gen = torch.Generator(device=dev).manual_seed(0)

    def ranks(world, rows, k, n, layout, timeout_s=5.0):
        """Every rank's operands, buffers and Scatter record, as GemmRs lays them out."""
        m, fps = world * rows, scatter_flags_per_source(rows)
        state = []
        for _ in range(world):
            a = torch.randn(m, k, generator=gen, device=dev).bfloat16()
            w = (torch.randn(n, k, generator=gen, device=dev) / k ** 0.5).bfloat16()
            state.append(dict(a=a, w=w.t() if layout == "nk" else w.t().contiguous(),
                              slots=torch.full((world, rows, n), float("nan"), dtype=torch.bfloat16, device=dev),
                              flags=torch.zeros(world * fps, dtype=torch.int32, device=dev),
                              counters=torch.zeros(-(-m // ROW_BLOCK_M) + 1, dtype=torch.int32, device=dev),
                              errors=torch.zeros(8, dtype=torch.int32, device=dev),
                              out=torch.full((rows, n), float("nan"), dtype=torch.bfloat16, device=dev)))
        dst_ptrs = torch.tensor([s["slots"].data_ptr() for s in state], dtype=torch.int64, device=dev)
        flag_ptrs = torch.tensor([s["flags"].data_ptr() for s in state], dtype=torch.int64, device=dev)
        for r, s in enumerate(state):
            s["scatter"] = Scatter(dst_ptrs=dst_ptrs, flag_ptrs=flag_ptrs, tile_counters=s["counters"],
                                   rows_per_rank=rows, src_rank=r, flags_per_source=fps, error_words=s["errors"],
                                   error_code_base=CODE_BASE, timeout_s=timeout_s)
        return state

    def launch_all(state, blocks, launched):
        world = len(state)
        programs = (num_sms(dev) - 4) // world
        streams = [torch.cuda.Stream(dev) for _ in range(world)]
        torch.cuda.synchronize(dev)
        for r in launched:
            s = state[r]
            descriptors = scatter_descriptors([o["slots"][r] for o in state], blocks)
            own = reduce_descriptors(s["slots"], blocks)
            expect(descriptors is not None and own is not None, "TMA refused the slots")
            with torch.cuda.stream(streams[r]):
                launch_gluon_scatter_reduce(a=s["a"], w=s["w"], out=s["out"], descriptors=descriptors,
                                            own_descriptor=own, scatter=s["scatter"], blocks=blocks,
                                            num_programs=programs)
        torch.cuda.synchronize(dev)

    def verify(state, blocks, what):
        world, (rows, n) = len(state), state[0]["out"].shape
        m, fps = world * rows, scatter_flags_per_source(rows)
        products = []
        for s in state:  # each source's rows as the Gluon GEMM computes them (bf16)
            b, _, transposed = b_operand(s["w"])
            full = torch.empty(m, n, dtype=torch.bfloat16, device=dev)
            launch_gluon_gemm(a=s["a"], b=b, b_transposed=transposed, out=full, blocks=blocks,
                              num_programs=num_sms(dev))
            products.append(full)
        exact = sum(s["a"].double() @ s["w"].double() for s in state)
        torch.cuda.synchronize(dev)
        for r, s in enumerate(state):
            lo = r * rows
            expect(s["errors"][0].item() == 0, f"{what}: rank {r} recorded {s['errors'].tolist()}")
            err = rel(s["out"], exact[lo:lo + rows])
            expect(err <= 1e-2, f"{what}: rank {r}'s shard is {err:.3g} from the sum")
            for src in range(world):
                slab = s["slots"][src]
                if src == r:
                    expect(torch.isnan(slab).all(), f"{what}: rank {r}'s own slab was written")
                else:
                    want = products[src][lo:lo + rows]
                    expect(torch.equal(slab, want), f"{what}: rank {r}'s slab of {src} differs in "
                           f"{(slab != want).sum().item()} values")
            want = torch.zeros(world * fps, dtype=torch.int32, device=dev)
            for src in range(world):
                if src != r:
                    want[src * fps:src * fps + rows // ROW_BLOCK_M] = m
            expect(torch.equal(s["flags"], want), f"{what}: rank {r}'s flags {s['flags'].tolist()}")
            expect(int(s["counters"].abs().sum()) == 0, f"{what}: rank {r}'s counters {s['counters'].tolist()}")
        return max(rel(s["out"], exact[r * rows:(r + 1) * rows]) for r, s in enumerate(state))

    @check("W ranks at once: shards the sum of every rank's rows, slabs bitwise, own slab untouched, flags hold "
           "M, counters back at zero")
    def _():
        notes = []
        for world, rows, k, n, layout, name in CASES:
            blocks = GemmBlocks.parse(name)
            state = ranks(world, rows, k, n, layout)
            launch_all(state, blocks, range(world))
            what = f"{name} {layout} W={world} rows={rows} K={k} N={n}"
            notes.append(f"{what}: {verify(state, blocks, what):.1e}")
        return "; ".join(notes)

    @check("a source that never runs: the other ranks' own tiles give up within the bound, with its flag's code")
    def _():
        world, rows, blocks = 2, 256, GemmBlocks.parse("128x128x64w4s6gl")
        fps = scatter_flags_per_source(rows)
        # compiled first (a 0.5 s bound is an int32 argument: another build than 5 s), source 1's flags set
        warm = ranks(world, rows, 512, 512, "nk", timeout_s=0.5)
        warm[0]["flags"][fps:fps + rows // ROW_BLOCK_M] = world * rows
        launch_all(warm, blocks, [0])
        expect(warm[0]["errors"][0].item() == 0, f"warm-up: control page {warm[0]['errors'].tolist()}")
        state = ranks(world, rows, 512, 512, "nk", timeout_s=0.5)
        start = time.monotonic()
        launch_all(state, blocks, [0])  # rank 1 never launches
        elapsed = time.monotonic() - start
        code, waited = state[0]["errors"][0].item(), state[0]["errors"][1].item()
        expect(CODE_BASE + fps <= code < CODE_BASE + fps + rows // ROW_BLOCK_M and waited == 1,
               f"control page {state[0]['errors'].tolist()}, expected a code of source 1's flags")
        expect(elapsed < 0.8, f"the kernel took {elapsed:.2f} s (bound 0.5 s)")
        expect(torch.isnan(state[0]["out"]).all(), "a shard was stored without every source's partial")
        return f"ended after {elapsed:.2f} s with code {code}"

    return check.summary()


if __name__ == "__main__":
    sys.exit(main())
