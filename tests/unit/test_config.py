"""Presets load; every invalid field gives its own message naming file, key, value and what is allowed."""

import copy
import re
from pathlib import Path

import pytest
import yaml

from overlap.config import ConfigError, AgGemmConfig, GemmRsConfig
from overlap.presets import dump_config, gpu_slug, load_config, load_preset, parse_config, preset_path

PRESETS = sorted(Path(__file__).resolve().parents[2].joinpath("configs").glob("*.yaml"))


def test_there_are_presets_for_h200_tp2_tp4_tp8_and_cpu():
    names = {p.name for p in PRESETS}
    assert {"h200_tp2.yaml", "h200_tp4.yaml", "h200_tp8.yaml", "cpu.yaml", "cuda_default.yaml"} <= names


@pytest.mark.parametrize("path", PRESETS, ids=lambda p: p.name)
def test_every_preset_loads(path):
    cfg = load_config(path)
    assert cfg.op_config("ag_gemm", 4096).op == "ag_gemm"
    assert cfg.op_config("gemm_rs", 4096).op == "gemm_rs"
    if cfg.node.tp_size:
        assert path.name.endswith(f"_tp{cfg.node.tp_size}.yaml")


@pytest.mark.parametrize("name,world,expect", [
    ("NVIDIA H200", 2, "h200_tp2.yaml"), ("NVIDIA H200", 8, "h200_tp8.yaml"),
    ("NVIDIA H200", 4, "h200_tp4.yaml"), ("NVIDIA H200", 3, "cuda_default.yaml"),
    ("NVIDIA H100 80GB HBM3", 2, "cuda_default.yaml"), ("cpu", 4, "cpu.yaml")])
def test_automatic_selection_and_fallback(name, world, expect):
    assert preset_path(name, world).name == expect
    assert load_preset(name, world).node.tp_size in (None, world)


def test_gpu_slug():
    assert gpu_slug("NVIDIA H200") == "h200"
    assert gpu_slug("NVIDIA H100 80GB HBM3") == "h100"
    assert gpu_slug("NVIDIA A100-SXM4-80GB") == "a100"


def _base():
    return yaml.safe_load((Path(PRESETS[0]).parent / "h200_tp2.yaml").read_text())


def _set(raw, dotted, value):
    node = raw
    *head, last = dotted.split(".")
    for k in head:
        node = node[k]
    node[last] = value
    return raw


@pytest.mark.parametrize("key,value,needle", [
    ("ops.gemm_rs.sm_margin", -1, "0 <= x <= 131"),
    ("ops.gemm_rs.sm_margin", 132, "0 <= x <= 131"),
    ("ops.ag_gemm.method", "magic", "decomposed | fused"),
    ("ops.ag_gemm.chunks_per_rank", 0, "1 <= x <= 64"),
    ("ops.ag_gemm.comm_stream_priority", 3, "-5 <= x <= 0"),
    ("ops.ag_gemm.num_comm_sms", "8", "an int"),
    ("ops.ag_gemm.sm_margin", True, "an int"),
    ("node.tp_size", "two", "an int or null"),
    ("node.pool_bytes", 0, "1 <= x"),
    ("node.gpu_name", 5, "a string"),
])
def test_each_invalid_field_names_file_key_value_and_allowed(tmp_path, key, value, needle):
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(_set(_base(), key, value)))
    with pytest.raises(ConfigError) as info:
        load_config(path)
    msg = str(info.value)
    assert str(path) in msg and key in msg and repr(value) in msg and needle in msg, msg
    assert info.value.key == key and info.value.value == value


def test_unknown_key_is_named(tmp_path):
    raw = _base()
    raw["ops"]["ag_gemm"]["sm_margn"] = 4
    path = tmp_path / "typo.yaml"
    path.write_text(yaml.safe_dump(raw))
    with pytest.raises(ConfigError, match=r"ops\.ag_gemm\.sm_margn: unknown key 'sm_margn'; allowed: .*sm_margin"):
        load_config(path)


def test_missing_section_and_bad_yaml(tmp_path):
    raw = _base()
    del raw["ops"]["gemm_rs"]
    with pytest.raises(ConfigError, match="missing op sections"):
        parse_config(raw, file="x.yaml")
    bad = tmp_path / "broken.yaml"
    bad.write_text("node: [unclosed")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)
    with pytest.raises(ConfigError, match="no such file"):
        load_config(tmp_path / "absent.yaml")


def test_preset_for_another_tp_size_is_refused():
    cfg = load_config(preset_path("NVIDIA H200", 2))
    with pytest.raises(ConfigError, match=r"node\.tp_size: got 2; allowed: 8"):
        cfg.check_world_size(8)


def test_buckets_select_by_m_and_round_trip(tmp_path):
    raw = _base()
    raw["ops"]["ag_gemm"]["by_m"] = [{"m_max": 1024, "method": "fused", "sm_margin": 4},
                                     {"m_max": 4096, "chunks_per_rank": 2}]
    cfg = parse_config(copy.deepcopy(raw), file="mem")
    assert cfg.op_config("ag_gemm", 1000).method == "fused"
    assert cfg.op_config("ag_gemm", 1000).sm_margin == 4
    assert cfg.op_config("ag_gemm", 2048).chunks_per_rank == 2
    assert cfg.op_config("ag_gemm", 2048).method == "decomposed"
    assert cfg.op_config("ag_gemm", 16384) == cfg.ag_gemm.default
    out = tmp_path / "tuned.yaml"
    dump_config(cfg, out, header="tuned by a test")
    again = load_config(out)
    assert again.ag_gemm == cfg.ag_gemm and again.gemm_rs == cfg.gemm_rs and again.node == cfg.node
    raw["ops"]["ag_gemm"]["by_m"][1]["m_max"] = 512
    with pytest.raises(ConfigError, match=r"by_m\[1\]\.m_max: got 512; allowed: an int with 1025"):
        parse_config(raw, file="mem")


