"""The entry points (`python -m launch.<name>`, under torchrun where they need several ranks): `tp_mlp` (the
main job), `bench`, `kfactor`, `host_cost`, `launch_overhead`, `gemm_bench`, `gemm_tune`, `compile_check`,
`offload_bench`, `results_md`. What they share lives in the subpackages: `cli` (arguments and process
groups), `measure` (timing, k-factor, benchmarks), `output` (results files, plots, tables)."""

__project__ = "tp-overlap"  # checked by overlap/_install.py
