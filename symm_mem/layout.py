"""The layout every rank's pool shares: alignment, the control page's words, region records, and which
backend serves a device.

A pool has two kinds of flag words:

* **control words** live in a small host page per rank (an anonymous memfd that every rank of the node
  maps; on CUDA also registered with the driver, so a stream can wait on it and write it with memory
  operations that need no SM). Every flag that a copy-engine copy or another flag waits for is a control
  word. Because they are host memory, the pool's watchdog thread reads them and releases a stuck wait with
  a plain store, and every rank can write any rank's abort word without a CUDA call.
* **device words** live after the data arena of the symmetric allocation; kernels poll them (a persistent
  GEMM's scatter epilogue releases one per row block, the reduction waits for them).

Control page of one rank (int32 words):

    [0] ERROR_CODE   first failure seen by this rank: the word that a wait expired on (CODE_* below), or 0
    [1] ERROR_VALUE  the value that wait expected
    [2] ABORT        set by the rank that gives up, in every rank's page:
                     (aborting rank + 1) | reason << 8 | (lost rank + 1) << 16
    [3] ERROR_OBSERVED the flag's value when a host-side wait expired (before any release)
    [4..7]           a disagreement on M (the reporting rank's, in its own page, before its abort word):
                     [4] the M of the rank that saw it, [5] the M it saw, [6] (that rank + 1) | (peer + 1) << 8,
                     [7] the flag it was seen on (an error code: the control word, or a device word code)
    [8..15]          reserved
    [16, 16 + n)     control flags of the regions (n = num_control_words)
    [16 + n, 16 + 2n) the board: board[i] is nonzero while this rank's stream waits on control flag i: the
                     value an equality wait awaits (a flag at another nonzero value is a disagreement), or
                     BOARD_GEQ for an at-least wait
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from tp_overlap.kernels.constants import MISMATCH_BIT  # the kernels record it, the watchdog decodes it

from .errors import PoolError

__all__ = ["ABORT_WORD", "ALIGN_BYTES", "BACKENDS", "ERROR_CODE_WORD", "ERROR_VALUE_WORD", "ERROR_OBSERVED_WORD",
           "FIRST_FLAG_WORD", "MISMATCH_MINE_WORD", "MISMATCH_SEEN_WORD", "MISMATCH_WHO_WORD", "MISMATCH_FLAG_WORD",
           "MISMATCH_BIT", "BOARD_GEQ", "DEFAULT_TIMEOUT_S", "MISMATCH_REASON", "FAILURE_CODE_BASE", "CHECK_REASON",
           "CALL_FAILED_REASON", "INTERRUPTED_REASON", "DEVICE_CODE_BASE", "PoolStats", "Region", "align",
           "control_page_words", "gpu_identity", "resolve_backend", "encode_abort", "decode_abort", "check_spec",
           "check_timeout", "check_word", "check_same_shape", "layout_difference"]

ALIGN_BYTES = 256
ERROR_CODE_WORD = 0
ERROR_VALUE_WORD = 1
ABORT_WORD = 2
ERROR_OBSERVED_WORD = 3  # the flag's value when a host-side wait expired (before any release)
MISMATCH_MINE_WORD, MISMATCH_SEEN_WORD, MISMATCH_WHO_WORD, MISMATCH_FLAG_WORD = 4, 5, 6, 7
BOARD_GEQ = -1           # board value of an at-least wait (no disagreement check)
DEFAULT_TIMEOUT_S = 30.0  # a pool's bound on its waits, creation and barrier unless timeout_s= says otherwise
MISMATCH_REASON = 4      # abort reason: the ranks disagree on a call's M
FAILURE_CODE_BASE = 1 << 29  # error codes >= this (below MISMATCH_BIT) name a device-side check (`failure_code`)
CHECK_REASON = 5         # abort reason: a device-side check of an op failed
CALL_FAILED_REASON = 6   # abort reason: a step of an op call raised where the call could not be completed
INTERRUPTED_REASON = 7   # abort reason: Ctrl-C reached that rank (KeyboardInterrupt in a call or a pool block)
FIRST_FLAG_WORD = 16     # words 0..15 of the control page are the error and abort words
DEVICE_CODE_BASE = 1 << 24  # error codes >= this name a device word (kernel waits): base + device word index
BACKENDS = ("auto", "torch", "nvshmem", "ipc", "host")
INT32_RANGE = (-(1 << 31), (1 << 31) - 1)


def control_page_words(num_control_words: int) -> int:
    """Words of one rank's control page: the reserved words, the flags and their board."""
    return FIRST_FLAG_WORD + 2 * num_control_words


def encode_abort(rank: int, reason: int, lost: int | None = None) -> int:
    return (rank + 1) | (reason << 8) | ((lost + 1 if lost is not None else 0) << 16)


