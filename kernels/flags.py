"""Device flags inside kernels: the bounded acquire wait and the error record of an expired one.

Every flag a kernel waits for is a toggle: its writer stores SET (1) with release semantics at system
scope, and the kernel waits until it reads SET (acquire, system scope). Nobody in the kernel resets it:
the launcher resets the flags with stream memory operations after the kernel, before the handshake that
lets the writer set them again (overlap/ops/protocol.py), so the awaited value is the same in every call and a
captured CUDA graph replays the same protocol.

The wait is bounded by ``timeout_ns`` of %globaltimer, read every 64 polls as the maximum over the
program's threads, so that every thread leaves the loop at the same poll (per-thread reads let warps cross
the bound at different polls and desynchronise their barriers). Time, not a count of polls: a peer still
JIT-compiling takes seconds, and where processes share a GPU a poll can take far longer than on an idle one
(kernels/gemm_gluon_wait.py: a count of polls let a 10 s bound run past 140 s). It also ends early when the
pool's abort word is set (another rank gave up). `error_ptr` is the pool's control page (host memory mapped
for the device): [code, value, abort].
On expiry the kernel stores its error code and the value it waited for there; the pool's watchdog sees
it, aborts the group, and the host raises on every rank.
"""

from __future__ import annotations

import triton
import triton.language as tl

# The interpreter runs a launch's programs one after another, so a flag set by another program or a peer never
# changes inside its poll loop: there the kernels poll once (USE_TIMER False) and the host waits for the flags
# first. The default USE_TIMER of the kernels.
TIMER_AVAILABLE = not triton.knobs.runtime.interpret

from .constants import CLEAR, MISMATCH_BIT, SET  # the flag values and the error code's bit (kernels/constants.py)

SET_FLAG = tl.constexpr(SET)  # the same, for @triton.jit code (kernels read only constexpr globals)
MISMATCH_FLAG_BIT = tl.constexpr(MISMATCH_BIT)

__all__ = ["TIMER_AVAILABLE", "SET", "CLEAR", "SET_FLAG", "MISMATCH_BIT", "MISMATCH_FLAG_BIT", "wait_for_flag",
           "wait_for_value", "wait_for_count", "await_flag", "record_error", "record_mismatch"]


CHECK_EVERY = tl.constexpr(64)  # polls between reads of the clock and of the abort word (a PCIe round trip)

# What a poll loop waits for (the UNTIL argument of `_poll_until`).
UNTIL_EQUAL = tl.constexpr(0)      # the flag equals `target`
UNTIL_NONZERO = tl.constexpr(1)    # the flag is nonzero (the caller compares the value)
UNTIL_AT_LEAST = tl.constexpr(2)   # the flag is >= `target` (a count raised by programs of the same launch)


@triton.jit
def _waiting(seen, target, UNTIL: tl.constexpr):
    if UNTIL == UNTIL_EQUAL:
        pending = seen != target
    elif UNTIL == UNTIL_NONZERO:
        pending = seen == 0
    else:
        pending = seen < target
    return pending


@triton.jit
def _poll_until(flag_ptr, target, error_ptr, timeout_ns, UNTIL: tl.constexpr, SCOPE: tl.constexpr,
                USE_TIMER: tl.constexpr):
    """The one bounded poll loop; returns the last value seen. Every value that decides when the loop ends
    is uniform over the program: the flag comes from a scalar atomic, which one thread performs and every
    thread receives; the clock and the abort word are reduced over the program (`_uniform_clock_ns`,
    `_uniform_load`). Bounded by `timeout_ns` of %globaltimer, checked every CHECK_EVERY polls; with an
    `error_ptr` (a peer is involved) the loop also ends when the pool's abort word is set. Without USE_TIMER
    (the interpreter) it polls once."""
    seen = tl.atomic_add(flag_ptr, 0, sem="acquire", scope=SCOPE)
    if USE_TIMER:
        if _waiting(seen, target, UNTIL):  # the clock only once it must wait (its reduction syncs the program)
            start = _uniform_clock_ns()
            abort = seen * 0
            polls = seen * 0
            expired = seen * 0
            while _waiting(seen, target, UNTIL) & (expired == 0) & (abort == 0):
                seen = tl.atomic_add(flag_ptr, 0, sem="acquire", scope=SCOPE)
                polls += 1
                if polls % CHECK_EVERY == 0:
                    expired = (_uniform_clock_ns() - start > timeout_ns).to(seen.dtype)
                    if error_ptr is not None:
                        abort = _uniform_load(error_ptr + 2)
    return seen


