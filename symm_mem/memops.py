"""Stream memory operations: 32-bit waits and writes that a CUDA stream executes without an SM.

A wait that gates a copy-engine copy or a signal must not be a kernel: a one-SM spin kernel cannot start
while a persistent GEMM holds every SM, and the copy engine then idles behind it. `cuStreamBatchMemOp`
enqueues waits and writes that the GPU's front end executes (~2 us of host time for a batch).

Batches are built once (a ctypes array of `CUstreamBatchMemOpParams`) and enqueued many times, so a call
costs one foreign-function call. The driver is reached through `libcuda.so.1` with ctypes
(`cuStreamBatchMemOp_v2`, the version enabled on every platform); nothing here is imported on CPU.
"""

from __future__ import annotations

import ctypes
import threading
from typing import NamedTuple, Sequence

from tp_overlap.ipc.errors import OverlapError

__all__ = ["MemOp", "MemOpBatch", "MemOpError", "wait_eq", "wait_geq", "write", "host_register", "host_unregister",
           "memcpy_async", "Memcpy2D"]

_OP_WAIT_VALUE_32 = 1
_OP_WRITE_VALUE_32 = 2
_WAIT_GEQ = 0
_WAIT_EQ = 1
_PARAMS_BYTES = 48  # sizeof(CUstreamBatchMemOpParams): a union padded to 6 x uint64
_MAX_BATCH = 255    # the driver refuses 256 or more operations in one call
_HOST_REGISTER_PORTABLE_MAPPED = 0x01 | 0x02  # CU_MEMHOSTREGISTER_PORTABLE | DEVICEMAP
_INVALID_CONTEXT = 201  # CUDA_ERROR_INVALID_CONTEXT
_MEMORYTYPE_DEVICE = 2  # CU_MEMORYTYPE_DEVICE


class MemOpError(OverlapError, RuntimeError):
    """The CUDA driver refused a stream memory operation (or the driver is not there)."""


class MemOp(NamedTuple):
    """`wait` until *address == value, `wait_geq` until (int32)(*address - value) >= 0, or `write` value
    to *address (32-bit words, device addresses)."""
    kind: str
    address: int
    value: int


def wait_eq(address: int, value: int) -> MemOp:
    return MemOp("wait", address, value)


def wait_geq(address: int, value: int) -> MemOp:
    return MemOp("wait_geq", address, value)


def write(address: int, value: int) -> MemOp:
    return MemOp("write", address, value)


class _WaitWrite(ctypes.Structure):
    # CUstreamMemOpWaitValueParams / ...WriteValueParams share this layout (offsets 0, 8, 16, 24, 32)
    _fields_ = [("operation", ctypes.c_uint32), ("address", ctypes.c_uint64), ("value", ctypes.c_uint64),
                ("flags", ctypes.c_uint32), ("alias", ctypes.c_uint64)]


class _Params(ctypes.Union):
    _fields_ = [("op", _WaitWrite), ("pad", ctypes.c_uint64 * 6)]


assert ctypes.sizeof(_Params) == _PARAMS_BYTES


class _Copy2D(ctypes.Structure):
    # CUDA_MEMCPY2D (v2): source fields, destination fields, then the extent
    _fields_ = [("srcXInBytes", ctypes.c_size_t), ("srcY", ctypes.c_size_t), ("srcMemoryType", ctypes.c_int),
                ("srcHost", ctypes.c_void_p), ("srcDevice", ctypes.c_uint64), ("srcArray", ctypes.c_void_p),
                ("srcPitch", ctypes.c_size_t),
                ("dstXInBytes", ctypes.c_size_t), ("dstY", ctypes.c_size_t), ("dstMemoryType", ctypes.c_int),
                ("dstHost", ctypes.c_void_p), ("dstDevice", ctypes.c_uint64), ("dstArray", ctypes.c_void_p),
                ("dstPitch", ctypes.c_size_t),
                ("WidthInBytes", ctypes.c_size_t), ("Height", ctypes.c_size_t)]


assert ctypes.sizeof(_Copy2D) == 128


class _Driver:
    """The few libcuda entry points this module needs, resolved once per process."""

    _lock = threading.Lock()
    _instance: "_Driver | None" = None

    def __init__(self):
        try:
            lib = ctypes.CDLL("libcuda.so.1")
        except OSError as exc:
            raise MemOpError(f"libcuda.so.1 cannot be loaded ({exc}); stream memory operations need the "
                             f"CUDA driver") from None
        self.batch = lib.cuStreamBatchMemOp_v2
        self.batch.argtypes = [ctypes.c_void_p, ctypes.c_uint, ctypes.c_void_p, ctypes.c_uint]
        self.batch.restype = ctypes.c_int
        self.memcpy = lib.cuMemcpyAsync
        self.memcpy.argtypes = [ctypes.c_uint64, ctypes.c_uint64, ctypes.c_size_t, ctypes.c_void_p]
        self.memcpy.restype = ctypes.c_int
        self.memcpy_2d = lib.cuMemcpy2DAsync_v2
        self.memcpy_2d.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
        self.memcpy_2d.restype = ctypes.c_int
        self.register = lib.cuMemHostRegister_v2
        self.register.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint]
        self.register.restype = ctypes.c_int
        self.unregister = lib.cuMemHostUnregister
        self.unregister.argtypes = [ctypes.c_void_p]
        self.unregister.restype = ctypes.c_int
        self.device_pointer = lib.cuMemHostGetDevicePointer_v2
        self.device_pointer.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.c_void_p, ctypes.c_uint]
        self.device_pointer.restype = ctypes.c_int
        self.retain = lib.cuDevicePrimaryCtxRetain
        self.retain.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_int]
        self.retain.restype = ctypes.c_int
        self.set_current = lib.cuCtxSetCurrent
        self.set_current.argtypes = [ctypes.c_void_p]
        self.set_current.restype = ctypes.c_int

    def make_context_current(self) -> None:
        """A thread that has made no CUDA runtime call yet (a fresh worker thread) has no current context:
        make the current device's primary context current (the one torch's runtime calls use)."""
        import torch
        context = ctypes.c_void_p()
        _check(self.retain(ctypes.byref(context), torch.cuda.current_device()), "cuDevicePrimaryCtxRetain")
        _check(self.set_current(context), "cuCtxSetCurrent")

    @classmethod
    def get(cls) -> "_Driver":
        with cls._lock:
            if cls._instance is None:
                cls._instance = _Driver()
            return cls._instance


