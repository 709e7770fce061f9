"""The benchmark shape table (bf16; W = TP size; docs/ARCHITECTURE.md), shared by benchmarks, sweeps and tests."""

from __future__ import annotations

from dataclasses import dataclass

M_VALUES = (1024, 4096, 16384)
# CPU runs (functional checks): tiny [M, 64] @ [64, 64] points, seconds each instead of minutes
CPU_M_VALUES, CPU_K, CPU_N = (256, 512), 64, 64
# layer -> (hidden H, N_total for AG / K_total for RS)
AG_LAYERS = {"llama8b.qkv": (4096, 6144), "llama8b.fc1": (4096, 28672),
             "llama70b.qkv": (8192, 10240), "llama70b.fc1": (8192, 57344)}
RS_LAYERS = {"llama8b.o_proj": (4096, 4096), "llama8b.fc2": (4096, 14336),
             "llama70b.o_proj": (8192, 8192), "llama70b.fc2": (8192, 28672)}


@dataclass(frozen=True)
class ShapePoint:
    layer: str
    op: str   # "ag_gemm": [M, K] @ [K, N] with K = H, N = N_total / W; "gemm_rs": K = K_total / W, N = H
    m: int
    k: int
    n: int


def ag_points(world: int, ms=M_VALUES, layers=None) -> list[ShapePoint]:
    return [ShapePoint(name, "ag_gemm", m, h, n_total // world)
            for name, (h, n_total) in AG_LAYERS.items() if layers is None or name in layers for m in ms]


def rs_points(world: int, ms=M_VALUES, layers=None) -> list[ShapePoint]:
    return [ShapePoint(name, "gemm_rs", m, k_total // world, h)
            for name, (h, k_total) in RS_LAYERS.items() if layers is None or name in layers for m in ms]
