"""GPU correctness of the Gluon bf16 GEMM (kernels/gemm_gluon.py through overlap.triton_mm): one PASS/FAIL line
per check with its error, exit status 1 on any FAIL.

    python -m tests.gpu.check_gluon_gemm          # on the GPU machine (~30 s, mostly compiling)

Checks, every output inside a NaN-filled buffer, against an fp64 product and torch.mm (relative Frobenius
<= 1e-2): every Gluon candidate of the tuner (the two-box kernels/gemm_gluon_boxes.py ones too) in both weight layouts with M/N/K tails, A a view of a
wider NaN-filled buffer (TMA must read zeros past K), nothing written outside [M, N], three calls
bitwise equal; a grid capped below the tiles with a row rotation; K = 0 and M = 0; operands TMA cannot read
(explicit Gluon blocks refused, the table's choice falls back to its plain blocks); replays of a captured CUDA
graph with new operands; split tails (`sk1`): 16 queued calls bitwise equal, the counters back at zero, a grid
capped so that each program holds several split pieces.
"""

from __future__ import annotations

import sys

import torch

from tests.gpu.checklist import Checks, cuda_device, expect, graph_replays_right, rel

TOLERANCE = 1e-2
TAIL_SHAPES = ((1000, 776, 1000), (136, 1288, 4104), (4096, 3072, 4096), (1, 8, 64))
check = Checks()


