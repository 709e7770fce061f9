"""The cluster GEMM (kernels/gemm_gluon_cluster.py, 2- and 4-CTA clusters) and its probe: tile names,
shared-memory fit, and the compiled kernel's shape (its numerics and speed are measured on the GPU by launch.cluster_gemm_probe: Gluon
kernels do not run under the interpreter, and clusters need Triton >= 3.7)."""

import re

import pytest
import torch

from tp_overlap.launch.cluster_gemm_probe import (DEFAULT_POINTS, SHARED_MEMORY_LIMIT, ClusterTile, cluster_support_problem,
                                       compile_cluster_gemm, main, parse_points)


@pytest.mark.parametrize("text,bn0,bn1,splits,stages", [
    ("64+32", 64, 32, 1, 6), ("64+16x2", 64, 16, 2, 6), ("32+16n2", 32, 16, 1, 6), ("128+32x2", 128, 32, 2, 4),
    ("128+128x3", 128, 128, 3, 2),
])
def test_tiles_parse_and_take_as_many_stages_as_fit(text, bn0, bn1, splits, stages):
    tile = ClusterTile.parse(text)
    assert (tile.bn0, tile.bn1, tile.splits, tile.stages, tile.name) == (bn0, bn1, splits, stages, text)
    stage_bytes = (2 * 64 + bn0 + bn1) * 64 * 2
    c_bytes = 2 * 64 * (bn0 + bn1) * (4 if splits > 1 else 2)
    assert c_bytes + stages * stage_bytes <= SHARED_MEMORY_LIMIT - 1024
    assert stages == 6 or c_bytes + (stages + 1) * stage_bytes > SHARED_MEMORY_LIMIT - 1024


@pytest.mark.parametrize("text,problem", [
    ("64", "expected BN0+BN1"), ("64+48", "powers of two"), ("8+16", "powers of two"), ("64+32x0", "splits"),
    ("256+256x2", "do not fit"), ("a+b", "expected BN0+BN1"), ("64+32n3", "must be 1 or 2"),
])
def test_bad_tiles_say_what_is_wrong(text, problem):
    with pytest.raises(ValueError, match=re.escape(problem)):
        ClusterTile.parse(text)


def test_points_parse_and_bad_points_are_refused():
    points = parse_points(DEFAULT_POINTS)
    assert [shape for shape, _ in points][:4] == [(1024, 1536, 4096), (2048, 768, 4096), (1024, 768, 4096),
                                                  (1024, 1280, 8192)]
    assert all(tiles for _, tiles in points)
    for text in ("1024x1536:64+32", "1024x0x64:64+32", "1024x1536x4096", "1024x1536x4096:", "1024x1532x4096:64+32",
                 "1024x1536x320:64+32x6"):
        with pytest.raises(ValueError):
            parse_points(text)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without a GPU")
def test_without_a_gpu_the_probe_exits_with_a_usage_error(capsys):
    assert main(["--reps", "1"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


def test_bad_points_are_one_line_usage_errors_that_say_why(capsys):
    assert main(["--points", "1024x1536x4096:64+48"]) == 2
    assert "powers of two" in capsys.readouterr().err


@pytest.mark.skipif(cluster_support_problem() is not None, reason="Gluon clusters need Triton >= 3.7")
@pytest.mark.parametrize("text", ["64+32", "64+16x2", "32+16n2"])
def test_the_kernel_compiles_for_sm90_as_a_multicasting_cluster_without_idle_warps(text):
    from tp_overlap.launch.compile_check import resource_usage

    tile = ClusterTile.parse(text)
    compiled = compile_cluster_gemm(tile)
    ptx = compiled.asm["ptx"]
    assert resource_usage(compiled)["spill"] == 0
    assert compiled.metadata.shared <= SHARED_MEMORY_LIMIT
    assert re.search(rf"\.reqnctapercluster {2 * tile.ctas_n}\b", ptx)
    # two consumer warpgroups and a whole producer warpgroup: 12 warps, none idle. A smaller producer leaves
    # padding warps (still 384 threads) that never arrive at the cluster barrier, and the kernel hangs.
    assert re.search(r"\.reqntid 384\b", ptx)
    assert re.findall(r"num_warps\((\d+)\)", compiled.asm["ttgir"]) == ["4", "4"]
    # both B boxes multicast (and both A boxes in a 2x2 cluster): NUM_STAGES - 1 steps before the loop, one in it
    assert ptx.count(".multicast::cluster") == 2 * tile.ctas_n * tile.stages
    # the slot-release protocol: per partition one releasing arrive and wait at the start, a relaxed arrive per
    # K step, and the consumers' per-step and final waits (3 partitions: 6 arrive sites, 3 relaxed; 8 waits)
    assert ptx.count("barrier.cluster.arrive") == 6 and ptx.count("barrier.cluster.arrive.relaxed") == 3
    assert ptx.count("barrier.cluster.wait") == 8
