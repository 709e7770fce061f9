"""Block choice of the persistent Triton GEMM: the measured table, its loader, and the fallback heuristic.

`choose_blocks(m, n, k, b_transposed=...)` is the one entry point (pure; cached). It looks the shape up in
the block table of the GPU (`configs/gemm_blocks/<gpu>.yaml`, package data, written by `tp_overlap.launch.gemm_tune`):

* an entry is keyed by (layout, M, N, K); layout `kn` is a row-major B [K, N], `nk` the transpose view of
  a row-major [N, K] (`weight.t()`, B_TRANSPOSED). (N, K, layout) must match exactly; M picks the entry of
  that (N, K, layout) nearest in log2(M) (ties: the larger M);
* each entry holds two configurations: `blocks`, the fastest measured, and `plain`, the fastest without
  warp specialisation, loop flattening or stream-K, with BLOCK_M = 128: what callers whose K loop waits
  on flags get (`warp_specialize=False`: the fused AllGather consumer, the scatter epilogues, whose flags
  are per 128-row block), unless it is `o2` (they run one program per SM: then the heuristic's plain blocks);
* a shape, layout or GPU not in a table falls back to `heuristic_blocks` (measured on an H200: 128x256x64
  tiles, 8 warps, 3 stages, unless 128x128 tiles fill the last wave of `sm_count` programs clearly better).

A configuration is written as its name, e.g. `128x256x64w8s3g16ws`: BLOCK_M x BLOCK_N x BLOCK_K, warps,
stages, then optional `g<GROUP_M>` (default 8), `ws` (warp specialisation), `fl` (flattened loop nest),
`es2` (epilogue in two column halves), `sk<w>` (stream-K over the last partial wave plus w - 1 full waves),
`o2` (two persistent programs per SM by default: two CTAs share an SM and hide each other's epilogue),
`sp<S>` (split-K, kernels/gemm_splitk.py: each tile's K steps split over S units, summed by the last to
finish; for too few output tiles and long K), `gl` (the Gluon kernel with a TMA warp and a consumer warpgroup
per 64 rows: kernels/gemm_gluon.py, 128xBNx64w4s<stages>[sk1] with BN 64, 128 or 256, or BLOCK_M 192 with BN <=
128; `sk1` cuts the last partial wave's tiles by K, as many pieces as gluon_launch.split_plan says; BLOCK_M 64,
or BN the sum of two powers of two such as 96 = 64 + 32: kernels/gemm_gluon_boxes.py, B in two boxes, no `sk1`;
FP8: kernels/gemm_fp8_gluon.py, 128xBNx128w4s<stages>, BN 64 or 128).
"""

from __future__ import annotations

import functools
import math
import re
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from tp_overlap.ipc.errors import OverlapError
from tp_overlap.kernels.constants import ROW_BLOCK_M

__all__ = ["GemmBlocks", "BlockTable", "BlockTableEntry", "BlockTableError", "choose_blocks", "heuristic_blocks",
           "gluon_heuristic_blocks", "wave_efficiency", "load_block_table", "block_table_path", "block_table_name",
           "gpu_slug", "stream_k_tiles", "shared_memory_bytes", "LAYOUTS", "DEFAULT_GPU", "SHARED_MEMORY_LIMIT",
           "SHARED_MEMORY_PER_SM", "PLAIN_BLOCK_M", "cdiv"]

LAYOUTS = ("kn", "nk")          # B row-major [K, N] | B = w.t() of a row-major [N, K]
DEFAULT_GPU = "h200"            # the table callers get when they do not name a GPU
SHARED_MEMORY_LIMIT = 232448    # bytes per block on sm_90 (227 KB)
SHARED_MEMORY_PER_SM = 233472   # bytes per SM on sm_90 (228 KB), shared by the blocks resident there
PLAIN_BLOCK_M = ROW_BLOCK_M     # the scatter GEMMs run the plain entry: their row-block flags cover this many rows
# Gluon tile widths that are not powers of two: two B boxes (kernels/gemm_gluon_boxes.py, `box_widths`)
GLUON_BOX_WIDTHS = (48, 80, 96, 144, 160, 192)
WAVE_MARGIN = 0.05              # heuristic: ties go to the wider tile (more reuse per loaded A row)