def main(argv=None) -> int:
    dev = cuda_device(argv, "the Gluon GEMM")
    if dev is None:
        return 1
    from tp_overlap.launch.measure.tune import GLUON_BOX_CANDIDATES, GLUON_CANDIDATES
    from tp_overlap.gemm import GemmBlocks, triton_mm
    from tp_overlap.gemm.blocks import choose_blocks

    gen = torch.Generator(device=dev).manual_seed(0)

    def operands(m, n, k, layout, pad=24):
        """A [M, K] as a view of a NaN-filled wider buffer (TMA must stop at K), B [K, N] row-major or the
        transpose view of a row-major [N, K]."""
        a = torch.full((m, k + pad), float("nan"), dtype=torch.bfloat16, device=dev)[:, :k]
        a.copy_(torch.randn(m, k, generator=gen, device=dev))
        w = (torch.randn(n, k, generator=gen, device=dev) / k ** 0.5).bfloat16()
        return a, (w.t() if layout == "nk" else w.t().contiguous())

    def run(a, b, blocks, **kwargs):
        m, n = a.shape[0], b.shape[1]
        frame = torch.full((m + 8, n + 16), float("nan"), dtype=torch.bfloat16, device=dev)
        triton_mm(a, b, frame[:m, :n], blocks=blocks, **kwargs)
        torch.cuda.synchronize(dev)
        outside = (~torch.isnan(frame[:, n:])).sum().item() + (~torch.isnan(frame[m:, :n])).sum().item()
        expect(outside == 0, f"{blocks.name if blocks else 'table'}: {outside} values written outside [M, N]")
        return frame[:m, :n]

    def verify(out, a, b, what):
        expect(not torch.isnan(out).any(), f"{what}: NaN left in the output (a tile never stored, or NaN read)")
        err, err_mm = rel(out, a.double() @ b.double()), rel(out, torch.mm(a, b))
        expect(err <= TOLERANCE and err_mm <= TOLERANCE, f"{what}: {err:.3g} vs fp64, {err_mm:.3g} vs torch.mm")
        return err

    @check("every Gluon candidate, both layouts, M/N/K tails, NaN past K: right, nothing outside, bitwise x3")
    def _():
        worst = 0.0
        for name in GLUON_CANDIDATES + GLUON_BOX_CANDIDATES:
            blocks = GemmBlocks.parse(name)
            for m, n, k in TAIL_SHAPES:
                for layout in ("kn", "nk"):
                    a, b = operands(m, n, k, layout)
                    outs = [run(a, b, blocks) for _ in range(3)]
                    worst = max(worst, verify(outs[0], a, b, f"{name} {layout} M={m} N={n} K={k}"))
                    expect(all(torch.equal(outs[0], o) for o in outs[1:]), f"{name} {layout}: repeats differ")
        return f"{len(GLUON_CANDIDATES + GLUON_BOX_CANDIDATES)} configurations x {len(TAIL_SHAPES)} shapes x 2 layouts, worst {worst:.2e}"

    def split_planned(name, m, n, k, programs=None):
        from tp_overlap.gemm.gluon_launch import split_plan

        blocks = GemmBlocks.parse(name)
        tiles = -(-m // 128) * -(-n // blocks.block_n)
        whole, splits = split_plan(tiles, programs or torch.cuda.get_device_properties(dev).multi_processor_count,
                                   -(-k // 64), 2 * 128 * blocks.block_n * k)
        expect(splits > 1, f"{name} M={m} N={n} K={k}: no split planned (the check would not test one)")
        return f"{name} {tiles} tiles -> {whole} whole + {tiles - whole} x {splits}"

    @check("split tails (sk1): 16 calls queued back to back bitwise equal, counters back at zero, both layouts")
    def _():
        from tp_overlap.gemm.workspaces import _workspaces

        cases = []
        for name, (m, n, k) in (("128x128x64w4s6sk1gl", (1024, 768, 4096)), ("128x256x64w4s3sk1gl", (2048, 1280, 8192)),
                                ("128x64x64w4s8sk1gl", (200, 1032, 4104))):
            blocks = GemmBlocks.parse(name)
            cases.append(split_planned(name, m, n, k))
            for layout in ("kn", "nk"):
                a, b = operands(m, n, k, layout)
                outs = [torch.full((m, n), float("nan"), dtype=torch.bfloat16, device=dev) for _ in range(16)]
                for out in outs:   # queued: no synchronisation between the calls
                    triton_mm(a, b, out, blocks=blocks)
                torch.cuda.synchronize(dev)
                verify(outs[0], a, b, f"{name} {layout} M={m} N={n} K={k}")
                expect(all(torch.equal(outs[0], o) for o in outs[1:]), f"{name} {layout}: queued calls differ")
        left = [key for key, pairs in _workspaces.items() if "gluon_split" in key
                for _, counters in pairs if counters.any()]
        expect(not left, f"counters not back at zero: {left}")
        return "; ".join(cases)

    @check("a grid capped below the tiles (persistent programs) with a row rotation")
    def _():
        plans = []
        for name, k in ((GLUON_CANDIDATES[0], 1024), ("128x128x64w4s6sk1gl", 8192), ("64x96x64w4s8gl", 1032),
                        ("128x80x64w4s7gl", 1000)):
            blocks = GemmBlocks.parse(name)
            for programs, offset in ((3, 1), (100, 5), (132, 0)):
                if blocks.stream_k:   # with 3 programs, each holds whole tiles and split pieces
                    plans.append(split_planned(name, 4096, 1280, k, programs))
                a, b = operands(4096, 1280, k, "nk")
                verify(run(a, b, blocks, num_programs=programs, tile_row_offset=offset), a, b,
                       f"{name} programs={programs} offset={offset}")
        return "; ".join(plans)

    @check("K = 0 gives zeros, M = 0 launches nothing")
    def _():
        blocks = GemmBlocks.parse(GLUON_CANDIDATES[0])
        a = torch.empty(64, 8, dtype=torch.bfloat16, device=dev)[:, :0]   # row stride 16 bytes: TMA-readable
        b = torch.empty(0, 256, dtype=torch.bfloat16, device=dev)
        expect(torch.equal(run(a, b, blocks), torch.zeros(64, 256, dtype=torch.bfloat16, device=dev)), "K = 0")
        run(torch.empty(0, 64, dtype=torch.bfloat16, device=dev), torch.randn(64, 256, device=dev).bfloat16(), blocks)
        return "ok"

    @check("operands TMA cannot read: explicit Gluon blocks refused, the table's choice falls back to plain")
    def _():
        m, n, k = 1024, 4096, 2048   # a shape whose table entry names Gluon blocks
        a = torch.randn(m, k + 1, generator=gen, device=dev).bfloat16()[:, 1:]   # base 2 bytes past alignment
        b = (torch.randn(n, k, generator=gen, device=dev) / k ** 0.5).bfloat16().t()
        try:
            run(a, b, GemmBlocks.parse(GLUON_CANDIDATES[0]))
            raise AssertionError("misaligned A accepted by explicit Gluon blocks")
        except ValueError as exc:
            expect("16-byte aligned" in str(exc), f"unexpected refusal: {exc}")
        chosen = choose_blocks(m, n, k, b_transposed=True)
        expect(chosen.gluon, f"the table names {chosen.name} at {m}x{n}x{k}: the fallback would not be tested")
        verify(run(a, b, None), a, b, f"table choice {chosen.name} with misaligned A")
        return f"table choice {chosen.name}"

    @check("a captured CUDA graph (a split tail) replays right with new operands")
    def _():
        blocks = GemmBlocks.parse("128x128x64w4s6sk1gl")
        m, n, k = 1024, 768, 4096
        plan = split_planned(blocks.name, m, n, k)
        a, b = operands(m, n, k, "nk")
        out = torch.empty(m, n, dtype=torch.bfloat16, device=dev)
        graph_replays_right(lambda: triton_mm(a, b, out, blocks=blocks), a, b, out,
                            lambda: operands(m, n, k, "nk"), verify)
        return plan

    return check.summary()


if __name__ == "__main__":
    sys.exit(main())
