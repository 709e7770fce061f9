"""GPU correctness of the split-K bf16 GEMM (kernels/gemm_splitk.py through overlap.triton_mm), compiled (not
the interpreter): one PASS/FAIL line per check with its error, exit status 1 on any FAIL.

    python -m tests.gpu.check_splitk            # on the GPU machine (~1 min, mostly compiling)
    TRITON_INTERPRET=1 python -m tests.gpu.check_splitk --cpu   # tiny shapes under the Triton interpreter: checks the script

Checks, every output NaN-poisoned before the call, against an fp64 product and torch.mm (relative Frobenius
<= 1e-2): every split-K candidate of the tuner in both weight layouts, three calls in a row with fresh operands
(the tile counters back at zero after each), bitwise equal on a repeat with the same operands (the sum order
does not depend on which split arrives last); 32 calls queued back to back into 32 outputs, all bitwise equal;
M/N/K tails (K not a multiple of S * BLOCK_K) on the TMA path and unaligned K on the pointer path; a grid
capped below the units (persistent programs) with a row rotation; replays of a captured CUDA graph with new
operands.
"""

from __future__ import annotations

import sys

import torch

from tests.gpu.checklist import Checks, expect, graph_replays_right, rel, target_device

TOLERANCE = 1e-2
check = Checks()


# (full size on the GPU, tiny under the interpreter): M, N, K
SHAPES = {"main": (1024, 768, 4096), "tails": ((1000, 776, 4104), (136, 1288, 8200)), "unaligned": (520, 384, 4100),
          "capped": (4096, 1280, 8192), "graph": (2048, 768, 4096)}
TINY = {"main": (48, 40, 256), "tails": ((37, 40, 200),), "unaligned": (40, 24, 100), "capped": (64, 48, 256),
        "graph": (48, 40, 256)}


def main(argv=None) -> int:
    dev = target_device(argv)
    if dev is None:
        return 1
    cpu = dev.type == "cpu"
    from tp_overlap.launch.measure.tune import SPLIT_K_CANDIDATES
    from tp_overlap.gemm.blocks import GemmBlocks
    from tp_overlap.gemm import split_k_workspace, triton_mm

    shapes = TINY if cpu else SHAPES
    names = ("16x16x16w1s1sp2", "32x16x16w1s1sp4") if cpu else SPLIT_K_CANDIDATES
    tails_names = names if cpu else ("128x128x64w4s3sp4", "128x64x64w4s4sp8", "64x64x64w4s4sp2")
    gen = torch.Generator(device=dev).manual_seed(0)

    def operands(m, n, k, layout):
        a = torch.randn(m, k, generator=gen, device=dev).bfloat16()
        w = (torch.randn(n, k, generator=gen, device=dev) / k ** 0.5).bfloat16()
        return a, (w.t() if layout == "nk" else w.t().contiguous())

    def run(a, b, blocks, **kwargs):
        out = torch.full((a.shape[0], b.shape[1]), float("nan"), dtype=torch.bfloat16, device=dev)
        triton_mm(a, b, out, blocks=blocks, **kwargs)
        return out

    def verify(out, a, b, what):
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        expect(not torch.isnan(out).any(), f"{what}: NaN left in the output (a tile never stored)")
        err, err_mm = rel(out, a.double() @ b.double()), rel(out, torch.mm(a, b))
        expect(err <= TOLERANCE and err_mm <= TOLERANCE, f"{what}: {err:.3g} vs fp64, {err_mm:.3g} vs torch.mm")
        return err

    def counters_zero(m, n, blocks, what):
        counters = split_k_workspace(dev, m, n, blocks)[1]
        expect(int(counters.abs().sum().item()) == 0, f"{what}: counters left at {counters.nonzero().flatten()[:8]}")

    @check("every split-K candidate, both layouts: 3 calls with fresh operands, counters at zero, repeat bitwise")
    def _():
        worst = 0.0
        m, n, k = shapes["main"]
        for name in names:
            blocks = GemmBlocks.parse(name)
            for layout in ("kn", "nk"):
                for call in range(3):
                    a, b = operands(m, n, k, layout)
                    out = run(a, b, blocks)
                    worst = max(worst, verify(out, a, b, f"{name} {layout} call {call}"))
                    counters_zero(m, n, blocks, f"{name} {layout} call {call}")
                again = run(a, b, blocks)
                verify(again, a, b, f"{name} {layout} repeat")
                expect(torch.equal(out, again), f"{name} {layout}: a repeat with the same operands differs")
        return f"{len(names)} configurations, worst {worst:.2e}"

    @check("32 calls queued back to back: every output bitwise equal and right, counters at zero")
    def _():
        m, n, k = shapes["main"]
        blocks = GemmBlocks.parse(names[-1] if cpu else "128x128x64w4s3sp4")
        a, b = operands(m, n, k, "nk")
        outs = [run(a, b, blocks) for _ in range(4 if cpu else 32)]
        verify(outs[0], a, b, blocks.name)
        expect(all(torch.equal(outs[0], o) for o in outs[1:]), f"{blocks.name}: queued calls differ")
        counters_zero(m, n, blocks, blocks.name)
        return blocks.name

    @check("M/N/K tails (TMA path, K not a multiple of S * BLOCK_K) and unaligned K (pointer path)")
    def _():
        worst = 0.0
        cases = [(shape, name) for shape in shapes["tails"] for name in tails_names]
        cases.append((shapes["unaligned"], tails_names[0]))
        for (m, n, k), name in cases:
            blocks = GemmBlocks.parse(name)
            for layout in ("kn", "nk"):
                a, b = operands(m, n, k, layout)
                worst = max(worst, verify(run(a, b, blocks), a, b, f"{name} {layout} M={m} N={n} K={k}"))
                counters_zero(m, n, blocks, f"{name} {layout} M={m} N={n} K={k}")
        return f"{len(cases)} cases, worst {worst:.2e}"

    @check("a grid capped below the units (persistent programs) with a row rotation")
    def _():
        m, n, k = shapes["capped"]
        blocks = GemmBlocks.parse(names[0])
        for programs, offset in ((3, 1), (100, 5)):
            a, b = operands(m, n, k, "nk")
            verify(run(a, b, blocks, num_programs=programs, tile_row_offset=offset), a, b,
                   f"{blocks.name} programs={programs} offset={offset}")
            counters_zero(m, n, blocks, f"programs={programs}")
        return blocks.name

    if not cpu:
        @check("a captured CUDA graph replays right with new operands (workspace from the warm-up)")
        def _():
            m, n, k = shapes["graph"]
            blocks = GemmBlocks.parse(names[0])
            a, b = operands(m, n, k, "nk")
            out = torch.empty(m, n, dtype=torch.bfloat16, device=dev)
            graph_replays_right(lambda: triton_mm(a, b, out, blocks=blocks), a, b, out,
                                lambda: operands(m, n, k, "nk"), verify)
            return blocks.name

    return check.summary()


if __name__ == "__main__":
    sys.exit(main())