_NAME = re.compile(r"^(\d+)x(\d+)x(\d+)w(\d+)s(\d+)(?:g(\d+))?(ws)?(fl)?(?:es(\d))?(?:sk(\d))?(?:o(\d))?(?:sp(\d+))?(gl)?$")


@dataclass(frozen=True)
class GemmBlocks:
    block_m: int
    block_n: int
    block_k: int
    group_m: int
    num_warps: int
    num_stages: int
    warp_specialize: bool = False
    flatten: bool = False
    epilogue_subtile: int = 1
    stream_k: int = 0
    programs_per_sm: int = 1   # the default grid: this many persistent programs per SM (2: two CTAs share one)
    split_k: int = 1           # > 1: the split-K kernel, each tile's K steps over this many units
    gluon: bool = False        # the Gluon kernel instead of the @triton.jit one

    @property
    def name(self) -> str:
        return (f"{self.block_m}x{self.block_n}x{self.block_k}w{self.num_warps}s{self.num_stages}"
                + (f"g{self.group_m}" if self.group_m != 8 else "") + ("ws" if self.warp_specialize else "")
                + ("fl" if self.flatten else "") + (f"es{self.epilogue_subtile}" if self.epilogue_subtile != 1 else "")
                + (f"sk{self.stream_k}" if self.stream_k else "")
                + (f"o{self.programs_per_sm}" if self.programs_per_sm != 1 else "")
                + (f"sp{self.split_k}" if self.split_k != 1 else "") + ("gl" if self.gluon else ""))

    @classmethod
    def parse(cls, name: str) -> GemmBlocks:
        match = _NAME.match(name)
        if not match:
            raise ValueError(f"block configuration {name!r} does not read as BMxBNxBKw<warps>s<stages>"
                             "[g<group>][ws][fl][es2][sk<waves>][o2][sp<splits>][gl]")
        bm, bn, bk, warps, stages, group, ws, fl, es, sk, occupancy, splits, gluon = match.groups()
        return cls(int(bm), int(bn), int(bk), int(group or 8), int(warps), int(stages), bool(ws), bool(fl),
                   int(es or 1), int(sk or 0), int(occupancy or 1), int(splits or 1), bool(gluon))

    @property
    def plain(self) -> bool:
        """Usable by callers whose K loop waits on flags (no ws, fl, sk, sp or gl). They run one program per
        SM, so `choose_blocks` gives them no `o2` (128x128x64w4s3es2o2 so: 0.64-0.69 of cuBLAS on an H100)."""
        return not (self.warp_specialize or self.flatten or self.stream_k or self.split_k > 1 or self.gluon)

    def problems(self, operand_bytes: int = 2) -> list[str]:
        """Why the kernel cannot run this configuration (empty when it can); `operand_bytes` 1 for FP8."""
        out = []
        for field, allowed in (("block_m", (16, 32, 64, 128, 256) + ((192,) if self.gluon else ())),
                               ("block_n", (16, 32, 64, 128, 256) + (GLUON_BOX_WIDTHS if self.gluon else ())),
                               ("block_k", (16, 32, 64, 128)), ("num_warps", (1, 2, 4, 8)),
                               ("epilogue_subtile", (1, 2))):
            if getattr(self, field) not in allowed:
                out.append(f"{field} {getattr(self, field)} not in {allowed}")
        if not 1 <= self.num_stages <= 12:  # 64x96 Gluon tiles want a ring of 10 (1024x768x4096)
            out.append(f"num_stages {self.num_stages} not in 1..12")
        if not 1 <= self.group_m <= 64:
            out.append(f"group_m {self.group_m} not in 1..64")
        if not 0 <= self.stream_k <= 4:
            out.append(f"stream_k {self.stream_k} not in 0..4")
        shared = shared_memory_bytes(self, operand_bytes)
        if self.programs_per_sm not in (1, 2):
            out.append(f"programs_per_sm {self.programs_per_sm} not in (1, 2)")
        elif self.programs_per_sm > 1 and self.programs_per_sm * (shared + 1024) > SHARED_MEMORY_PER_SM:
            out.append(f"{self.programs_per_sm} programs need ~{self.programs_per_sm * (shared + 1024)} bytes of "
                       f"shared memory per SM > {SHARED_MEMORY_PER_SM}")
        if self.stream_k and self.programs_per_sm != 1:
            out.append("stream-K waits for other programs: one program per SM (all resident)")
        if self.stream_k and self.warp_specialize:
            out.append("stream-K with warp specialisation spills registers (launch.compile_check)")
        if not 1 <= self.split_k <= 16:
            out.append(f"split_k {self.split_k} not in 1..16")
        elif self.split_k > 1 and (self.warp_specialize or self.flatten or self.stream_k or self.programs_per_sm != 1
                                   or self.epilogue_subtile != 1):
            out.append("split-K (its own kernel) takes none of ws, fl, sk, o2, es2")
        if shared > SHARED_MEMORY_LIMIT:
            out.append(f"needs ~{shared} bytes of shared memory > {SHARED_MEMORY_LIMIT}")
        if self.gluon and operand_bytes == 2:
            out += self._gluon_problems()
        return out

    @property
    def gluon_boxes(self) -> tuple[int, int] | None:
        """(BN0, BN1) of the two B boxes when kernels/gemm_gluon_boxes.py runs these Gluon blocks (BLOCK_M 64,
        or a width that is not a power of two), else None."""
        if not self.gluon or (self.block_m != 64 and self.block_n in (64, 128, 256)):
            return None
        return box_widths(self.block_n)

    def _gluon_problems(self) -> list[str]:
        """Why the Gluon bf16/fp16 kernels (kernels/gemm_gluon.py, gemm_gluon_boxes.py) cannot run these blocks."""
        if self.block_m == 64 or self.block_n not in (64, 128, 256):
            return self._gluon_box_problems()
        out = []
        for name, allowed in (("block_m", (128, 192)), ("block_n", (64, 128, 256)), ("block_k", (64,)),
                              ("num_warps", (4,)), ("group_m", (8,)), ("programs_per_sm", (1,))):
            if getattr(self, name) not in allowed:  # a consumer warpgroup per 64 rows; GROUP_M fixed in the kernel
                out.append(f"gluon: {name} {getattr(self, name)} not in {allowed}")
        if self.num_stages < 2:
            out.append(f"gluon: num_stages {self.num_stages} < 2")
        if self.block_m == 192 and self.block_n > 128:  # three consumer warpgroups: 152 registers per thread
            out.append(f"gluon: block_n {self.block_n} > 128 with block_m 192")
        for name in ("warp_specialize", "flatten"):
            if getattr(self, name):
                out.append(f"gluon: {name} is a @triton.jit option")
        if self.stream_k > 1:
            out.append(f"gluon: stream_k {self.stream_k} not in (0, 1) (sk1: the last partial wave split by K)")
        if self.split_k > 1 or self.epilogue_subtile != 1:
            out.append("gluon: split-K and es2 are @triton.jit options")
        return out

    def _gluon_box_problems(self) -> list[str]:
        """Why kernels/gemm_gluon_boxes.py cannot run these blocks."""
        out = []
        for name, allowed in (("block_m", (64, 128)), ("block_k", (64,)), ("num_warps", (4,)), ("group_m", (8,)),
                              ("programs_per_sm", (1,)), ("stream_k", (0,))):
            if getattr(self, name) not in allowed:
                out.append(f"gluon boxes: {name} {getattr(self, name)} not in {allowed}")
        if box_widths(self.block_n) is None:
            out.append(f"gluon boxes: block_n {self.block_n} is not the sum of two powers of two >= 16")
        if self.num_stages < 2:
            out.append(f"gluon boxes: num_stages {self.num_stages} < 2")
        if self.warp_specialize or self.flatten or self.split_k > 1 or self.epilogue_subtile != 1:
            out.append("gluon boxes: ws, fl, sp and es2 are @triton.jit options")
        return out


