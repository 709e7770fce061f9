"""The measurements the entry points of `launch/` are made of: the timing harness (`timing`), the k-factor
(`k_factor`, `step_k`), the per-op benchmarks (`op_bench`, `pool_bw`), sustained and per-stream timing
(`sustained`, `timeline`, `graphs`, `comm_delay`), the GEMM sweeps (`tune`: candidates, plan and block table;
`canary`: every configuration once in child processes; `gemm_bench_fp8`), activation offload's points
(`offload_point`, `offload_measure`, `offload_report`, `bench_mlp`), and the training race of `launch.train`
(`train_models`: the Llama and its TP variants; `train_loop`: the interleaved steps and their comparison).
It imports `launch.cli` and `launch.output`, never an entry point."""
