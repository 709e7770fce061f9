"""CPU (Triton interpreter) tests of the local GEMM's tuning options: stream-K (kernels/gemm_mainloop.py),
the two-half epilogue and the flattened loop, directly and through overlap.gemm.triton_mm."""

import os
import subprocess
import sys
from pathlib import Path

import torch
import triton

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

from tp_overlap.kernels.gemm import EPILOGUE_LOCAL, GemmConfig, persistent_gemm_kernel  # noqa: E402
from tp_overlap.gemm import GemmBlocks, triton_mm  # noqa: E402
from tp_overlap.gemm.blocks import stream_k_tiles  # noqa: E402
from tests.multiproc import child_pythonpath  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOLERANCE = 1e-2  # bf16 output, fp32 accumulation (the tolerance policy, docs/MEASUREMENT.md)
BLOCK = 16


def relative_error(actual, expected):
    return (torch.linalg.norm(actual.float() - expected) / torch.linalg.norm(expected)).item()


def operands(m, n, k, b_transposed, seed):
    generator = torch.Generator().manual_seed(seed)
    a = torch.randn(m, k, generator=generator).bfloat16().to(DEVICE)
    b = torch.randn(n, k, generator=generator) if b_transposed else torch.randn(k, n, generator=generator)
    b = b.bfloat16().to(DEVICE)
    expected = a.float() @ (b.float().T if b_transposed else b.float())
    return a, b, expected


def launch(a, b, c, *, programs, waves, workspace, flags, b_transposed=False, descriptors=True,
           subtile=1, flatten=False, block_n=BLOCK, timeout_ns=1_000_000):
    """The local GEMM; `waves` > 0 splits the last partial wave plus waves - 1 full ones by K steps."""
    m, k = a.shape
    n = c.shape[1]
    stream_k = (workspace, flags, timeout_ns) if waves else None
    persistent_gemm_kernel[(programs,)](
        a, b, c, m, n, k, (a.stride(0), b.stride(0), c.stride(0)), 1, m, 0, None, None, stream_k, None,
        CONFIG=GemmConfig(BLOCK, block_n, BLOCK, 2, EPILOGUE=EPILOGUE_LOCAL, USE_DESCRIPTORS=descriptors,
                          B_TRANSPOSED=b_transposed, FLATTEN=flatten, EPILOGUE_SUBTILE=subtile,
                          STREAM_K_WAVES=waves))


# m, n, k (tails in every dimension for 16-wide blocks), programs, stream-K waves (-1: every tile split)
CASES = [
    (40, 40, 96, 4, 1),    # 9 tiles on 4 programs: the last tile split 4 ways
    (40, 40, 96, 4, 2),    # the last partial wave plus one full wave
    (40, 40, 96, 12, -1),  # fewer tiles than programs: every tile split
    (37, 45, 83, 7, -1),   # K tail: 6 steps, the last one partial
    (20, 20, 32, 9, -1),   # 4 tiles x 2 K steps on 9 programs: one program gets no step at all
]