def box_widths(block_n: int) -> tuple[int, int] | None:
    """(BN0, BN1): `block_n` as a power of two and a smaller or equal one, both >= 16 (96 -> 64 + 32, 128 ->
    64 + 64); None when it is no such sum."""
    if not 32 <= block_n <= 256:
        return None
    bn0 = 1 << ((block_n - 1).bit_length() - 1)
    bn1 = block_n - bn0
    return (bn0, bn1) if bn1 >= 16 and bn1 & (bn1 - 1) == 0 else None


def shared_memory_bytes(blocks: GemmBlocks, operand_bytes: int = 2, out_bytes: int = 2) -> int:
    """Estimate: the pipelined A and B tiles plus the epilogue's staging tile (what Triton allocates)."""
    operands = blocks.num_stages * (blocks.block_m + blocks.block_n) * blocks.block_k * operand_bytes
    return operands + blocks.block_m * blocks.block_n * out_bytes // blocks.epilogue_subtile


def stream_k_tiles(num_tiles: int, num_programs: int, waves: int) -> int:
    """Tiles at the end of the walk split by K steps: the last partial wave plus `waves - 1` full ones
    (none when the tiles fill whole waves)."""
    if waves <= 0 or num_tiles % num_programs == 0:
        return 0
    return min(num_tiles, num_tiles % num_programs + (waves - 1) * num_programs)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def wave_efficiency(tiles: int, sm_count: int) -> float:
    """Busy fraction of the programs over all waves of a persistent grid of `sm_count` programs."""
    return tiles / (cdiv(tiles, sm_count) * sm_count)


