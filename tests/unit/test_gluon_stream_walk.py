"""The streamed tail's walk (kernels/gemm_gluon_walk.py `streamed_items` / `streamed_item`, run by every partition
of kernels/gemm_gluon_stream.py) and its launcher's plan (overlap/gemm/gluon_launch.py `streamed_tail`).

Gluon functions do not run under the interpreter, so the walk's own Python bodies run here on integers (a
stand-in for the few `gl` calls they make); the kernel's numerics are checked on the GPU
(tests/gpu/check_gluon_gemm.py, check_gluon_chunk_wait.py)."""

import random
import types

import pytest
import torch

from tp_overlap.gemm import GemmBlocks
from tp_overlap.gemm.gluon_launch import split_buffers, split_tail, stream_plan, streamed_tail
from tp_overlap.kernels import gemm_gluon_walk


class _Program:
    """The `gl` calls of the walk for program `pid` of `programs`, on Python integers."""
    int32 = "int32"

    def __init__(self, pid: int, programs: int):
        self.pid, self.programs = pid, programs

    def program_id(self, axis):
        return self.pid

    def num_programs(self, axis):
        return self.programs

    cdiv = staticmethod(lambda a, b: -(-a // b))
    maximum, minimum = staticmethod(max), staticmethod(min)
    where = staticmethod(lambda cond, a, b: a if cond else b)


def _walk_functions(pid: int, programs: int):
    gl = _Program(pid, programs)
    names = ("streamed_items", "streamed_item", "_step_owner")
    scope = dict(vars(gemm_gluon_walk), gl=gl)
    for name in names:
        fn = getattr(gemm_gluon_walk, name).fn
        scope[name] = types.FunctionType(fn.__code__, scope, name)
    return scope["streamed_items"], scope["streamed_item"]


def _pieces(tiles: int, whole_tiles: int, num_k: int, programs: int):
    """{program: [(tile, first k, end k, slot, pieces, first slot)]} as the kernel's partitions walk them."""
    out = {}
    for pid in range(programs):
        items_of, item = _walk_functions(pid, programs)
        whole, first, end, items = items_of(whole_tiles, tiles, num_k)
        out[pid] = [item(i, whole, first, end, whole_tiles, tiles, num_k) for i in range(items)]
    return out


def _check_walk(tiles: int, whole_tiles: int, num_k: int, programs: int) -> list[int]:
    covered, slots, by_tile, steps = set(), set(), {}, []
    for pid, pieces in _pieces(tiles, whole_tiles, num_k, programs).items():
        steps.append(sum(end_k - first_k for _, first_k, end_k, *_ in pieces))
        for tile, first_k, end_k, slot, count, first_slot in pieces:
            assert 0 <= first_k < end_k <= num_k, (pid, tile, first_k, end_k)
            for k in range(first_k, end_k):
                assert (tile, k) not in covered, f"step {k} of tile {tile} twice"
                covered.add((tile, k))
            if slot < 0:  # a whole tile: stored at once
                assert (first_k, end_k, count) == (0, num_k, 1)
                continue
            assert tile >= whole_tiles and slot not in slots and first_slot <= slot < first_slot + count
            assert slot < programs + tiles - whole_tiles - 1, "past the workspace the launcher sizes"
            slots.add(slot)
            by_tile.setdefault(tile, []).append((first_k, slot, count, first_slot))
    assert len(covered) == tiles * num_k, "a K step of some tile was never computed"
    for tile, pieces in by_tile.items():  # the last arrival sums `count` partials from `first_slot`, in K order
        pieces.sort()
        assert [slot for _, slot, _, _ in pieces] == list(range(pieces[0][3], pieces[0][3] + len(pieces)))
        assert all(count == len(pieces) and first == pieces[0][3] for _, _, count, first in pieces), tile
    return steps


def test_112_tiles_of_64_steps_on_132_programs_take_54_or_55_steps_each():
    steps = _check_walk(112, 0, 64, 132)
    assert set(steps) == {54, 55} and sum(steps) == 112 * 64


@pytest.mark.parametrize("seed", range(4))
def test_every_step_is_computed_once_and_every_cut_tile_summed_in_k_order(seed):
    rng = random.Random(seed)
    for _ in range(60):
        programs, num_k = rng.randint(1, 40), rng.randint(1, 40)
        tiles = rng.randint(1, 3 * programs)
        whole_tiles = rng.choice([0, tiles // programs * programs])
        if (tiles - whole_tiles) * num_k >= programs:  # the launcher's precondition: a step per program
            _check_walk(tiles, whole_tiles, num_k, programs)


def test_the_launcher_streams_few_long_tiles_and_keeps_its_plan_elsewhere():
    cpu = torch.device("cpu")
    blocks = GemmBlocks.parse("128x256x64w4s3sk1gl")
    buffers = split_buffers(cpu, 132)
    programs, whole, workspace, counters = streamed_tail(blocks, 1024, 3584, 4096, 132, cpu, buffers)
    assert (programs, whole) == (132, 0) and workspace is buffers[0] and counters is buffers[1]
    assert (132 + 112 - 1) * 128 * 256 <= workspace.numel() and 2 * 112 <= counters.numel()
    assert stream_plan(112, 132, 64, 2 * 128 * 256 * 4096) < 2 * 128 * 256 * 4096 / 5.6e12, "sooner than whole"
    assert split_tail(blocks, 1024, 3584, 4096, 132, cpu, buffers)[1:3] == (112, 1), "equal K halves cannot help"
    # not streamed: full waves, a tile the kernel does not run, no sk1, K too short, buffers too small
    assert streamed_tail(blocks, 4096, 8192, 4096, 132, cpu, buffers) is None
    for name in ("192x128x64w4s4sk1gl", "128x256x64w4s3gl", "128x96x64w4s7gl"):
        assert streamed_tail(GemmBlocks.parse(name), 1024, 3584, 4096, 132, cpu, buffers) is None, name
    assert stream_plan(112, 132, 8, 2 * 128 * 256 * 512) is None, "7 K steps a program: the fix-up costs more"
    assert streamed_tail(blocks, 1024, 3584, 4096, 132, cpu, (buffers[0][:132 * 128 * 256], buffers[1])) is None
    assert streamed_tail(blocks, 1024, 3584, 4096, 132, cpu, (buffers[0], buffers[1][:100])) is None


def test_the_allgather_consumer_may_stream_where_its_tiles_leave_sms_idle():
    from tp_overlap.ops.ag_consumers import consumer_gluon_blocks

    # TP 8's llama8b fc1 at M = 1024: 112 tiles of 128 x 256 on 132 SMs
    got = consumer_gluon_blocks(1024, 3584, 4096, b_transposed=True, gpu="h100", programs=132)
    assert got.name == "128x256x64w4s3sk1gl" and not got.problems()
    assert streamed_tail(got, 1024, 3584, 4096, 132, torch.device("cpu"), split_buffers(torch.device("cpu"), 132))
    assert consumer_gluon_blocks(1024, 3584, 4096, b_transposed=True, gpu="h100", programs=132).name == got.name