@pytest.mark.parametrize("b_transposed", [False, True])
@pytest.mark.parametrize("m,n,k,programs,waves", CASES)
def test_stream_k_matches_fp32_reference_and_leaves_flags_at_zero(m, n, k, programs, waves, b_transposed):
    a, b, expected = operands(m, n, k, b_transposed, seed=m + n + k + programs)
    tiles = -(-m // BLOCK) * -(-n // BLOCK)
    if waves < 0:  # enough waves to split every tile
        waves = -(-tiles // programs)
        assert stream_k_tiles(tiles, programs, waves) == tiles
    assert stream_k_tiles(tiles, programs, waves) > 0
    c = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    workspace = torch.full((programs * BLOCK * BLOCK,), float("nan"), device=DEVICE)  # stale partials show
    flags = torch.zeros(programs, dtype=torch.int32, device=DEVICE)
    launch(a, b, c, programs=programs, waves=waves, workspace=workspace, flags=flags,
           b_transposed=b_transposed, descriptors=(k % 8 == 0 and n % 8 == 0))
    assert relative_error(c, expected) <= TOLERANCE
    assert (flags == 0).all(), flags


def test_a_contributor_that_is_late_is_recomputed_by_the_finisher():
    # a flag far below zero never reaches 1 within the wait: the finisher computes that K range itself,
    # and the late contributor's +1 and the finisher's -1 leave the word where it was
    a, b, expected = operands(40, 40, 96, False, seed=3)
    programs = 4
    c = torch.full((40, 40), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    workspace = torch.full((programs * BLOCK * BLOCK,), float("nan"), device=DEVICE)
    flags = torch.tensor([-100, 0, -100, 0], dtype=torch.int32, device=DEVICE)
    launch(a, b, c, programs=programs, waves=2, workspace=workspace, flags=flags)  # 9 tiles: the last 5 split
    assert relative_error(c, expected) <= TOLERANCE
    assert flags.tolist() == [-100, 0, -100, 0]


@pytest.mark.parametrize("subtile,flatten", [(2, False), (1, True), (2, True)])
def test_two_half_epilogue_and_flattened_loop(subtile, flatten):
    a, b, expected = operands(50, 72, 48, True, seed=subtile + 2 * flatten)
    c_storage = torch.full((50, 80), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    c = c_storage[:, :72]
    launch(a, b, c, programs=3, waves=0, workspace=None, flags=None, b_transposed=True, subtile=subtile,
           flatten=flatten, block_n=32)
    assert relative_error(c, expected) <= TOLERANCE
    assert torch.isnan(c_storage[:, 72:]).all(), "a store went past N"


def test_triton_mm_with_stream_k_blocks_reuses_its_workspace_without_stale_partials():
    blocks = GemmBlocks(BLOCK, BLOCK, BLOCK, 2, 1, 1, stream_k=1)
    for m, n, k, programs in ((64, 48, 80, 5), (24, 40, 56, 4), (64, 48, 80, 5)):
        assert stream_k_tiles(-(-m // BLOCK) * -(-n // BLOCK), programs, 1) > 0
        a, b, expected = operands(m, n, k, True, seed=m * k)
        out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device=DEVICE)
        triton_mm(a, b.t(), out, num_programs=programs, blocks=blocks)
        assert relative_error(out, expected) <= TOLERANCE, (m, n, k)


def test_late_contributor_recompute_is_right_on_repeated_calls_with_poisoned_outputs():
    # different late contributors per call, fresh NaN outputs and stale partials each time
    a, b, expected = operands(40, 40, 96, True, seed=11)
    programs = 4
    workspace = torch.full((programs * BLOCK * BLOCK,), float("nan"), device=DEVICE)
    for late in ([0], [1, 3], [0, 1, 2, 3], []):
        flags = torch.zeros(programs, dtype=torch.int32, device=DEVICE)
        flags[late] = -7
        before = flags.clone()
        c = torch.full((40, 40), float("nan"), dtype=torch.bfloat16, device=DEVICE)
        launch(a, b, c, programs=programs, waves=2, workspace=workspace, flags=flags, b_transposed=True)
        assert relative_error(c, expected) <= TOLERANCE, late
        assert torch.equal(flags, before), (late, flags)


COMPILE_CHILD = """
from tp_overlap.launch.compile_check import compile_gemm
from tp_overlap.gemm import GemmBlocks
ptx = compile_gemm(GemmBlocks.parse("128x128x64w8s4sk1"), b_transposed=True).asm["ptx"]
lines = [line for line in ptx.splitlines() if not line.lstrip().startswith((".loc", "$L__"))]
reads = [i for i, line in enumerate(lines) if "%globaltimer" in line]

def until_compared(i):  # the code from a clock read up to the first comparison after it
    rest = lines[i + 1:]
    return rest[:next((j for j, line in enumerate(rest) if line.lstrip().startswith("setp")), len(rest))]

# each read is reduced over the program before any comparison: warp shuffles, a max, shared memory
reduced = all(all(any(op in line for line in until_compared(i)) for op in ("shfl.sync.bfly", "max.s64", "st.shared"))
              for i in reads)
print("RESULT", "ld.global.gpu.acquire" in ptx, bool(reads), reduced)
"""


def test_compiled_finisher_wait_bounds_by_a_clock_the_program_agrees_on():
    # A finisher's threads must all stop waiting at the same poll (kernels/gemm_mainloop.py): a %globaltimer
    # read per thread let warps disagree and desynchronise their barriers, so every read is reduced over the
    # program (kernels/flags.py) before the bound compares it. Compiled for sm_90 on CPU, in a child process
    # without TRITON_INTERPRET (the interpreter replaces @triton.jit functions in this one).
    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    if not ptxas.exists():
        pytest.skip("this Triton has no bundled ptxas")
    root = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = child_pythonpath()
    proc = subprocess.run([sys.executable, "-c", COMPILE_CHILD], cwd=root, env=env, capture_output=True, text=True,
                          timeout=600)
    result = [line for line in proc.stdout.splitlines() if line.startswith("RESULT")]
    assert result, proc.stderr[-2000:]
    acquire, clock, reduced = result[0].split()[1:]
    assert acquire == "True", "the finisher's acquire poll is missing"
    assert clock == "True", "the finisher's wait is not bounded by %globaltimer"
    assert reduced == "True", "a %globaltimer read reaches a comparison without the reduction over the program"