def _narrow_fills_better(m: int, n: int, sm_count: int) -> bool:
    """The heuristics' rule: 128x128 tiles fill the last wave of `sm_count` programs clearly better than 128x256."""
    wide = wave_efficiency(cdiv(m, 128) * cdiv(n, 256), sm_count)
    return wave_efficiency(cdiv(m, 128) * cdiv(n, 128), sm_count) > wide + WAVE_MARGIN


# The Gluon heuristic of a GPU without a table (the table's most frequent Gluon entries on an H200)
GLUON_WIDE, GLUON_NARROW = "128x256x64w4s3gl", "128x128x64w4s6gl"


def gluon_heuristic_blocks(m: int, n: int, *, sm_count: int = 132, split_tail: bool = False) -> GemmBlocks:
    """`heuristic_blocks`' rule on the Gluon kernel: 128x256 tiles unless 128x128 fill the last wave of `sm_count`
    programs clearly better; with a split tail (the last wave cut by K), 128x256 where they fill two waves."""
    if split_tail:
        return GemmBlocks.parse(GLUON_WIDE if cdiv(m, 128) * cdiv(n, 256) >= 2 * sm_count else GLUON_NARROW)
    return GemmBlocks.parse(GLUON_NARROW if _narrow_fills_better(m, n, sm_count) else GLUON_WIDE)


def heuristic_blocks(m: int, n: int, k: int, *, warp_specialize: bool = True, sm_count: int = 132) -> GemmBlocks:
    """The fallback (`heuristic_over_cublas` in results/gemm_h200.json measures it at every point): 128x256x64
    tiles with 8 warps, 3 stages and warp specialisation, unless 128x128 tiles (4 warps, 4 stages) fill the last
    wave of `sm_count` programs clearly better (e.g. M = 1024 with N = 5120, where 256-wide tiles leave a third of
    the SMs idle)."""
    if _narrow_fills_better(m, n, sm_count):
        return GemmBlocks(128, 128, 64, 8, 4, 4)
    return GemmBlocks(128, 256, 64, 8, 8, 3, warp_specialize)


