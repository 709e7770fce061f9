"""CPU (Triton interpreter) tests of the split-K GEMM (kernels/gemm_splitk.py, launched by
overlap/gemm/splitk.py and overlap.triton_mm for a `sp<S>` configuration): K, M and N tails, both weight
layouts, descriptors and the masked pointer path, NaN-poisoned outputs and workspaces, repeated calls
(counters back at zero), an fp64 reference and torch.mm; the order of the sum does not depend on which split
arrives last; and the kernel compiles for sm_90 without spills."""

import json
import os
import subprocess
import sys
from pathlib import Path

import torch
import triton

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

from tp_overlap.kernels.gemm_splitk import SplitKConfig, split_k_gemm_kernel, split_k_ranges  # noqa: E402
from tp_overlap.gemm.blocks import SHARED_MEMORY_LIMIT, GemmBlocks  # noqa: E402
from tp_overlap.gemm import release_workspaces, split_k_workspace, triton_mm  # noqa: E402
from tests.multiproc import child_pythonpath  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOLERANCE = 1e-2  # bf16 output, fp32 accumulation (the tolerance policy, docs/MEASUREMENT.md)
BLOCK = 16
ROOT = Path(__file__).resolve().parents[2]


def relative_error(actual, expected):
    return (torch.linalg.norm(actual.double() - expected.double()) / torch.linalg.norm(expected.double())).item()


def operands(m, n, k, layout, seed):
    """(a [M, K], b [K, N] as a row-major tensor (kn) or the transpose view of a row-major [N, K] (nk))."""
    generator = torch.Generator().manual_seed(seed)
    a = torch.randn(m, k, generator=generator).bfloat16().to(DEVICE)
    w = torch.randn(n, k, generator=generator).bfloat16().to(DEVICE)
    return a, (w.t() if layout == "nk" else w.t().contiguous())


def check(a, b, out):
    assert not torch.isnan(out).any(), "a tile was never stored"
    assert relative_error(out, a.double() @ b.double()) <= TOLERANCE
    assert relative_error(out, torch.mm(a, b)) <= TOLERANCE


# m, n, k, splits: K steps of 16 (K % 8 != 0: the pointer path; K % 8 == 0: descriptors)
CASES = [
    (40, 40, 100, 2),   # M/N tails; 7 K steps, the last partial: splits of 3 and 4 steps (pointer path)
    (37, 45, 83, 3),    # tails everywhere; 6 steps over 3 splits (pointer path)
    (64, 48, 256, 4),   # whole tiles, 16 steps over 4 (descriptors)
    (33, 24, 136, 8),   # K = 136 is not a multiple of 8 * 16: splits of 1 and 2 steps (descriptors)
    (20, 36, 32, 4),    # 2 K steps over 4 splits: two splits hold no step and contribute zeros
]


@pytest.mark.parametrize("layout", ["kn", "nk"])
@pytest.mark.parametrize("m,n,k,splits", CASES)
def test_split_k_matches_fp64_and_torch_with_poisoned_outputs_and_counters_back_at_zero(m, n, k, splits, layout):
    a, b = operands(m, n, k, layout, seed=m + n + k + splits)
    blocks = GemmBlocks(BLOCK, BLOCK, BLOCK, 2, 1, 1, split_k=splits)
    workspace, counters = split_k_workspace(a.device, m, n, blocks)
    workspace.fill_(float("nan"))  # partials left from anything else must never be read
    out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    triton_mm(a, b, out, blocks=blocks)
    check(a, b, out)
    assert (counters == 0).all(), counters


def test_the_partition_covers_every_k_step_once():
    for k, splits in ((100, 2), (83, 3), (136, 8), (32, 4), (4096, 8), (4104, 4)):
        ranges = split_k_ranges(k, BLOCK, splits)
        assert ranges[0][0] == 0 and ranges[-1][1] == -(-k // BLOCK)
        assert all(a[1] == b[0] and a[0] <= a[1] for a, b in zip(ranges, ranges[1:]))
        assert max(e - s for s, e in ranges) - min(e - s for s, e in ranges) <= 1   # balanced


def test_repeated_calls_reuse_one_workspace_and_stay_right():
    blocks = GemmBlocks(BLOCK, 32, BLOCK, 2, 1, 1, split_k=4)
    first = split_k_workspace(torch.device(DEVICE), 40, 72, blocks)
    for call in range(3):   # fresh operands and a fresh NaN output each time, one workspace
        a, b = operands(40, 72, 200, "nk" if call % 2 else "kn", seed=call)
        out = torch.full((40, 72), float("nan"), dtype=torch.bfloat16, device=DEVICE)
        triton_mm(a, b, out, blocks=blocks)
        check(a, b, out)
        workspace, counters = split_k_workspace(a.device, 40, 72, blocks)
        assert workspace is first[0] and counters is first[1] and (counters == 0).all()
    release_workspaces()
    assert split_k_workspace(torch.device(DEVICE), 40, 72, blocks)[0] is not first[0]


def test_the_sum_does_not_depend_on_which_split_arrives_last():
    # the interpreter runs programs in order: with P persistent programs over the units (split-major, one tile
    # column here), the last arrival of a tile is a different split for each P, and the output is bitwise equal
    m, n, k, splits = 48, 16, 512, 8
    a, b = operands(m, n, k, "kn", seed=5)
    blocks = GemmBlocks(BLOCK, BLOCK, BLOCK, 1, 1, 1, split_k=splits)
    outs = []
    for programs in (None, 5, 7, 4):   # last arrivals of tile 0: splits 7, 4, 2, 5
        out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device=DEVICE)
        triton_mm(a, b, out, blocks=blocks, num_programs=programs)
        check(a, b, out)
        outs.append(out)
    assert all(torch.equal(outs[0], o) for o in outs[1:])


