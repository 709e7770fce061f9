"""torchrun entry points: `python -m launch.bench` (side-by-side benchmarks)."""

__project__ = "tp-overlap"  # checked by overlap/_install.py