def decode_abort(word: int) -> tuple[int, int, int | None]:
    """(aborting rank, reason, lost rank or None) of a nonzero abort word."""
    lost = (word >> 16) & 0xFF
    return (word & 0xFF) - 1, (word >> 8) & 0xFF, lost - 1 if lost else None


@dataclass(frozen=True)
class Region:
    name: str
    offset_bytes: int
    shape: tuple[int, ...]
    dtype: torch.dtype
    nbytes: int
    first_control_word: int   # in the control page
    num_control: int
    first_device_word: int    # in the device flag area
    num_device_flags: int


@dataclass(frozen=True)
class PoolStats:
    backend: str
    rendezvous_count: int
    allocations: int
    bytes_total: int
    bytes_reserved: int
    num_regions: int
    control_words_reserved: int
    device_words_reserved: int
    handles_open: int
    host_registrations: int


def align(n: int, a: int = ALIGN_BYTES) -> int:
    return (n + a - 1) // a * a


def resolve_backend(backend: str, device: torch.device, group_backend: str = "nccl") -> str:
    """`auto`: torch symmetric memory on CUDA with an NCCL group; CUDA IPC with another group (gloo: ranks
    that share a GPU, which NCCL refuses); the host pool on CPU."""
    if backend not in BACKENDS:
        raise PoolError(f"backend={backend!r} is not one of {BACKENDS}")
    if backend == "auto":
        if device.type != "cuda":
            return "host"
        return "torch" if group_backend == "nccl" else "ipc"
    if (backend == "host") != (device.type == "cpu"):
        raise PoolError(f"backend={backend!r} does not serve device {device}; host is for cpu, "
                        f"torch, nvshmem and ipc for cuda")
    return backend


def check_word(what: str, value) -> None:
    """Flag words are int32: a value outside that range could never be stored, so no wait could end."""
    if isinstance(value, bool) or not isinstance(value, int) or not INT32_RANGE[0] <= value <= INT32_RANGE[1]:
        raise PoolError(f"pool.{what}: value {value!r} is not an int32 (a flag word holds {INT32_RANGE[0]} .. "
                        f"{INT32_RANGE[1]})")


def check_timeout(timeout_s) -> float:
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not math.isfinite(timeout_s) \
            or timeout_s <= 0:
        raise PoolError(f"timeout_s must be a finite number > 0, got {timeout_s!r}")
    return float(timeout_s)


def gpu_identity(device: torch.device) -> str | None:
    """What tells one GPU from another across processes (its UUID); None off CUDA."""
    return str(torch.cuda.get_device_properties(device).uuid) if device.type == "cuda" else None


def check_same_shape(shapes: list) -> None:
    """Creation: every rank's (arena bytes, signal words, device words, backend) must be the same."""
    if len(set(shapes)) > 1:
        names = ("size_bytes (aligned)", "num_signal_words", "num_device_words", "backend")
        differing = [i for i in range(len(names)) if len({s[i] for s in shapes}) > 1]
        parts = [f"{names[i]}: " + ", ".join(f"rank {r} {s[i]!r}" for r, s in enumerate(shapes)) for i in differing]
        raise PoolError(f"pool creation: the ranks created the pool with different sizes ({'; '.join(parts)}); "
                        f"a symmetric pool has the same layout on every rank")


def check_spec(name, shape, dtype, num_signals, num_device_flags) -> tuple[int, ...]:
    if not isinstance(name, str) or not name:
        raise PoolError(f"region name must be a non-empty str, got {name!r}")
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    if not all(isinstance(d, int) and d >= 0 for d in shape):
        raise PoolError(f"region {name!r}: shape must be non-negative ints, got {shape!r}")
    if not isinstance(dtype, torch.dtype):
        raise PoolError(f"region {name!r}: dtype must be a torch.dtype, got {dtype!r}")
    for arg, value in (("num_signals", num_signals), ("num_device_flags", num_device_flags)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise PoolError(f"region {name!r}: {arg} must be an int >= 0, got {value!r}")
    return shape


def layout_difference(layouts: list) -> str | None:
    """None if every rank's `SymmetricPool.layout()` is the same, else the first region where they differ,
    as every rank reserved it."""
    if len(set(layouts)) <= 1:
        return None
    index = next(i for i in range(max(map(len, layouts))) if len({lay[i] if i < len(lay) else None
                                                                    for lay in layouts}) > 1)

    def region(layout) -> str:
        if index >= len(layout):
            return "nothing"
        name, offset, shape, dtype, control, num_control, device, num_device = layout[index]
        return (f"{name!r} {list(shape)} {dtype.replace('torch.', '')} at byte {offset}, control words "
                f"[{control}, {control + num_control}), device words [{device}, {device + num_device})")
    return f"region {index}: " + "; ".join(f"rank {r} {region(lay)}" for r, lay in enumerate(layouts))
