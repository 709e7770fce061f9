"""tp_overlap.launch.gemm_tune and launch.gemm_bench (bf16 and --fp8) end to end on CPU (Triton interpreter, tiny
shapes, host-clock timing): the table they write loads and drives choose_blocks, the JSON has a row per
shape and layout, and a budget too small for any shape skips them all instead of overrunning."""

import json
import os
import time

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

from tp_overlap.launch import gemm_bench, gemm_tune  # noqa: E402
from tp_overlap.launch.measure.canary import run_canaries  # noqa: E402
from tp_overlap.gemm import PLAIN_BLOCK_M, choose_blocks, load_block_table  # noqa: E402

pytestmark = [pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning"),
              pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU smoke runs; on a GPU run the launchers")]

COMMON = ["--device", "cpu", "--reps", "1", "--hold-us", "0", "--canary-shape", "24x40x48"]


def test_tuner_writes_a_loadable_table_merged_over_the_old_one_and_flushes_json(tmp_path):
    table, results = tmp_path / "t.yaml", tmp_path / "tune.json"
    candidates = "16x16x16w1s1,32x32x16w1s1sk1,16x16x16w1s1sp2"
    code = gemm_tune.main(COMMON + ["--shapes", "24x40x48", "--candidates", candidates,
                                    "--out-table", str(table), "--out", str(results),
                                    "--merge-table", "configs/gemm_blocks/h200.yaml"])
    assert code == 0
    loaded = load_block_table(path=str(table))
    by_key = {(e.layout, e.m, e.n, e.k): e for e in loaded.entries}
    for layout in ("kn", "nk"):
        entry = by_key[(layout, 24, 40, 48)]
        assert entry.plain.plain and entry.plain.block_m == PLAIN_BLOCK_M
        assert choose_blocks(24, 40, 48, b_transposed=layout == "nk", table=loaded) == entry.blocks
    assert ("kn", 1024, 3072, 4096) in by_key, "an entry it did not measure was dropped"
    doc = json.loads(results.read_text())
    assert {(r["layout"], r["M"]) for r in doc["rows"]} == {("kn", 24), ("nk", 24)}
    assert doc["summary"]["measured"] == 2 and set(doc["rows"][0]["times_ms"]) >= set(candidates.split(","))
    assert doc["failed"] == {}


def test_tuner_with_no_budget_skips_every_shape_and_says_so(tmp_path):
    results = tmp_path / "tune.json"
    code = gemm_tune.main(COMMON + ["--shapes", "24x40x48", "--candidates", "16x16x16w1s1", "--time-budget-s", "0",
                                    "--out-table", str(tmp_path / "t.yaml"), "--out", str(results)])
    assert code == 1
    doc = json.loads(results.read_text())
    assert doc["rows"] == [] and len(doc["skipped"]) == 2


def test_bf16_bench_times_the_table_choice_and_the_fp8_bench_writes_an_fp8_table(tmp_path):
    table = tmp_path / "t.yaml"
    table.write_text("gpu: x\nnum_sms: 4\nentries:\n  - {layout: nk, m: 24, n: 40, k: 48, blocks: 16x16x16w1s1, "
                     "plain: 128x128x64w8s4}\n")
    out = tmp_path / "bench.json"
    assert gemm_bench.main(COMMON + ["--shapes", "24x40x48", "--table", str(table), "--out", str(out)]) == 0
    rows = {r["layout"]: r for r in json.loads(out.read_text())["rows"]}
    assert rows["nk"]["table_blocks"] == "16x16x16w1s1" and rows["nk"]["table_over_cublas"] > 0
    assert rows["kn"]["table_blocks"] == rows["kn"]["heuristic_blocks"]   # no kn entry: the fallback
    fp8_out, fp8_table = tmp_path / "fp8.json", tmp_path / "fp8.yaml"
    assert gemm_bench.main(COMMON + ["--fp8", "--shapes", "24x136x200", "--configs", "16x32x128w4s1",
                                     "--out", str(fp8_out), "--write-table", str(fp8_table)]) == 0
    row = json.loads(fp8_out.read_text())["rows"][0]
    assert row["t_scaled_mm_ms"] > 0 and row["16x32x128w4s1_rel_err"] <= 5e-3
    assert load_block_table(path=str(fp8_table)).operand_bytes == 1


def test_canary_child_reports_each_configuration_and_survives_a_bad_one():
    items = [("16x16x16w1s1", "kn"), ("not-a-config", "nk"), ("32x32x16w1s1sk1", "nk")]
    verdicts = run_canaries("bf16", items, time.monotonic() + 300, device="cpu", shape=(24, 40, 48))
    assert verdicts[("16x16x16w1s1", "kn")] == "" and verdicts[("32x32x16w1s1sk1", "nk")] == ""
    assert verdicts[("not-a-config", "nk")].startswith("ValueError: block configuration 'not-a-config'")


def test_tuner_resumes_where_a_run_stopped_and_compiles_in_parallel(tmp_path):
    table, results = tmp_path / "t.yaml", tmp_path / "tune.json"
    args = COMMON + ["--candidates", "16x16x16w1s1", "--jobs", "2", "--out-table", str(table), "--out", str(results),
                     "--merge-table", str(tmp_path / "none.yaml")]
    (tmp_path / "none.yaml").write_text("gpu: x\nnum_sms: 4\nentries: []\n")
    assert gemm_tune.main(args + ["--shapes", "24x40x48"]) == 0
    first = {(r["layout"], r["M"]): r for r in json.loads(results.read_text())["rows"]}
    assert gemm_tune.main(args + ["--shapes", "24x40x48,40x24x48", "--resume"]) == 0
    rows = json.loads(results.read_text())["rows"]
    assert sorted((r["layout"], r["M"]) for r in rows) == [("kn", 24), ("kn", 40), ("nk", 24), ("nk", 40)]
    assert [r for r in rows if r["M"] == 24] == [first[("kn", 24)], first[("nk", 24)]], "a kept point was re-measured"
    assert {(e.layout, e.m) for e in load_block_table(path=str(table)).entries} == {
        ("kn", 24), ("nk", 24), ("kn", 40), ("nk", 40)}


def test_ops_bench_times_each_fused_op_against_cublas_and_summarises_the_targets(tmp_path):
    out = tmp_path / "ops.json"
    assert gemm_bench.main(COMMON + ["--ops", "--shapes", "256x96x128", "--rs-sm-margin", "1", "--hold-us", "300",
                                     "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    rows = {(r["variant"], r["layout"]): r for r in doc["rows"]}
    # epilogue_reduce needs a GPU: on CPU the AllGather consumer and the scatter GEMM, both layouts, and the
    # FP8 AllGather consumer with an nn.Linear weight (against the dequantised product on CPU)
    assert set(rows) == {(v, layout) for v in ("ag_fused", "rs_fused") for layout in ("kn", "nk")} | {
        ("ag_fused_fp8", "nk")}
    for (variant, _), row in rows.items():
        assert row["rel_err"] <= 1e-2 and row["op_over_cublas"] == row["t_cublas_ms"] / row["t_op_ms"]
        assert row["sm_margin"] == (1 if variant == "rs_fused" else 0)
    summary = doc["summary"]["ag_fused"]
    assert summary["n"] == 2 and summary["min_at_m_4096"] is None and summary["targets_met"]["min_at_m_4096"]
    # an interpreted call outlasts a 300 us hold (the default): every rep is late, and the summary says so
    assert all(r["op_late_reps"] == r["op_reps"] for r in doc["rows"]) and summary["points_with_late_reps"] == 2
    from tp_overlap.launch.cli.common import USAGE_EXIT
    assert gemm_bench.main(COMMON + ["--ops", "--fp8", "--shapes", "256x96x64", "--out", str(out)]) == USAGE_EXIT