class BlockTableError(OverlapError, ValueError):
    pass


@dataclass(frozen=True)
class BlockTableEntry:
    layout: str
    m: int
    n: int
    k: int
    blocks: GemmBlocks
    plain: GemmBlocks
    vs_cublas: float | None = None        # measured speed of `blocks` over cuBLAS's (>1: faster)
    plain_vs_cublas: float | None = None


@dataclass(frozen=True)
class BlockTable:
    gpu: str
    num_sms: int
    entries: tuple[BlockTableEntry, ...]
    operand_bytes: int = 2

    def lookup(self, m: int, n: int, k: int, layout: str) -> BlockTableEntry | None:
        """The entry of (layout, n, k) whose M is nearest in log2 (ties: the larger M); None if absent."""
        same = [e for e in self.entries if e.layout == layout and e.n == n and e.k == k]
        if not same:
            return None
        return min(same, key=lambda e: (abs(math.log2(e.m) - math.log2(max(m, 1))), -e.m))


def block_table_path(gpu: str) -> Path:
    return Path(str(resources.files("tp_overlap.configs") / "gemm_blocks" / f"{gpu}.yaml"))


def _entry(raw, where: str, operand_bytes: int) -> BlockTableEntry:
    if not isinstance(raw, dict):
        raise BlockTableError(f"{where}: expected a mapping, got {raw!r}")
    missing = {"layout", "m", "n", "k", "blocks", "plain"} - raw.keys()
    if missing:
        raise BlockTableError(f"{where}: missing keys {sorted(missing)}")
    if raw["layout"] not in LAYOUTS:
        raise BlockTableError(f"{where}.layout: got {raw['layout']!r}; allowed: {LAYOUTS}")
    for key in ("m", "n", "k"):
        if not isinstance(raw[key], int) or isinstance(raw[key], bool) or raw[key] < 1:
            raise BlockTableError(f"{where}.{key}: got {raw[key]!r}; allowed: an int >= 1")
    parsed = {}
    for key in ("blocks", "plain"):
        try:
            parsed[key] = GemmBlocks.parse(str(raw[key]))
        except ValueError as exc:
            raise BlockTableError(f"{where}.{key}: {exc}") from None
        if parsed[key].problems(operand_bytes):
            raise BlockTableError(f"{where}.{key}: got {raw[key]!r}; {'; '.join(parsed[key].problems(operand_bytes))}")
    if not parsed["plain"].plain or parsed["plain"].block_m != PLAIN_BLOCK_M:
        raise BlockTableError(f"{where}.plain: got {raw['plain']!r}; allowed: BLOCK_M {PLAIN_BLOCK_M} without "
                              "ws, fl, sk or sp (callers that wait on flags use it)")
    ratios = {key: raw.get(key) for key in ("vs_cublas", "plain_vs_cublas")}
    for key, value in ratios.items():
        if value is not None and (not isinstance(value, (int, float)) or not value > 0):
            raise BlockTableError(f"{where}.{key}: got {value!r}; allowed: a number > 0 or absent")
    return BlockTableEntry(raw["layout"], raw["m"], raw["n"], raw["k"], parsed["blocks"], parsed["plain"],
                           ratios["vs_cublas"], ratios["plain_vs_cublas"])