def test_a_capped_grid_and_a_row_rotation_still_store_every_tile():
    a, b = operands(70, 50, 160, "nk", seed=9)
    out = torch.full((70, 50), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    triton_mm(a, b, out, blocks=GemmBlocks(32, BLOCK, BLOCK, 2, 1, 1, split_k=2), num_programs=3, tile_row_offset=2)
    check(a, b, out)


def test_stores_stay_inside_the_output_view():
    a, b = operands(50, 72, 48, "nk", seed=4)
    storage = torch.full((50, 80), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    triton_mm(a, b, storage[:, :72], blocks=GemmBlocks(BLOCK, 32, BLOCK, 2, 1, 1, split_k=2))
    check(a, b, storage[:, :72])
    assert torch.isnan(storage[:, 72:]).all(), "a store went past N"


def test_the_kernel_alone_with_counters_and_a_reduction_of_several_row_steps():
    m, n, k, splits = 64, 32, 96, 3
    a, b = operands(m, n, k, "kn", seed=2)
    tiles = (m // 64) * (n // 32)
    workspace = torch.full((tiles * splits * 64 * 32,), float("nan"), device=DEVICE)
    counters = torch.zeros(tiles, dtype=torch.int32, device=DEVICE)
    out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    reduce_m = 16   # the last arrival sums the 64-row tile in four steps
    split_k_gemm_kernel[(tiles * splits,)](a, b, out, workspace, counters, m, n, k, a.stride(0), b.stride(0),
                                           out.stride(0), 0, CONFIG=SplitKConfig(64, 32, BLOCK, 8, splits, False,
                                                                                  False, reduce_m))
    check(a, b, out)
    assert (counters == 0).all()


def test_names_and_problems_of_split_k_configurations():
    blocks = GemmBlocks.parse("128x128x64w4s3sp4")
    assert blocks == GemmBlocks(128, 128, 64, 8, 4, 3, split_k=4) and blocks.name == "128x128x64w4s3sp4"
    assert GemmBlocks.parse("64x64x64w4s4g4sp8").group_m == 4
    assert not blocks.plain and not blocks.problems()
    assert GemmBlocks.parse("128x128x64w4s3sp32").problems()
    assert any("split-K" in p for p in GemmBlocks.parse("128x128x64w4s3wssp2").problems())
    assert any("split-K" in p for p in GemmBlocks.parse("128x128x64w4s3o2sp2").problems())


COMPILE_CHILD = """
import json
from tp_overlap.launch.compile_check import compile_split_k_gemm, resource_usage
from tp_overlap.gemm.blocks import GemmBlocks
out = {}
for name, transposed in (("128x128x64w4s3sp4", True), ("64x64x64w4s4sp8", False)):
    compiled = compile_split_k_gemm(GemmBlocks.parse(name), b_transposed=transposed)
    ptx = compiled.asm["ptx"]
    out[name] = resource_usage(compiled) | {"acq_rel": "atom.global.gpu.acq_rel.add" in ptx,
                                            "cg_loads": "ld.global.cg" in ptx, "tma": "cp.async.bulk.tensor" in ptx}
print("RESULT " + json.dumps(out))
"""


def test_split_k_compiles_for_sm90_without_spills_with_its_ordering():
    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    if not ptxas.exists():
        pytest.skip("this Triton has no bundled ptxas")
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = child_pythonpath()
    proc = subprocess.run([sys.executable, "-c", COMPILE_CHILD], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    for name, usage in json.loads(lines[-1][len("RESULT "):]).items():
        assert usage["spill"] == 0 and 0 < usage["regs"] <= 255 and usage["shared"] <= SHARED_MEMORY_LIMIT, name
        assert usage["acq_rel"] and usage["cg_loads"] and usage["tma"], (name, usage)
