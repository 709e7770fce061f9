"""The GEMM block tuner's plan (launch/measure/tune.py: shape classes, candidates, measuring order, cost estimate)
and the command lines of launch.gemm_tune and launch.gemm_bench: help shows every default and points to
docs that exist, bad arguments are one line with exit status 2, before any GPU work."""

import argparse
import re
from pathlib import Path

import pytest

from tp_overlap.launch import gemm_bench, gemm_tune
from tp_overlap.launch.measure.tune import (FP8_CANDIDATES, GEMM_CANDIDATES, GEMM_CLASSES, M_ORDER, SPLIT_K_CANDIDATES,
                                           STREAM_K_CANDIDATES, gemm_candidates, point_seconds, shape_class, splits_k,
                                           streams_k, tune_order)
from tp_overlap.launch.cli.shapes import ag_points, rs_points
from tp_overlap.gemm import PLAIN_BLOCK_M, GemmBlocks

ROOT = Path(__file__).resolve().parents[2]
H200_SMS = 132


def test_every_candidate_can_run_and_every_class_has_a_plain_128_row_configuration():
    for cls, names in GEMM_CLASSES.items():
        blocks = [GemmBlocks.parse(name) for name in names]
        assert all(not b.problems() for b in blocks), cls
        assert [b.name for b in blocks] == list(names), "names must be canonical (the table stores .name)"
        assert any(b.plain and b.block_m == PLAIN_BLOCK_M for b in blocks), cls
    for name in FP8_CANDIDATES:
        blocks = GemmBlocks.parse(name)
        assert blocks.block_k == 128 and not blocks.problems(operand_bytes=1) and blocks.name == name


@pytest.mark.parametrize("m,n,k,expected", [
    (1024, 768, 4096, "few_tiles"),      # llama8b.qkv at TP8: 24 tiles of 128x256 on 132 SMs
    (1024, 14336, 8192, "large"),        # 8 x 56 = 448 tiles: not few
    (16384, 768, 4096, "large"),
    (4096, 4096, 512, "short_k"),        # llama8b.o_proj at TP8
    (16384, 8192, 2048, "short_k"),
    (16384, 8192, 4096, "large"),
])
def test_shape_classes(m, n, k, expected):
    assert shape_class(m, n, k, H200_SMS) == expected


def test_candidates_add_extras_once_and_keep_the_class_list_first():
    names = gemm_candidates(1024, 768, 4096, H200_SMS, extra=("128x128x64w4s4", "256x128x64w8s3"))
    assert names[:len(GEMM_CLASSES["few_tiles"])] == GEMM_CLASSES["few_tiles"]
    assert names.count("128x128x64w4s4") == 1 and names[-1] == "256x128x64w8s3"


@pytest.mark.parametrize("m,n,k,expected", [
    (1024, 768, 4096, True),     # llama8b.qkv at TP8: 48 tiles of 128x128
    (4096, 1280, 8192, True),    # llama70b.qkv at TP8: 320 tiles, class "large", a weak third wave
    (8192, 768, 4096, True),     # 384 tiles: just within three waves
    (4096, 2560, 8192, False),   # 640 tiles
    (16384, 768, 4096, False),
    (1024, 4096, 512, False),    # K too short to split
])
def test_split_k_candidates_are_tried_where_few_128_tiles_meet_a_long_k(m, n, k, expected):
    assert splits_k(m, n, k, H200_SMS) == expected
    names = gemm_candidates(m, n, k, H200_SMS)
    assert all((name in names) == expected for name in SPLIT_K_CANDIDATES)


@pytest.mark.parametrize("m,n,k,expected", [
    (4096, 1280, 8192, True),    # llama70b.qkv at TP8: 160 tiles of 128x256, one wave and 28 tiles
    (8192, 1280, 8192, True),    # 320 tiles: two waves and 56
    (2048, 3072, 4096, True),    # 192 tiles: 1.45 waves
    (1024, 1280, 8192, False),   # 40 tiles: few_tiles has stream-K in its own list
    (16384, 14336, 4096, False),  # many waves: the partial one matters little
    (4224, 8448, 4096, False),   # 33 x 33 = 1089 tiles: above three waves
    (4096, 4096, 512, False),    # short_k, 512 tiles: above three waves
    (2048, 4096, 512, True),     # short_k, 256 tiles: 1.94 waves
])
def test_stream_k_candidates_are_tried_where_128x256_tiles_leave_a_partial_wave_among_few(m, n, k, expected):
    assert streams_k(m, n, k, H200_SMS) == expected
    names = gemm_candidates(m, n, k, H200_SMS)
    cls = shape_class(m, n, k, H200_SMS)
    if cls != "few_tiles":  # few_tiles and short_k list some stream-K names themselves: check the others
        assert all((name in names) == expected for name in STREAM_K_CANDIDATES if name not in GEMM_CLASSES[cls])
    for name in STREAM_K_CANDIDATES:
        blocks = GemmBlocks.parse(name)
        assert blocks.stream_k == 1 and not blocks.problems() and name in GEMM_CANDIDATES