@triton.jit
def _uniform_clock_ns():
    """%globaltimer (ns) as every thread of the program agrees on it: each thread's read, reduced over the
    whole block (as `_uniform_load`)."""
    now = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,r", [tl.zeros([256], dtype=tl.int32)],
                                    dtype=tl.int64, is_pure=False, pack=1)
    return tl.max(now, axis=0)


@triton.jit
def _uniform_load(ptr):
    """A volatile load whose value every thread of the program agrees on: loaded by every thread (host
    memory takes no atomics over PCIe), then reduced across the whole block (at least as many elements as
    threads, so no warp reduces a private copy)."""
    values = tl.load(ptr + tl.zeros([256], dtype=tl.int32), volatile=True)
    return tl.max(values, axis=0)


@triton.jit
def wait_for_flag(flag_ptr, error_ptr, timeout_ns, USE_TIMER: tl.constexpr):
    """Acquire-polls ``*flag_ptr`` (scope sys) until it is SET; returns whether it got there. Bounded as
    `_poll_until`: ``timeout_ns``, or until the abort word ``error_ptr[2]`` is nonzero."""
    return _poll_until(flag_ptr, SET_FLAG, error_ptr, timeout_ns, UNTIL_EQUAL, "sys", USE_TIMER) == SET_FLAG


@triton.jit
def wait_for_value(flag_ptr, error_ptr, timeout_ns, USE_TIMER: tl.constexpr):
    """Acquire-polls ``*flag_ptr`` (scope sys) until it is nonzero; returns the value seen (0: the wait
    expired, or the group aborted). Bounds as in `wait_for_flag`."""
    return _poll_until(flag_ptr, 0, error_ptr, timeout_ns, UNTIL_NONZERO, "sys", USE_TIMER)


@triton.jit
def wait_for_count(flag_ptr, value, timeout_ns, USE_TIMER: tl.constexpr):
    """Acquire-polls (scope gpu) a flag that programs of the SAME launch raise, until it is >= value (at most
    timeout_ns). No peer is involved, so no abort word is read."""
    return _poll_until(flag_ptr, value, None, timeout_ns, UNTIL_AT_LEAST, "gpu", USE_TIMER) >= value


@triton.jit
def await_flag(flag_ptr, expected, error_ptr, code, timeout_ns, USE_TIMER: tl.constexpr):
    """The wait of every flag a peer writes: until the flag is nonzero (bounded, as `wait_for_value`), then
    records an expired wait (`code`) or a disagreement (another nonzero value: `code` with MISMATCH_BIT) in the
    control page. Returns whether the flag holds `expected`."""
    seen = wait_for_value(flag_ptr, error_ptr, timeout_ns, USE_TIMER)
    if seen == 0:
        record_error(error_ptr, code)
    elif seen != expected:
        record_mismatch(error_ptr, code, expected, seen)
    return seen == expected


@triton.jit
def record_error(error_ptr, code):
    """Store an expired wait's code (and the value it waited for) in the control page, unless one is there."""
    if tl.load(error_ptr, volatile=True) == 0:
        tl.store(error_ptr + 1, 1)
        tl.store(error_ptr, code)


@triton.jit
def record_mismatch(error_ptr, code, expected, seen):
    """Store a disagreement (the flag held `seen`, not `expected`) in the control page, unless a failure is
    there: word 3 the value seen, word 1 the value awaited, word 0 the code with MISMATCH_BIT."""
    if tl.load(error_ptr, volatile=True) == 0:
        tl.store(error_ptr + 3, seen)
        tl.store(error_ptr + 1, expected)
        tl.store(error_ptr, code | MISMATCH_FLAG_BIT)
