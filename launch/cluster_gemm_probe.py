"""What thread-block clusters with TMA multicast buy the narrow GEMMs: kernels/gemm_gluon_cluster.py against
cuBLAS and the block table's kernel (`triton_mm`), on one sm_90 GPU. Needs Triton >= 3.7 (Gluon clusters and
multicast).

    python -m tp_overlap.launch.cluster_gemm_probe [--points "MxNxK:TILE,TILE;..."] [--reps 20] [--hold-us 300]
        [--out FILE (default runs/cluster_gemm_probe-<time>/...)]

A TILE is `BN0+BN1[xS][n2]`: a 2-CTA cluster tile of 256 rows and BN0 + BN1 columns (two B boxes, powers of
two); `xS`: S-way split-K (fp32 partials, summed by `torch.sum` and cast into the output: two more kernels;
such a tile is also timed without them, as `TILE:kernel`, the bound a fused reduction could approach); `n2`:
a 2x2 cluster, two CTAs along N as well (A multicast too, 2 (BN0 + BN1) columns). N and K must be multiples
of 8 (TMA rows of 16 bytes). B is the row-major [N, K] weight read as its
transpose (`nk`). Every variant is first run three times into a NaN-poisoned output and held to a relative
Frobenius error <= 1e-2 against the fp64 product; then all are timed interleaved (L2 flushed before each
call, the stream held busy `--hold-us` so that launch cost is not charged, median of `--reps`).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass

import torch

from tp_overlap.launch.cli.common import ArgumentParser, UsageError, output_file, require, run_dir, run_launcher
from tp_overlap.launch.measure.timing import bench_interleaved, progress
from tp_overlap.launch.output.report import device_slug, format_table, write_results

SHARED_MEMORY_LIMIT = 232448     # bytes per CTA on sm_90
BLOCK_K = 64
MAX_STAGES = 6
REL_TOLERANCE = 1e-2
# the narrow points of results/gemm_h200.json below 0.85 (M 1024-2048, N 768-1536), a tile that gives each
# ~128 CTAs, and a shape with M, N and K tails
DEFAULT_POINTS = ("1024x1536x4096:64+32;2048x768x4096:64+32;1024x768x4096:32+16,64+32x2;"
                  "1024x1280x8192:64+16,64+16x2,128+32x2;1000x1000x1000:64+32,64+32x2")


@dataclass(frozen=True, kw_only=True)
class ClusterTile:
    bn0: int
    bn1: int
    splits: int = 1
    ctas_n: int = 1        # 2: a 2x2 cluster, two CTAs along N as well (A multicast too)

    def __post_init__(self):
        for value in (self.bn0, self.bn1):
            if value < 16 or value > 256 or value & (value - 1):
                raise ValueError(f"tile {self.name}: B boxes must be powers of two in [16, 256]")
        if self.ctas_n not in (1, 2):
            raise ValueError(f"tile {self.name}: CTAs along N must be 1 or 2")
        if self.splits < 1:
            raise ValueError(f"tile {self.name}: splits must be >= 1")
        if self.stages < 2:
            raise ValueError(f"tile {self.name}: two ring stages do not fit in shared memory")

    @property
    def name(self) -> str:
        return (f"{self.bn0}+{self.bn1}" + (f"x{self.splits}" if self.splits > 1 else "")
                + (f"n{self.ctas_n}" if self.ctas_n > 1 else ""))

    @property
    def stages(self) -> int:
        """As many ring stages as fit next to the C staging (per CTA: two 64-row A boxes and both B boxes a
        stage; two consumers' [64, BN0 + BN1] of C, fp32 when split)."""
        stage_bytes = (2 * 64 + self.bn0 + self.bn1) * BLOCK_K * 2
        c_bytes = 2 * 64 * (self.bn0 + self.bn1) * (4 if self.splits > 1 else 2)
        return min(MAX_STAGES, (SHARED_MEMORY_LIMIT - c_bytes - 1024) // stage_bytes)

    @classmethod
    def parse(cls, text: str) -> ClusterTile:
        text_n, _, ctas_n = text.partition("n")
        widths, _, splits = text_n.partition("x")
        bn0, plus, bn1 = widths.partition("+")
        try:
            return cls(bn0=int(bn0), bn1=int(bn1), splits=int(splits or 1), ctas_n=int(ctas_n or 1))
        except ValueError as exc:
            raise ValueError(f"tile {text!r}: expected BN0+BN1[xS][n2] ({exc})") from None


def cluster_support_problem() -> str | None:
    """Why this Triton cannot build the cluster kernel (None when it can)."""
    try:
        from triton.experimental.gluon.language.nvidia.hopper import cluster  # noqa: F401
    except ImportError:
        import triton
        return f"Triton {triton.__version__}: Gluon has no thread-block clusters (needs >= 3.7)"
    return None


def cluster_boxes(tile: ClusterTile) -> dict[str, tuple[tuple[int, int], tuple[tuple[int, int], ...]]]:
    """(block, CGA layout) of each descriptor, at cluster level. CTA id bit 0 halves the rows (A, C); with
    two CTAs along N, bit 1 halves the B boxes' rows and C's columns, and the two CTAs of a row pair share A."""
    if tile.ctas_n == 1:
        rows, broadcast, c_cga = ((1, 0),), ((0, 0),), ((1, 0),)
    else:
        rows, broadcast, c_cga = ((1, 0), (0, 0)), ((0, 0), (1, 0)), ((1, 0), (0, 1))
    n0, n1 = tile.bn0 * tile.ctas_n, tile.bn1 * tile.ctas_n
    return {"a": ((128, BLOCK_K), rows), "b0": ((n0, BLOCK_K), broadcast), "b1": ((n1, BLOCK_K), broadcast),
            "c0": ((128, n0), c_cga), "c1": ((128, n1), c_cga)}


def prepare_cluster_gemm(a: torch.Tensor, w: torch.Tensor, out: torch.Tensor, tile: ClusterTile):
    """(run, kernel): callables computing out [M, N] = a [M, K] @ w [N, K]^T on the current stream (`run`
    sums split partials into `out`; `kernel` launches only the GEMM). Descriptors and workspace are built
    here, once."""
    from tp_overlap.kernels.gemm_gluon_cluster import cluster_gemm_kernel
    from tp_overlap.gemm.launch import tma_descriptor

    m, k = a.shape
    n = w.shape[0]
    c_rows = -(-m // 256) * 256
    c = out if tile.splits == 1 else torch.empty(tile.splits * c_rows, n, dtype=torch.float32, device=a.device)
    boxes = cluster_boxes(tile)
    operands = {"a": a, "b0": w, "b1": w, "c0": c, "c1": c}
    descriptors = [tma_descriptor(operands[name], block, cga) for name, (block, cga) in boxes.items()]
    grid = (-(-m // 256) * -(-n // ((tile.bn0 + tile.bn1) * tile.ctas_n)), tile.splits)
    num_ctas = 2 * tile.ctas_n

    def kernel():
        cluster_gemm_kernel[grid](*descriptors, m, n, k, c_rows, NUM_STAGES=tile.stages, num_warps=4,
                                  num_ctas=num_ctas)

    if tile.splits == 1:
        return kernel, kernel
    partials = c.view(tile.splits, c_rows, n)[:, :m]

    def run():
        kernel()
        out.copy_(partials.sum(0))
    return run, kernel


def compile_cluster_gemm(tile: ClusterTile, *, arch: int = 90, dtype: str = "bf16"):
    """The kernel compiled for sm_<arch> without a GPU (launch/compile_check.py)."""
    from tp_overlap.kernels.gemm_gluon_cluster import cluster_gemm_kernel
    from tp_overlap.launch.compile_check import compile_gluon
    from tp_overlap.gemm.launch import tma_shared_layout

    torch_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}

    def desc(kind: str, block: tuple[int, int], cga) -> str:
        return f"tensordesc<{kind}[{block[0]}, {block[1]}],{tma_shared_layout(block, torch_dtype[kind], cga)!r}>"

    c_kind = "fp32" if tile.splits > 1 else dtype
    boxes = cluster_boxes(tile)
    types = {f"{name}_desc": desc(dtype if name[0] != "c" else c_kind, *boxes[name]) for name in boxes}
    types.update(M="i32", N="i32", K="i32", c_rows="i32")
    return compile_gluon(cluster_gemm_kernel, types, dict(NUM_STAGES=tile.stages), num_warps=4, arch=arch,
                         num_ctas=2 * tile.ctas_n)


def parse_points(text: str) -> list[tuple[tuple[int, int, int], list[ClusterTile]]]:
    """'MxNxK:TILE,TILE;...' -> [((m, n, k), [tiles]), ...]; ValueError says what is wrong."""
    points = []
    for item in filter(None, text.split(";")):
        shape, _, tiles = item.partition(":")
        try:
            m, n, k = (int(v) for v in shape.split("x"))
        except ValueError:
            raise ValueError(f"point {item!r}: expected MxNxK:TILE[,TILE...]") from None
        if min(m, n, k) < 1 or not tiles:
            raise ValueError(f"point {item!r}: expected positive MxNxK and at least one tile")
        if n % 8 or k % 8:
            raise ValueError(f"point {item!r}: N and K must be multiples of 8 (TMA reads rows of 16 bytes)")
        parsed = [ClusterTile.parse(t) for t in tiles.split(",")]
        for tile in parsed:
            if tile.splits > -(-k // BLOCK_K):
                raise ValueError(f"point {item!r}: {tile.splits} splits of {-(-k // BLOCK_K)} K steps")
        points.append(((m, n, k), parsed))
    return points


def _points_argument(text: str):
    try:
        return parse_points(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def make_parser() -> ArgumentParser:
    p = ArgumentParser("python -m tp_overlap.launch.cluster_gemm_probe", description=__doc__)
    p.add_argument("--points", type=_points_argument, default=parse_points(DEFAULT_POINTS),
                   help=f"shapes and cluster tiles (default: {DEFAULT_POINTS})")
    p.add_argument("--reps", type=int, default=20, help="timed calls per variant and shape (median)")
    p.add_argument("--hold-us", type=float, default=300.0, help="device hold before each timed call (0: none)")
    p.add_argument("--out", type=output_file, default=None,
                   help="results JSON (default: a file in runs/cluster_gemm_probe-<time>/)")
    return p


def _parse(argv):
    args = make_parser().parse_args(argv)
    require(args.reps >= 1, f"--reps must be >= 1, got {args.reps}")
    require(args.hold_us >= 0, f"--hold-us must be >= 0, got {args.hold_us}")
    return args


def main(argv=None) -> int:
    return run_launcher("tp_overlap.launch.cluster_gemm_probe", _parse, _run, argv)


def _run(args) -> int:
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        raise UsageError("needs a CUDA GPU of compute capability 9.0 (Hopper)")
    problem = cluster_support_problem()
    if problem:
        raise UsageError(problem)
    dev = torch.device("cuda", torch.cuda.current_device())
    device_name = torch.cuda.get_device_name(dev)
    out = args.out or str(run_dir("cluster_gemm_probe") / f"cluster_gemm_{device_slug(device_name)}.json")
    rows = []
    for i, ((m, n, k), tiles) in enumerate(args.points):
        rows.append(_measure_point(m, n, k, tiles, dev, seed=i, args=args))
        write_results(out, rows, device=device_name, tp=0, extra={"op": "cluster_gemm", "layout": "nk",
                                                                  "reps": args.reps, "hold_device_us": args.hold_us})
        progress(f"cluster gemm {i + 1}/{len(args.points)} {m}x{n}x{k}: " + ", ".join(
            f"{key[:-len('_over_cublas')]} {value:.3f}x" for key, value in rows[-1].items()
            if key.endswith("_over_cublas")))
    columns = ["M", "N", "K", "t_cublas_ms", "table_over_cublas"] + sorted(
        {key for row in rows for key in row if key.endswith("_over_cublas") and not key.startswith("table")})
    print(format_table(rows, columns))
    print(f"results: {out}")
    return 0


def _measure_point(m, n, k, tiles, dev, *, seed, args) -> dict:
    from tp_overlap.gemm import choose_blocks, triton_mm

    gen = torch.Generator(device=dev).manual_seed(seed)
    a = torch.randn(m, k, generator=gen, device=dev, dtype=torch.bfloat16)
    w = torch.randn(n, k, generator=gen, device=dev, dtype=torch.bfloat16)
    ref = a.double() @ w.double().t()
    outs = {name: torch.empty(m, n, device=dev, dtype=torch.bfloat16) for name in ("cublas", "table")}
    variants = {"cublas": lambda: torch.mm(a, w.t(), out=outs["cublas"]),
                "table": lambda: triton_mm(a, w.t(), outs["table"])}
    errors = {}
    for tile in tiles:
        out = torch.empty(m, n, device=dev, dtype=torch.bfloat16)
        run, kernel = prepare_cluster_gemm(a, w, out, tile)
        errors[tile.name] = _checked_error(run, out, ref, f"{m}x{n}x{k} {tile.name}")
        variants[tile.name] = run
        if tile.splits > 1:
            variants[f"{tile.name}:kernel"] = kernel
    errors["table"] = _checked_error(variants["table"], outs["table"], ref, f"{m}x{n}x{k} table")
    stats = bench_interleaved(variants, group=None, device=dev, reps=args.reps, hold_device_us=args.hold_us)
    t_cublas = stats["cublas"].median_ms
    row = {"M": m, "N": n, "K": k, "t_cublas_ms": t_cublas,
           "table_blocks": choose_blocks(m, n, k, b_transposed=True).name,
           "stages": {tile.name: tile.stages for tile in tiles}, "rel_errors": errors}
    for name, s in stats.items():
        row.update(s.as_dict(f"{name}_"))
        if name != "cublas":
            row[f"{name}_over_cublas"] = t_cublas / s.median_ms
    return row


def _checked_error(run, out: torch.Tensor, ref: torch.Tensor, where: str) -> float:
    """The worst relative Frobenius error of three runs into a NaN-poisoned `out`; raises above tolerance."""
    worst = 0.0
    for _ in range(3):
        out.fill_(float("nan"))
        run()
        torch.cuda.synchronize()
        err = ((out.double() - ref).norm() / ref.norm()).item()
        if not err <= REL_TOLERANCE:  # NaN included
            raise RuntimeError(f"{where}: relative error {err:.3g} vs the fp64 product")
        worst = max(worst, err)
    return worst


if __name__ == "__main__":
    sys.exit(main())
