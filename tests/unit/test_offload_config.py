"""OffloadConfig validation, the YAML `offload:` section and the --offload CLI form."""

import pytest
import yaml

from tp_overlap.config.schema import ConfigError
from tp_overlap.config.offload import (CANDIDATES, DEFAULT_MAX_ADDED, MAX_PREFETCH_DEPTH, OffloadConfig,
                                    parse_offload_arg, parse_offload_section)


def _yaml(text: str) -> dict:
    return yaml.safe_load(text)["offload"]


def test_defaults_are_auto():
    cfg = OffloadConfig()
    assert (cfg.budget_bytes, cfg.max_added, cfg.candidates, cfg.prefetch_depth, cfg.pacing, cfg.forced,
            cfg.enabled) == ("auto", DEFAULT_MAX_ADDED, CANDIDATES, "auto", "none", {}, True)
    assert parse_offload_section(None, file="p.yaml") == cfg
    with pytest.raises(Exception):
        cfg.pacing = "stagger"  # frozen
    with pytest.raises(TypeError):
        OffloadConfig("auto")  # keyword-only


def test_a_full_section_parses():
    cfg = parse_offload_section(_yaml("""
offload:
  budget_bytes: 40GiB
  max_added: 0.03
  candidates: [h, a]
  prefetch_depth: 2
  pacing: stagger
  decisions: {a: recompute}
"""), file="h200_tp2.yaml")
    assert cfg == OffloadConfig(budget_bytes=40 << 30, max_added=0.03, candidates=("h", "a"), prefetch_depth=2,
                                pacing="stagger", decisions=(("a", "recompute"),))
    assert parse_offload_section({"budget_bytes": "500MB"}, file="f").budget_bytes == 500_000_000
    assert parse_offload_section({"budget_bytes": 12345}, file="f").budget_bytes == 12345
    assert parse_offload_section({"candidates": "x,h"}, file="f").candidates == ("x", "h")


@pytest.mark.parametrize("text,key,allowed", [
    ("budget_bytes: -5", "offload.budget_bytes", "1 <= x <= "),
    ("budget_bytes: lots", "offload.budget_bytes", "a number with a unit"),
    ("budget_bytes: 4 parsecs", "offload.budget_bytes", "a number with a unit"),
    ("budget_bytes: true", "offload.budget_bytes", '"auto" or an int'),
    ("max_added: -0.01", "offload.max_added", "0 <= x <= 10"),
    ("max_added: lots", "offload.max_added", "a fraction of the step"),
    ("max_added: true", "offload.max_added", "a fraction of the step"),
    ("candidates: [h, q]", "offload.candidates", "distinct names from x, h, a"),
    ("candidates: [h, h]", "offload.candidates", "distinct names"),
    ("candidates: 7", "offload.candidates", "a list"),
    ("prefetch_depth: 0", "offload.prefetch_depth", f"1 <= x <= {MAX_PREFETCH_DEPTH}"),
    ("prefetch_depth: 65", "offload.prefetch_depth", f"1 <= x <= {MAX_PREFETCH_DEPTH}"),
    ("prefetch_depth: 1.5", "offload.prefetch_depth", '"auto" or an int'),
    ("pacing: off", "offload.pacing", "YAML reads a bare `off` as false"),
    ("pacing: sometimes", "offload.pacing", "none | stagger"),
    ("decisions: {x: recompute}", "offload.decisions.x", "keep | offload"),
    ("decisions: {a: vanish}", "offload.decisions.a", "keep | offload | recompute"),
    ("decisions: {s: offload}", "offload.decisions.s", "keep | recompute"),
    ("decisions: [a]", "offload.decisions", "a mapping"),
    ("candidates: [h]\n  decisions: {a: recompute}", "offload.decisions.a", "candidates (h)"),
    ("prefetch: 2", "offload.prefetch", "allowed: budget_bytes, max_added, candidates"),
])
def test_errors_name_file_key_value_and_range(text, key, allowed):
    with pytest.raises(ConfigError) as err:
        parse_offload_section(_yaml("offload:\n  " + text), file="presets/h200_tp2.yaml")
    message = str(err.value)
    assert message.startswith(f"presets/h200_tp2.yaml: {key}:"), message
    assert allowed in message, message
    assert err.value.file == "presets/h200_tp2.yaml" and err.value.key == key


def test_a_section_that_is_not_a_mapping_is_refused():
    with pytest.raises(ConfigError, match="f.yaml: offload: got 3; allowed: a mapping"):
        parse_offload_section(3, file="f.yaml")


def test_construction_validates_too():
    with pytest.raises(ConfigError, match="offload.prefetch_depth"):
        OffloadConfig(prefetch_depth=0)
    with pytest.raises(ConfigError, match="offload.candidates"):
        OffloadConfig(candidates=["h"])  # a tuple is required: the config is frozen and hashable


def test_the_cli_form():
    assert parse_offload_arg("auto") == OffloadConfig()
    assert parse_offload_arg("none").enabled is False
    cfg = parse_offload_arg("h, a=recompute")
    assert cfg.candidates == ("h", "a") and cfg.forced == {"h": "offload", "a": "recompute"}
    assert parse_offload_arg("h, s").forced == {"h": "offload", "s": "recompute"}  # s can only be recomputed
    for bad in ("q", "h,h", "x=recompute", "s=offload", ""):
        with pytest.raises(ConfigError):
            parse_offload_arg(bad)
