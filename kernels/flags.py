"""Device flags inside kernels: the bounded acquire wait and the error record of an expired one.

Every flag a kernel waits for is a toggle: its writer stores SET (1) with release semantics at system
scope, and the kernel waits until it reads SET (acquire, system scope). Nobody in the kernel resets it:
the launcher resets the flags with stream memory operations after the kernel, before the handshake that
lets the writer set them again (overlap/protocol.py), so the awaited value is the same in every call and a
captured CUDA graph replays the same protocol.

The wait is bounded by wall time read from %globaltimer (not by a spin count: a peer that is still
JIT-compiling can take seconds). It also ends early when the pool's abort word is set (another rank gave
up). `error_ptr` is the pool's control page (host memory mapped for the device): [code, value, abort].
On expiry the kernel stores its error code and the value it waited for there; the pool's watchdog sees
it, aborts the group, and the host raises on every rank.
"""

from __future__ import annotations

import triton
import triton.language as tl

# %globaltimer is read with inline asm, which the interpreter cannot run: the default USE_TIMER of the kernels.
TIMER_AVAILABLE = not triton.knobs.runtime.interpret

SET = 1                    # the value a writer stores (Python side)
SET_FLAG = tl.constexpr(1)  # the same, for @triton.jit code (kernels read only constexpr globals)

__all__ = ["TIMER_AVAILABLE", "SET", "SET_FLAG", "read_globaltimer", "wait_for_flag", "wait_for_count", "record_error"]


@triton.jit
def read_globaltimer():
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64,
                                     is_pure=False, pack=1)


@triton.jit
def wait_for_flag(flag_ptr, error_ptr, timeout_ns, USE_TIMER: tl.constexpr):
    """Acquire-polls ``*flag_ptr`` (scope sys) until it is SET; returns whether it got there.

    USE_TIMER: for at most ``timeout_ns`` of %globaltimer time from the first poll, or until the abort word
    ``error_ptr[2]`` is nonzero. Otherwise (the interpreter) one poll.
    """
    seen = tl.atomic_add(flag_ptr, 0, sem="acquire", scope="sys")
    if USE_TIMER:
        start = read_globaltimer()
        now = start
        abort = seen * 0
        polls = seen * 0
        while (seen != 1) & (now - start < timeout_ns) & (abort == 0):
            seen = tl.atomic_add(flag_ptr, 0, sem="acquire", scope="sys")
            polls += 1
            if polls % 64 == 0:  # the abort word is host memory (a PCIe round trip): read it now and then
                abort = tl.load(error_ptr + 2, volatile=True)
            now = read_globaltimer()
    return seen == 1


@triton.jit
def wait_for_count(flag_ptr, value, timeout_ns, USE_TIMER: tl.constexpr):
    """Acquire-polls a flag that programs of the SAME launch raise, until it is >= value (at most timeout_ns
    of %globaltimer time; one poll without USE_TIMER). No peer is involved, so no abort word is read."""
    seen = tl.atomic_add(flag_ptr, 0, sem="acquire", scope="gpu")
    if USE_TIMER:
        start = read_globaltimer()
        now = start
        while (seen < value) & (now - start < timeout_ns):
            seen = tl.atomic_add(flag_ptr, 0, sem="acquire", scope="gpu")
            now = read_globaltimer()
    return seen >= value


@triton.jit
def record_error(error_ptr, code):
    """Store an expired wait's code (and the value it waited for) in the control page, unless one is there."""
    if tl.load(error_ptr, volatile=True) == 0:
        tl.store(error_ptr + 1, 1)
        tl.store(error_ptr, code)
