"""torchrun entry points: `python -m launch.bench` (side-by-side benchmarks)."""