def test_op_config_is_frozen_keyword_only_and_validated():
    cfg = GemmRsConfig(method="fused", sm_margin=8)
    with pytest.raises(Exception):
        cfg.sm_margin = 4
    with pytest.raises(TypeError):
        OpConfig("gemm_rs", "fused")
    with pytest.raises(ConfigError, match="sm_margin"):
        GemmRsConfig(method="fused", sm_margin=-3)
    with pytest.raises(ConfigError, match="sm_margin: got 132; allowed: an int with 0 <= x <= 131"):
        cfg.__class__(op="gemm_rs", method="fused", sm_margin=132).validate(num_sms=132)


def test_model_section_parses_validates_and_round_trips(tmp_path):
    from overlap.config import ModelConfig
    raw = _base()
    raw["model"] = {"name": "llama8b", "activation": "gelu"}
    cfg = parse_config(raw, file="m.yaml")
    assert cfg.model == ModelConfig(name="llama8b", hidden=4096, ffn_hidden=14336, activation="gelu")
    out = tmp_path / "m.yaml"
    dump_config(cfg, out)
    assert load_config(out).model == cfg.model
    raw["model"] = {"name": "mine", "hidden": 128}
    with pytest.raises(ConfigError, match="model.name: got 'mine'"):
        parse_config(raw, file="m.yaml")
    raw["model"] = {"name": "llama8b", "activation": "relu"}
    with pytest.raises(ConfigError, match=r"m.yaml: model.activation: got 'relu'; allowed: swiglu \| gelu"):
        parse_config(raw, file="m.yaml")


def test_results_record_the_commit_the_script_gave_over_the_checkouts_head(monkeypatch):
    # the GPU machine's copied .git reported a stale HEAD: an explicit commit must win
    from launch.report import git_commit
    monkeypatch.setenv("OVERLAP_GIT_COMMIT", "0123abc")
    assert git_commit() == "0123abc"
    monkeypatch.delenv("OVERLAP_GIT_COMMIT")
    assert git_commit() != "0123abc"


def test_cuda_graph_benchmarks_refuse_cpu_ranks_with_a_clear_message():
    import pytest
    import torch

    from launch import op_bench

    class CpuContext:
        device = torch.device("cpu")

    with pytest.raises(SystemExit, match="--cuda-graphs needs CUDA devices"):
        op_bench.run(CpuContext(), "ag_gemm", [], [], warmup=1, reps=1, cuda_graphs=True)


@pytest.mark.parametrize("fields,needle", [
    ({"op": "ag_gemm", "method": "decomposed", "lead_fraction": 1.5}, "a number with 0 <= x <= 1"),
    ({"op": "ag_gemm", "method": "decomposed", "lead_fraction": True}, "a number with 0 <= x <= 1"),
    ({"op": "ag_gemm", "method": "fused", "lead_fraction": 0.5}, "applies to ag_gemm with method decomposed"),
    ({"op": "gemm_rs", "method": "fused", "lead_fraction": 0.5}, "applies to ag_gemm with method decomposed"),
    ({"op": "ag_gemm", "method": "decomposed", "bulk_wgrad": True}, "false (it applies to gemm_rs)"),
    ({"op": "gemm_rs", "method": "fused", "bulk_wgrad": 1}, "true or false"),
    ({"op": "ag_gemm", "method": "decomposed", "lead_wgrad": "yes"}, "true or false"),
    ({"op": "ag_gemm", "method": "fused", "lead_wgrad": True}, "applies to ag_gemm with method decomposed"),
    ({"op": "gemm_rs", "method": "decomposed", "lead_wgrad": True}, "applies to ag_gemm with method decomposed"),
])
def test_lead_fraction_and_bulk_wgrad_are_validated(fields, needle):
    with pytest.raises(ConfigError, match=re.escape(needle)):
        OpConfig(**fields)
    assert AgGemmConfig(method="decomposed", lead_fraction=0.5).lead_fraction == 0.5
    assert GemmRsConfig(method="epilogue_reduce", bulk_wgrad=True).bulk_wgrad
    assert AgGemmConfig(method="decomposed", lead_wgrad=True).lead_wgrad


def test_a_bucket_that_switches_method_drops_the_lead_and_with_method_resets_it():
    raw = _base()
    raw["ops"]["ag_gemm"].update(method="decomposed", lead_fraction=0.5, lead_wgrad=True)
    raw["ops"]["ag_gemm"]["by_m"] = [{"m_max": 1024, "method": "fused"}, {"m_max": 4096, "sm_margin": 8}]
    cfg = parse_config(raw, file="mem")
    assert cfg.op_config("ag_gemm", 1024).lead_fraction == 0 and cfg.op_config("ag_gemm", 1024).method == "fused"
    assert not cfg.op_config("ag_gemm", 1024).lead_wgrad
    assert cfg.op_config("ag_gemm", 4096).lead_fraction == 0.5  # inherited: still decomposed
    assert cfg.op_config("ag_gemm", 4096).lead_wgrad
    base = cfg.ag_gemm.default
    assert base.with_method("fused").lead_fraction == 0 and not base.with_method("fused").lead_wgrad
    assert base.with_method("decomposed", sm_margin=4) == AgGemmConfig(method="decomposed",
                                                                  lead_fraction=0.5, sm_margin=4,
                                                                  **{k: getattr(base, k) for k in
                                                                     ("num_comm_sms", "chunks_per_rank",
                                                                      "comm_stream_priority", "lead_wgrad")})
