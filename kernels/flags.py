"""Epoch flags on the device: a release store and a bounded acquire wait.

The wait is bounded by wall time read from %globaltimer (not only by spin count: a peer that is still
JIT-compiling can take seconds). On expiry it records `error_code` and the epoch it expected in the
error words (first writer wins) and exits, so the stream moves on and the host raises on its next check.

Epoch operands are either a host int (a kernel argument: cheap, but frozen into a captured CUDA graph) or a
`DeviceEpoch` (a counter in device memory plus a constant offset, read by the kernel when it runs: what
a CUDA graph needs, since every replay must see the step it belongs to).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .epoch import DeviceEpoch, epoch_args

# %globaltimer is read with inline asm, which the interpreter cannot run: the default USE_TIMER of the kernels.
TIMER_AVAILABLE = not triton.knobs.runtime.interpret

__all__ = ["DeviceEpoch", "TIMER_AVAILABLE", "wait_for_flag", "signal_kernel", "wait_kernel", "signal_range_kernel", "write_flag", "launch_signal",
           "launch_wait", "launch_signal_range", "read_globaltimer", "epoch_args"]


@triton.jit
def read_globaltimer():
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64,
                                     is_pure=False, pack=1)


@triton.jit
def wait_for_flag(flag_ptr, epoch, timeout_ns, USE_TIMER: tl.constexpr):
    """Acquire-polls ``*flag_ptr`` (scope sys) until it is >= epoch; returns whether it got there in time.

    USE_TIMER: for at most ``timeout_ns`` of %globaltimer time from the first poll. Otherwise one poll.
    """
    seen = tl.atomic_add(flag_ptr, 0, sem="acquire", scope="sys")
    if USE_TIMER:
        start = read_globaltimer()
        now = start
        while (seen < epoch) & (now - start < timeout_ns):
            seen = tl.atomic_add(flag_ptr, 0, sem="acquire", scope="sys")
            now = read_globaltimer()
    return seen >= epoch


@triton.jit
def resolve_epoch(epoch, epoch_ptr, DEVICE_EPOCH: tl.constexpr):
    """The epoch operand: `epoch` itself, or (DEVICE_EPOCH) `*epoch_ptr + epoch`."""
    if DEVICE_EPOCH:
        return tl.load(epoch_ptr, volatile=True) + epoch
    return epoch


# Epochs (and ranges) change every call: never specialise on them, or Triton recompiles at epoch 1 and at
# multiples of 16 (a timing spike, and a compile inside a CUDA-graph capture).
@triton.jit(do_not_specialize=["epoch"])
def signal_kernel(flag_ptr, epoch, epoch_ptr, DEVICE_EPOCH: tl.constexpr):
    tl.atomic_xchg(flag_ptr, resolve_epoch(epoch, epoch_ptr, DEVICE_EPOCH), sem="release", scope="sys")


@triton.jit(do_not_specialize=["epoch", "error_code", "timeout_ns"])
def wait_kernel(flag_ptr, epoch, error_ptr, error_code, timeout_ns, epoch_ptr, USE_TIMER: tl.constexpr,
                DEVICE_EPOCH: tl.constexpr):
    # error_ptr -> [code, expected epoch, abort]; a nonzero abort word (another rank gave up) ends the
    # wait at once, recorded with code -1.
    epoch = resolve_epoch(epoch, epoch_ptr, DEVICE_EPOCH)
    seen = tl.atomic_add(flag_ptr, 0, sem="acquire", scope="sys")
    abort = tl.load(error_ptr + 2, volatile=True)
    if USE_TIMER:
        start = read_globaltimer()
        now = start
        while (seen < epoch) & (now - start < timeout_ns) & (abort == 0):
            seen = tl.atomic_add(flag_ptr, 0, sem="acquire", scope="sys")
            abort = tl.load(error_ptr + 2, volatile=True)
            now = read_globaltimer()
    if seen < epoch:
        code = tl.where(abort != 0, -1, error_code)
        old = tl.atomic_cas(error_ptr, 0, code, sem="relaxed", scope="gpu")
        if old == 0:
            tl.store(error_ptr + 1, epoch)


def _stream_write_value32():
    """torch's cuStreamWriteValue32 wrapper (flat uint32 tensor, element offset, value), if this build has it."""
    symm = getattr(getattr(torch._C, "_distributed_c10d", None), "_SymmetricMemory", None)
    return getattr(symm, "stream_write_value32", None)


_memop = {"write": _stream_write_value32()}


def write_flag(flags: torch.Tensor, index: int, epoch: "int | DeviceEpoch") -> None:
    """Enqueue on the current stream: flags[index] = epoch, ordered after the stream's earlier work.

    A host epoch goes as a stream memory operation (cuStreamWriteValue32 through torch, fenced: ~3 us of
    host time and no SM, which matters while a persistent GEMM holds the SMs); a `DeviceEpoch`, or memory
    the memop does not support, as the release-store kernel (~20 us of host time, one SM for a moment).
    """
    if _memop["write"] is not None and flags.is_cuda and not isinstance(epoch, DeviceEpoch):
        try:
            _memop["write"](flags.view(torch.uint32), index, epoch)
            return
        except RuntimeError:
            _memop["write"] = None  # not for this memory: the kernel from now on
    launch_signal(flags[index:index + 1], epoch)


def launch_signal(flag: torch.Tensor, epoch: "int | DeviceEpoch") -> None:
    """Enqueue on the current stream: flag[0] = epoch with release semantics at system scope."""
    value, counter, device_epoch = epoch_args(epoch)
    signal_kernel[(1,)](flag, value, counter, DEVICE_EPOCH=device_epoch)


def launch_wait(flag: torch.Tensor, epoch: "int | DeviceEpoch", error_words: torch.Tensor, *, error_code: int,
                timeout_ns: int) -> None:
    """Enqueue on the current stream a wait for flag[0] >= epoch, at most `timeout_ns`.

    `error_words` is an int32 tensor of 3 words: [code, expected epoch, abort]; code and epoch are written
    only on expiry (code -1 when the abort word ended the wait).
    """
    value, counter, device_epoch = epoch_args(epoch)
    wait_kernel[(1,)](flag, value, error_words, error_code, timeout_ns, counter, USE_TIMER=flag.is_cuda,
                      DEVICE_EPOCH=device_epoch)


@triton.jit(do_not_specialize=["first", "count", "epoch"])
def signal_range_kernel(flag_ptr, first, count, epoch, epoch_ptr, BLOCK: tl.constexpr, DEVICE_EPOCH: tl.constexpr):
    epoch = resolve_epoch(epoch, epoch_ptr, DEVICE_EPOCH)
    offsets = first + tl.arange(0, BLOCK)
    for start in range(0, count, BLOCK):
        tl.atomic_xchg(flag_ptr + start + offsets, epoch, mask=start + tl.arange(0, BLOCK) < count,
                       sem="release", scope="sys")


def launch_signal_range(flags: torch.Tensor, first: int, count: int, epoch: "int | DeviceEpoch") -> None:
    """Enqueue on the current stream: flags[first:first + count] = epoch (release, system scope)."""
    value, counter, device_epoch = epoch_args(epoch)
    signal_range_kernel[(1,)](flags, first, count, value, counter, BLOCK=128, DEVICE_EPOCH=device_epoch)