def test_split_k_candidates_are_canonical_and_never_the_plain_choice():
    splits = {GemmBlocks.parse(name).split_k for name in SPLIT_K_CANDIDATES}
    assert splits == {2, 4, 8} and set(SPLIT_K_CANDIDATES) <= set(GEMM_CANDIDATES)
    for name in SPLIT_K_CANDIDATES:
        blocks = GemmBlocks.parse(name)
        assert blocks.name == name and not blocks.problems() and not blocks.plain


def test_order_measures_both_ends_of_m_first_then_by_size():
    points = [(m, n, k) for m in (16384, 2048, 1024, 4096, 8192, 3000) for n, k in ((4096, 512), (768, 4096))]
    ordered = tune_order(points)
    assert [p[0] for p in ordered] == [1024] * 2 + [16384] * 2 + [4096] * 2 + [2048] * 2 + [8192] * 2 + [3000] * 2
    assert ordered[0] == (1024, 4096, 512) and ordered[1] == (1024, 768, 4096)   # smaller n * k first
    assert M_ORDER[:2] == (1024, 16384)


def test_the_full_h200_plan_fits_a_few_minutes_of_timing():
    # 24 (N, K) shapes x 5 M x 2 layouts; the estimate is what the tuner checks against its deadline
    shapes = {(p.m, p.n, p.k) for w in (2, 4, 8) for p in ag_points(w, ms=M_ORDER) + rs_points(w, ms=M_ORDER)}
    assert len(shapes) == 120
    total = sum(point_seconds(m, n, k, len(gemm_candidates(m, n, k, H200_SMS)) + 2, reps=10)
                for m, n, k in shapes for _ in ("kn", "nk"))
    assert 60 < total < 240, total
    assert point_seconds(16384, 28672, 8192, 8, 10) > point_seconds(1024, 28672, 8192, 8, 10)


def test_tune_points_lists_each_shape_once_with_its_layers_in_measuring_order():
    points = gemm_tune.tune_points((2, 4, 8), (1024, 16384))
    assert len(points) == 48 and len({p[:3] for p in points}) == 48
    assert [p[0] for p in points] == [1024] * 24 + [16384] * 24
    by_shape = {p[:3]: p[3] for p in points}
    assert by_shape[(1024, 4096, 2048)] == ["llama8b.o_proj@tp2"]   # K = 4096 / 2, N = H
    assert by_shape[(16384, 7168, 4096)] == ["llama8b.fc1@tp4"]


@pytest.mark.parametrize("module", [gemm_tune, gemm_bench])
def test_help_shows_every_default_and_names_docs_that_exist(module):
    parser = module.make_parser()
    text = parser.format_help()
    assert "DESIGN.md" not in text and "docs/ARCHITECTURE.md" in text
    for doc in set(re.findall(r"docs/[A-Za-z_]+\.md", text)):
        assert (ROOT / doc).is_file(), doc
    for action in parser._actions:
        if (not action.option_strings or action.help is argparse.SUPPRESS or action.default is None
                or action.default is argparse.SUPPRESS or isinstance(action.default, bool)):
            continue
        assert "default" in parser._get_formatter()._expand_help(action), action.option_strings


@pytest.mark.parametrize("module,argv,message", [
    (gemm_tune, ["--tp", "2,x"], "argument --tp: expected comma-separated integers, got '2,x'"),
    (gemm_tune, ["--layouts", "kn,tn"], "--layouts: got ('kn', 'tn'); allowed: kn, nk"),
    (gemm_tune, ["--candidates", "128x256x64w8s6"], "--candidates: 128x256x64w8s6: needs ~360448 bytes of shared"),
    (gemm_tune, ["--candidates", "big"], "--candidates: big: block configuration 'big' does not read as"),
    (gemm_tune, ["--reps", "0"], "--reps: got 0; allowed: >= 1"),
    (gemm_tune, ["--jobs", "0"], "--jobs: got 0; allowed: >= 1"),
    (gemm_tune, ["--resume"], "--resume needs --out-table and --out"),
    (gemm_tune, ["--shapes", "1024x4096"], "argument --shapes: invalid parse_shapes value: '1024x4096'"),
    (gemm_bench, ["--m", "0"], "--m: M values must be >= 1, got (0,)"),
    (gemm_bench, ["--layers", "llama8b.mlp"], "--layers: got ('llama8b.mlp',); allowed: llama70b.fc1"),
    (gemm_bench, ["--fp8", "--configs", "128x128x64w8s4"], "--configs: 128x128x64w8s4: the FP8 GEMM's BLOCK_K"),
    (gemm_bench, ["--write-table", "x.yaml"], "--write-table needs --fp8"),
    (gemm_bench, ["--table", "no/such.yaml"], "--table: no/such.yaml: no such block table"),
    (gemm_bench, ["--device", "cpu"], "--device cpu needs --out"),
])
def test_bad_arguments_are_one_line_with_exit_status_2(module, argv, message, capsys):
    assert module.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith(f"{module.__name__}: {message}"), err