def parse_block_table(raw, source: str) -> BlockTable:
    """A BlockTable from the parsed YAML document; errors name the file, the entry, the key and the value."""
    if not isinstance(raw, dict) or not isinstance(raw.get("entries"), list):
        raise BlockTableError(f"{source}: expected a mapping with an 'entries' list")
    num_sms = raw.get("num_sms")
    if not isinstance(num_sms, int) or num_sms < 1:
        raise BlockTableError(f"{source}: num_sms: got {num_sms!r}; allowed: an int >= 1")
    operand_bytes = raw.get("operand_bytes", 2)   # 1: a table of the FP8 GEMM (e4m3 operands)
    if operand_bytes not in (1, 2):
        raise BlockTableError(f"{source}: operand_bytes: got {operand_bytes!r}; allowed: 1 (fp8), 2 (bf16/fp16)")
    entries = tuple(_entry(e, f"{source}: entries[{i}]", operand_bytes) for i, e in enumerate(raw["entries"]))
    seen = {}
    for i, e in enumerate(entries):
        key = (e.layout, e.m, e.n, e.k)
        if key in seen:
            raise BlockTableError(f"{source}: entries[{i}] repeats entries[{seen[key]}] ({key})")
        seen[key] = i
    return BlockTable(str(raw.get("gpu", "")), num_sms, entries, operand_bytes)


@functools.lru_cache(maxsize=16)
def load_block_table(gpu: str | None = DEFAULT_GPU, path: str | None = None) -> BlockTable | None:
    """The table of `gpu` (package data) or of the file `path`; None when the GPU has none. Loaded once."""
    import yaml

    file = Path(path) if path else block_table_path(gpu) if gpu else None
    if file is None or not file.is_file():
        if path:
            raise BlockTableError(f"{path}: no such block table")
        return None
    try:
        raw = yaml.safe_load(file.read_text())
    except yaml.YAMLError as exc:
        raise BlockTableError(f"{file.name}: not valid YAML: {exc}") from None
    return parse_block_table(raw, file.name)


@functools.lru_cache(maxsize=4096)  # pure, and called on every launch of the ops
def gpu_slug(device_name: str) -> str:
    """The name tables and presets are keyed by: 'NVIDIA H200' -> 'h200', 'NVIDIA H100 80GB HBM3' -> 'h100',
    'cpu' -> 'cpu'."""
    name = device_name.lower().replace("nvidia", " ")
    match = re.search(r"\b([a-z]+\d+[a-z]*)\b", name)
    return match.group(1) if match else re.sub(r"[^a-z0-9]+", "_", name).strip("_") or "unknown"


def block_table_name(gpu: str | None) -> str:
    """What chooses the blocks on `gpu` (a slug): its table's file name, or that the heuristic does."""
    if gpu and block_table_path(gpu).is_file():
        return block_table_path(gpu).name
    return f"heuristic (no table for {gpu or 'this device'})"


def choose_blocks(m: int, n: int, k: int, *, b_transposed: bool = False, device_type: str = "cuda",
                  warp_specialize: bool = True, sm_count: int = 132, gpu: str | None = DEFAULT_GPU,
                  table: BlockTable | None = None) -> GemmBlocks:
    """Blocks for out[m, n] = a[m, k] @ b[k, n] (b row-major, or `b_transposed`: the transpose view of a
    row-major [n, k]). `table` (else the package table of `gpu`; `gpu=None`: none) decides where it has
    the (n, k, layout); otherwise `heuristic_blocks`. Callers whose K loop waits on flags pass
    `warp_specialize=False` and get a plain configuration (BLOCK_M 128, no ws / fl / sk / o2). `sm_count` only
    steers the heuristic: table entries were measured with every SM (stream-K recomputes its split from
    the real program count at launch)."""
    if device_type != "cuda":
        return GemmBlocks(16, 16, 16, 4, 1, 1)  # the interpreter: small tiles keep CPU tests fast
    table = table if table is not None else load_block_table(gpu) if gpu else None
    entry = table.lookup(m, n, k, "nk" if b_transposed else "kn") if table is not None else None
    if entry is not None and (warp_specialize or entry.plain.programs_per_sm == 1):
        return entry.blocks if warp_specialize else entry.plain
    return heuristic_blocks(m, n, k, warp_specialize=warp_specialize, sm_count=sm_count)