def _check(code: int, what: str) -> None:
    if code != 0:
        raise MemOpError(f"{what} failed with CUresult {code}")


class MemOpBatch:
    """Waits and writes enqueued together, in order, by one `cuStreamBatchMemOp` (built once).

    Every write is fenced (the default flags): earlier work of the stream is visible before the value.
    """

    def __init__(self, ops: Sequence[MemOp]):
        if not 0 < len(ops) <= _MAX_BATCH:
            raise MemOpError(f"a batch holds 1..{_MAX_BATCH} operations, got {len(ops)}")
        self.ops = tuple(ops)
        self._array = (_Params * len(ops))()
        for slot, op in zip(self._array, ops):
            if op.kind not in ("wait", "wait_geq", "write"):
                raise MemOpError(f"unknown memory operation {op.kind!r}")
            slot.op.operation = _OP_WRITE_VALUE_32 if op.kind == "write" else _OP_WAIT_VALUE_32
            slot.op.address = op.address
            slot.op.value = op.value & 0xFFFFFFFF
            slot.op.flags = {"wait": _WAIT_EQ, "wait_geq": _WAIT_GEQ, "write": 0}[op.kind]
        self._pointer = ctypes.addressof(self._array)
        self._count = len(ops)
        self._driver = _Driver.get()

    def enqueue(self, stream_handle: int) -> None:
        """Enqueue on the CUDA stream with this raw handle (`torch.cuda.Stream.cuda_stream`)."""
        code = self._driver.batch(stream_handle, self._count, self._pointer, 0)
        if code == _INVALID_CONTEXT:
            self._driver.make_context_current()
            code = self._driver.batch(stream_handle, self._count, self._pointer, 0)
        if code:
            raise MemOpError(f"cuStreamBatchMemOp of {self._count} operations ({self.ops[0]}, ...) failed "
                             f"with CUresult {code}")


def memcpy_async(dst: int, src: int, nbytes: int, stream_handle: int) -> None:
    """`cuMemcpyAsync` between device (or mapped) addresses: the copy engine, no torch dispatch."""
    _check(_Driver.get().memcpy(dst, src, nbytes, stream_handle), f"cuMemcpyAsync of {nbytes} bytes")


class Memcpy2D:
    """A pitched copy of `height` rows of `width_bytes` between device (or mapped) addresses, built once and
    enqueued many times by `cuMemcpy2DAsync`: one copy-engine copy for a strided block such as some columns
    of every row of a matrix (a rank's scales in the gathered, group-major FP8 scales)."""

    def __init__(self, *, dst: int, dst_pitch: int, src: int, src_pitch: int, width_bytes: int, height: int):
        if not 0 < width_bytes <= min(dst_pitch, src_pitch) or height < 1:
            raise MemOpError(f"a 2D copy needs 0 < width_bytes <= both pitches and height >= 1, got width_bytes="
                             f"{width_bytes}, pitches {dst_pitch} / {src_pitch}, height {height}")
        self._copy = _Copy2D(srcMemoryType=_MEMORYTYPE_DEVICE, srcDevice=src, srcPitch=src_pitch,
                             dstMemoryType=_MEMORYTYPE_DEVICE, dstDevice=dst, dstPitch=dst_pitch,
                             WidthInBytes=width_bytes, Height=height)
        self._pointer = ctypes.addressof(self._copy)
        self._what = f"cuMemcpy2DAsync of {height} x {width_bytes} bytes"
        self._driver = _Driver.get()

    def enqueue(self, stream_handle: int) -> None:
        _check(self._driver.memcpy_2d(self._pointer, stream_handle), self._what)


def host_register(address: int, nbytes: int) -> int:
    """Page-lock and map host memory for the device; returns its device address."""
    import torch
    torch.cuda.synchronize()  # the runtime's primary context exists and is current in this thread
    driver = _Driver.get()
    _check(driver.register(address, nbytes, _HOST_REGISTER_PORTABLE_MAPPED), "cuMemHostRegister")
    device_address = ctypes.c_uint64()
    _check(driver.device_pointer(ctypes.byref(device_address), address, 0), "cuMemHostGetDevicePointer")
    return device_address.value


def host_unregister(address: int) -> None:
    _check(_Driver.get().unregister(address), "cuMemHostUnregister")
