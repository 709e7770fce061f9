"""A copy of some columns of every row (an AllGather chunk's group-major FP8 scales) is one copy-engine 2D
copy, built once: the struct cuMemcpy2DAsync reads, and the program driver's choice of it (no GPU here: a fake
driver records what would be enqueued; tests/gpu/smoke_one_gpu.py runs the real copies)."""

import ctypes

import pytest
import torch

from tp_overlap.ops import program as program_module
from tp_overlap.ops.program import CudaDriver, _Step
from tp_overlap.symm_mem import memops


class _FakeDriver:
    def __init__(self):
        self.copies = []

    def memcpy_2d(self, pointer, stream):
        copy = memops._Copy2D.from_address(pointer)
        self.copies.append({name: getattr(copy, name) for name, _ in memops._Copy2D._fields_} | {"stream": stream})
        return 0


def test_a_2d_copy_names_both_pitches_the_row_bytes_and_the_rows(monkeypatch):
    fake = _FakeDriver()
    monkeypatch.setattr(memops._Driver, "get", classmethod(lambda cls: fake))
    copy = memops.Memcpy2D(dst=0x7000_0000_1000, dst_pitch=4096, src=0x7100_0000_2000, src_pitch=2048,
                           width_bytes=512, height=33)
    copy.enqueue(17)
    copy.enqueue(18)  # built once, enqueued again unchanged
    first, second = fake.copies
    assert first["dstDevice"] == 0x7000_0000_1000 and first["srcDevice"] == 0x7100_0000_2000
    assert (first["dstPitch"], first["srcPitch"], first["WidthInBytes"], first["Height"]) == (4096, 2048, 512, 33)
    assert first["dstMemoryType"] == first["srcMemoryType"] == 2  # CU_MEMORYTYPE_DEVICE
    assert (first["srcXInBytes"], first["srcY"], first["dstXInBytes"], first["dstY"]) == (0, 0, 0, 0)
    assert {k: v for k, v in second.items() if k != "stream"} == {k: v for k, v in first.items() if k != "stream"}
    assert (first["stream"], second["stream"]) == (17, 18)
    assert ctypes.sizeof(memops._Copy2D) == 128  # CUDA_MEMCPY2D on a 64-bit host


@pytest.mark.parametrize("width, pitches", [(0, (64, 64)), (65, (64, 128)), (65, (128, 64))])
def test_a_2d_copy_wider_than_a_pitch_or_empty_is_refused(monkeypatch, width, pitches):
    monkeypatch.setattr(memops._Driver, "get", classmethod(lambda cls: _FakeDriver()))
    with pytest.raises(memops.MemOpError, match="0 < width_bytes <= both pitches"):
        memops.Memcpy2D(dst=1, dst_pitch=pitches[0], src=2, src_pitch=pitches[1], width_bytes=width, height=1)


class _Recorder:
    """Stands in for the memops module: what the driver would build."""

    def __init__(self):
        self.built = []

    def Memcpy2D(self, **kwargs):  # noqa: N802 - the class it stands for
        self.built.append(kwargs)
        return type("Copy", (), {"enqueue": lambda self, stream: None})()

    def memcpy_async(self, *args):
        raise AssertionError("a strided copy is not one contiguous copy")


def test_the_driver_copies_columns_of_every_row_with_one_2d_copy_and_contiguous_blocks_with_memcpy():
    columns = torch.zeros(8, 36)   # group-major scales: [groups, max_m padded to 4]
    peer = torch.ones(8, 36)
    recorder = _Recorder()
    enqueue, needs_stream = CudaDriver._enqueuer(None, _Step("copy", "comm", (columns[:, 12:21], peer[:, 12:21])),
                                                 recorder)
    assert not needs_stream
    (built,) = recorder.built
    assert built == {"dst": columns[:, 12:].data_ptr(), "dst_pitch": 36 * 4, "src": peer[:, 12:].data_ptr(),
                     "src_pitch": 36 * 4, "width_bytes": 9 * 4, "height": 8}
    # a transposed view is not rows of contiguous columns: torch's copy (the lane's stream made current)
    _, needs_stream = CudaDriver._enqueuer(None, _Step("copy", "comm", (columns.t()[:4], peer.t()[:4])), recorder)
    assert needs_stream and len(recorder.built) == 1
    assert program_module._pitched(columns[:, 3:5]) and not program_module._pitched(columns.t())
    assert not program_module._pitched(columns[:0])
