"""Configuration of activation offload: a frozen `OffloadConfig`, its YAML `offload:` section, its CLI form.

The saved activations of one TP MLP that offload may touch (the "candidates"):

    x  the gathered input [M, H] the column layer keeps for its weight grad (only when it is a copy:
       with save_gathered="view" it is a pool view, which costs no memory, and is never moved)
    h  the fc1 output [M, width/W] (width = 2 * ffn_hidden for swiglu), kept for the activation's backward
    a  the activation output act(h) [M, ffn_hidden/W], kept by fc2 for its weight grad; it can also be
       recomputed from h in backward (one elementwise pass)
    s  silu(gate) [M, ffn_hidden/W] (swiglu only), which autograd's activation keeps for mul's backward;
       "recompute" runs the engine's activation instead, which saves h only and recomputes silu(gate)
       inside its backward (one kernel each way on CUDA, faster than autograd's ops). A layer that moves
       h or a runs the engine's activation whatever s's decision.

Per tensor the decision is keep | offload | recompute: x, h keep | offload; a all three; s keep |
recompute. The planner (overlap/offload/planner.py) decides; `decisions` forces some of them by hand.

YAML (every key optional; errors name the file, the key, the value and what is allowed):

    offload:
      budget_bytes: auto          # or bytes (int), or a string like "40GiB" / "500MB"
      max_added: 0.02             # budget auto: the step may grow by at most this fraction (time budget)
      candidates: [x, h, a, s]
      prefetch_depth: auto        # or layers ahead, 1-64
      pacing: none                # or stagger (node-wide: local ranks copy at different phases)
      decisions: {a: recompute}   # forced by hand; the planner decides the others
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from .schema import ConfigError

__all__ = ["OffloadConfig", "parse_offload_section", "parse_offload_arg", "DEFAULT_MAX_ADDED", "PACING"]

CANDIDATES = ("x", "h", "a", "s")
SAVED = ("x", "h", "a")    # the candidates the engine's hooks see as saved tensors (s is the activation's)
DECISIONS = ("keep", "offload", "recompute")
ALLOWED = {"x": ("keep", "offload"), "h": ("keep", "offload"), "a": DECISIONS, "s": ("keep", "recompute")}
PACING = ("none", "stagger")
MAX_PREFETCH_DEPTH = 64
MAX_BUDGET_BYTES = 1 << 50
DEFAULT_MAX_ADDED = 0.02   # budget auto: at most +2 % of the step (measured targets allow +3 %)
MAX_ADDED = 10.0
_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}
_KEYS = ("budget_bytes", "max_added", "candidates", "prefetch_depth", "pacing", "decisions")


def _bad(key: str, value, allowed: str, file: str) -> ConfigError:
    return ConfigError(f"got {value!r}; allowed: {allowed}", file=file, key=key, value=value, allowed=allowed)


@dataclass(frozen=True, kw_only=True)
class OffloadConfig:
    """What the offload planner may do, validated at construction (ConfigError names key and range).

    budget_bytes: device bytes the training step may use at its peak, or "auto": the least peak memory
    whose predicted added time stays within `max_added` (a fraction of the step: the time budget, default
    0.02). candidates: tensors the planner may move
    or recompute (subset of x, h, a, s). prefetch_depth: how many layers ahead of its use backward brings a
    tensor back, or "auto" (from the measured bandwidth). pacing: "none" or "stagger" (several local
    ranks offset their device-to-host copies so that they do not all load the host memory bus at once).
    decisions: tensor -> keep | offload | recompute, forced for every layer (the planner decides the rest).
    `enabled` is False only for the "none" CLI form: no engine at all.
    """
    budget_bytes: int | str = "auto"
    max_added: float = DEFAULT_MAX_ADDED
    candidates: tuple[str, ...] = CANDIDATES
    prefetch_depth: int | str = "auto"
    pacing: str = "none"
    decisions: tuple[tuple[str, str], ...] = field(default=())
    enabled: bool = True

    def __post_init__(self):
        self.validate()

    def validate(self, *, file: str = "<OffloadConfig>") -> None:
        b = self.budget_bytes
        if b != "auto" and (isinstance(b, bool) or not isinstance(b, int) or not 1 <= b <= MAX_BUDGET_BYTES):
            raise _bad("offload.budget_bytes", b, f'"auto" or an int with 1 <= x <= {MAX_BUDGET_BYTES}', file)
        a = self.max_added
        if isinstance(a, bool) or not isinstance(a, (int, float)) or not 0 <= a <= MAX_ADDED:
            raise _bad("offload.max_added", a, f"a fraction of the step with 0 <= x <= {MAX_ADDED:g}", file)
        c = self.candidates
        if (not isinstance(c, tuple) or not all(isinstance(x, str) and x in CANDIDATES for x in c)
                or len(set(c)) != len(c)):
            raise _bad("offload.candidates", c, f"distinct names from {', '.join(CANDIDATES)}", file)
        d = self.prefetch_depth
        if d != "auto" and (isinstance(d, bool) or not isinstance(d, int) or not 1 <= d <= MAX_PREFETCH_DEPTH):
            raise _bad("offload.prefetch_depth", d, f'"auto" or an int with 1 <= x <= {MAX_PREFETCH_DEPTH}', file)
        if self.pacing not in PACING:
            hint = " (YAML reads a bare `off` as false: write none)" if self.pacing is False else ""
            raise _bad("offload.pacing", self.pacing, " | ".join(PACING) + hint, file)
        if not isinstance(self.decisions, tuple):
            raise _bad("offload.decisions", self.decisions, "a mapping tensor -> decision", file)
        for item in self.decisions:
            tensor, decision = item if isinstance(item, tuple) and len(item) == 2 else (item, None)
            key = f"offload.decisions.{tensor}"
            if tensor not in c:
                raise _bad(key, tensor, f"a tensor listed in candidates ({', '.join(c) or 'none'})", file)
            allowed = ALLOWED[tensor]
            if decision not in allowed:
                raise _bad(key, decision, " | ".join(allowed), file)
        if not isinstance(self.enabled, bool):
            raise _bad("offload.enabled", self.enabled, "true or false", file)

    @property
    def forced(self) -> dict[str, str]:
        return dict(self.decisions)


def _budget(value, file: str):
    if isinstance(value, str) and value != "auto":
        match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]+)\s*", value)
        if not match or match.group(2).lower() not in _UNITS:
            raise _bad("offload.budget_bytes", value, '"auto", an int, or a number with a unit '
                       f"({', '.join(_UNITS)}) such as \"40GiB\"", file)
        value = int(float(match.group(1)) * _UNITS[match.group(2).lower()])
    return value


def parse_offload_section(raw: dict | None, *, file: str) -> OffloadConfig:
    """Validate the YAML mapping under `offload:` (None or absent: the defaults, i.e. auto).

    Raises ConfigError naming `file`, the key (`offload.<key>`), the value and what is allowed."""
    if raw is None:
        return OffloadConfig()
    if not isinstance(raw, dict):
        raise _bad("offload", raw, "a mapping with keys " + ", ".join(_KEYS), file)
    for key in raw:
        if key not in _KEYS:
            raise ConfigError(f"unknown key {key!r}; allowed: {', '.join(_KEYS)}", file=file,
                              key=f"offload.{key}", value=key, allowed=", ".join(_KEYS))
    fields = dict(raw)
    if "budget_bytes" in fields:
        fields["budget_bytes"] = _budget(fields["budget_bytes"], file)
    if "candidates" in fields:
        value = fields["candidates"]
        if isinstance(value, str):
            value = [v.strip() for v in value.split(",") if v.strip()]
        if not isinstance(value, list):
            raise _bad("offload.candidates", value, f"a list of distinct names from {', '.join(CANDIDATES)}", file)
        fields["candidates"] = tuple(value)
    if "decisions" in fields:
        value = fields["decisions"]
        if not isinstance(value, dict):
            raise _bad("offload.decisions", value, "a mapping tensor -> keep | offload | recompute", file)
        fields["decisions"] = tuple(value.items())
    probe = OffloadConfig.__new__(OffloadConfig)  # validate with the file's name before constructing
    for name, default in (("budget_bytes", "auto"), ("max_added", DEFAULT_MAX_ADDED), ("candidates", CANDIDATES),
                          ("prefetch_depth", "auto"), ("pacing", "none"), ("decisions", ()), ("enabled", True)):
        object.__setattr__(probe, name, fields.get(name, default))
    probe.validate(file=file)
    return OffloadConfig(**fields)


def parse_offload_arg(text: str) -> OffloadConfig:
    """The CLI form `--offload auto|none|<list>`.

    auto: the planner decides (budget auto). none: offload disabled. A comma list forces decisions by
    hand, each item `<tensor>` (offload it; s: recompute it) or `<tensor>=<decision>`, e.g.
    `h,a=recompute`; the listed tensors are the candidates."""
    text = text.strip()
    if text == "auto":
        return OffloadConfig()
    if text == "none":
        return OffloadConfig(enabled=False)
    decisions = []
    for item in (part.strip() for part in text.split(",")):
        tensor, _, decision = item.partition("=")
        tensor = tensor.strip()
        decisions.append((tensor, decision.strip() or ("recompute" if tensor == "s" else "offload")))
    tensors = tuple(t for t, _ in decisions)
    if not all(t in CANDIDATES for t in tensors) or len(set(tensors)) != len(tensors):
        raise _bad("--offload", text, f"auto | none | a comma list of distinct {', '.join(CANDIDATES)}, "
                   "each optionally =keep|offload|recompute", "<command line>")
    return OffloadConfig(candidates=tensors, decisions=tuple(decisions))
