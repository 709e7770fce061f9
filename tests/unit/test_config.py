"""Presets load; every invalid field gives its own message naming file, key, value and what is allowed."""

import copy
import re
from pathlib import Path

import pytest
import yaml

from tp_overlap.config.schema import ConfigError, AgGemmConfig, GemmRsConfig
from tp_overlap.config.presets import dump_config, gpu_slug, load_config, load_preset, migrate, parse_config, preset_path

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
    ("ops.gemm_rs.num_comm_sms", "8", "an int"),
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


def test_op_configs_are_frozen_keyword_only_and_validated():
    cfg = GemmRsConfig(method="fused", sm_margin=8, num_comm_sms=8)
    with pytest.raises(Exception):
        cfg.sm_margin = 4
    with pytest.raises(TypeError):
        GemmRsConfig("fused")
    with pytest.raises(ConfigError, match="sm_margin"):
        GemmRsConfig(method="fused", sm_margin=-3)
    with pytest.raises(ConfigError, match="sm_margin: got 132; allowed: an int with 0 <= x <= 131"):
        GemmRsConfig(method="fused", sm_margin=132).validate(num_sms=132)
    with pytest.raises(TypeError):   # per-op classes hold only their own fields
        AgGemmConfig(method="decomposed", num_comm_sms=8)
    with pytest.raises(TypeError):
        GemmRsConfig(method="decomposed", chunks_per_rank=2)


@pytest.mark.parametrize("cls,fields,needle", [
    ("rs", {"method": "fused", "sm_margin": 4, "num_comm_sms": 8}, "sm_margin: got 4; allowed: >= num_comm_sms"),
    ("rs", {"method": "fused", "num_comm_sms": 0}, "num_comm_sms: got 0; allowed: >= 1"),
    ("rs", {"method": "decomposed", "num_comm_sms": 0}, "runs its reduction kernel on num_comm_sms"),
    ("rs", {"method": "pair", "num_comm_sms": 4}, "0 (method pair has no reduction kernel)"),
    ("rs", {"method": "epilogue_reduce", "num_comm_sms": 4}, "0 (method epilogue_reduce has no"),
    ("ag", {"method": "fused", "lead_fraction": 0.5}, "it applies to method decomposed"),
    ("ag", {"method": "decomposed", "lead_fraction": 1.5}, "a number with 0 <= x <= 1"),
])
def test_a_method_says_what_runs_and_refuses_fields_it_cannot_honour(cls, fields, needle):
    with pytest.raises(ConfigError, match=re.escape(needle)):
        (GemmRsConfig if cls == "rs" else AgGemmConfig)(**fields)


def test_model_section_parses_validates_and_round_trips(tmp_path):
    from tp_overlap.config.schema import ModelConfig
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
    from tp_overlap.launch.output.report import git_commit
    monkeypatch.setenv("OVERLAP_GIT_COMMIT", "0123abc")
    assert git_commit() == "0123abc"
    monkeypatch.delenv("OVERLAP_GIT_COMMIT")
    assert git_commit() != "0123abc"


def test_cuda_graph_benchmarks_refuse_cpu_ranks_with_a_clear_message():
    import pytest
    import torch

    from tp_overlap.launch.measure import op_bench
    from tp_overlap.launch.cli.common import UsageError

    class CpuContext:
        device = torch.device("cpu")

    with pytest.raises(UsageError, match="--cuda-graphs needs CUDA devices"):
        op_bench.run(CpuContext(), "ag_gemm", [], [], warmup=1, reps=1, cuda_graphs=True)


@pytest.mark.parametrize("role,fields,needle", [
    ("fc1_dgrad", {"lead_wgrad": True}, "false (it applies to fc2_dgrad)"),
    ("fc2_dgrad", {"bulk_wgrad": True}, "false (it applies to fc1_dgrad)"),
    ("fc2_dgrad", {"lead_wgrad": "yes"}, "true or false"),
])
def test_role_settings_are_keyed_by_gemm_role_and_validated(role, fields, needle):
    raw = _base()
    raw["roles"] = {role: fields}
    with pytest.raises(ConfigError, match=re.escape(f"roles.{role}.") + ".*" + re.escape(needle)):
        parse_config(raw, file="mem")
    raw["roles"] = {"fc3_fprop": {}}
    with pytest.raises(ConfigError, match="roles.fc3_fprop: unknown key"):
        parse_config(raw, file="mem")


def test_roles_select_by_m_and_round_trip(tmp_path):
    cfg = load_config(preset_path("NVIDIA H200", 2))
    assert cfg.role("fc2_dgrad", 16384).lead_wgrad and not cfg.role("fc2_dgrad", 4096).lead_wgrad
    assert cfg.role("fc1_dgrad", 1024).bulk_wgrad and not cfg.role("fc1_fprop", 1024).bulk_wgrad
    out = tmp_path / "again.yaml"
    dump_config(cfg, out)
    again = load_config(out)
    assert again.roles == cfg.roles and again.ag_gemm == cfg.ag_gemm and again.gemm_rs == cfg.gemm_rs


def test_a_preset_of_the_earlier_layout_is_migrated():
    """Role settings inside the ops move to roles; a TP2 `decomposed` GEMM+RS without reduction SMs was the
    pair schedule; fields an op never read are dropped."""
    old = {"node": {"gpu_name": "NVIDIA H200", "tp_size": 2, "num_sms": 132, "pool_bytes": 1 << 30},
           "ops": {"ag_gemm": {"method": "decomposed", "sm_margin": 0, "num_comm_sms": 0, "chunks_per_rank": 1,
                               "lead_fraction": 0.5, "lead_wgrad": True,
                               "by_m": [{"m_max": 4096, "lead_fraction": 0, "lead_wgrad": False}]},
                   "gemm_rs": {"method": "decomposed", "sm_margin": 0, "num_comm_sms": 0, "chunks_per_rank": 1,
                               "bulk_wgrad": True}}}
    cfg = parse_config(migrate(old), file="old.yaml")
    assert cfg.gemm_rs.default.method == "pair"
    assert cfg.role("fc2_dgrad", 16384).lead_wgrad and not cfg.role("fc2_dgrad", 4096).lead_wgrad
    assert cfg.role("fc1_dgrad", 16384).bulk_wgrad
    assert cfg.op_config("ag_gemm", 4096).lead_fraction == 0 and cfg.op_config("ag_gemm", 16384).lead_fraction == 0.5
    old["node"]["tp_size"] = 4
    assert parse_config(old, file="old4.yaml").gemm_rs.default == GemmRsConfig(method="decomposed", sm_margin=0,
                                                                               num_comm_sms=8)


def test_num_comm_sms_left_out_follows_the_method_in_an_earlier_layout_preset_and_in_python():
    old = {"node": {"gpu_name": "NVIDIA H200", "tp_size": 4, "num_sms": 132, "pool_bytes": 1 << 30},
           "ops": {"ag_gemm": {"method": "decomposed", "sm_margin": 0},
                   "gemm_rs": {"method": "epilogue_reduce", "sm_margin": 0,
                               "by_m": [{"m_max": 1024, "method": "fused", "sm_margin": 16}]}}}
    cfg = parse_config(old, file="old.yaml")
    assert cfg.gemm_rs.default == GemmRsConfig(method="epilogue_reduce", sm_margin=0, num_comm_sms=0)
    assert cfg.op_config("gemm_rs", 1024) == GemmRsConfig(method="fused", sm_margin=16, num_comm_sms=16)
    assert GemmRsConfig(method="pair").num_comm_sms == 0 and GemmRsConfig().num_comm_sms == 16
    assert GemmRsConfig(method="decomposed").num_comm_sms == 16
    # a value the file does give is still checked against the method, and the error names it
    old["ops"]["gemm_rs"] = {"method": "pair", "sm_margin": 0, "num_comm_sms": 4}
    with pytest.raises(ConfigError, match=r"old.yaml: ops.gemm_rs.num_comm_sms: got 4; allowed: 0 \(method pair"):
        parse_config(old, file="old.yaml")


def test_a_bucket_that_switches_method_drops_the_lead_and_with_method_resets_it():
    raw = _base()
    raw["ops"]["ag_gemm"].update(method="decomposed", lead_fraction=0.5)
    raw["ops"]["ag_gemm"]["by_m"] = [{"m_max": 1024, "method": "fused"}, {"m_max": 4096, "sm_margin": 8}]
    cfg = parse_config(raw, file="mem")
    assert cfg.op_config("ag_gemm", 1024).lead_fraction == 0 and cfg.op_config("ag_gemm", 1024).method == "fused"
    assert cfg.op_config("ag_gemm", 4096).lead_fraction == 0.5  # inherited: still decomposed
    base = cfg.ag_gemm.default
    assert base.with_method("fused").lead_fraction == 0
    assert base.with_method("decomposed", sm_margin=4) == AgGemmConfig(
        method="decomposed", lead_fraction=0.5, sm_margin=4, chunks_per_rank=base.chunks_per_rank,
        comm_stream_priority=base.comm_stream_priority)
    rs = GemmRsConfig(method="pair", sm_margin=0, num_comm_sms=0)
    assert rs.with_method("fused") == GemmRsConfig(method="fused", sm_margin=16, num_comm_sms=16)
    assert rs.with_method("decomposed").num_comm_sms == 8 and rs.with_method("epilogue_reduce").num_comm_sms == 0


def test_fp8_key_parses_validates_and_round_trips(tmp_path):
    raw = _base()
    assert parse_config(raw, file="f.yaml").fp8 is False
    raw["ops"]["gemm_rs"] = {"method": "decomposed", "num_comm_sms": 4}
    raw["fp8"] = True
    cfg = parse_config(raw, file="f.yaml")
    assert cfg.fp8 is True
    out = tmp_path / "f.yaml"
    dump_config(cfg, out)
    assert load_config(out).fp8 is True
    raw["fp8"] = "yes"
    with pytest.raises(ConfigError, match=r"f.yaml: fp8: got 'yes'; allowed: true \| false"):
        parse_config(raw, file="f.yaml")
    raw["fp8"] = True   # the FP8 GEMM+RS runs per owner chunk: a fused bucket cannot serve it
    raw["ops"]["gemm_rs"]["by_m"] = [{"m_max": 4096, "method": "fused", "sm_margin": 16, "num_comm_sms": 8}]
    with pytest.raises(ConfigError, match=r"f.yaml: fp8: true needs ops.gemm_rs.method in decomposed \| pair .*fused"):
        parse_config(raw, file="f.yaml")
