"""The overlapped ops and the layers built on them, bottom-up:

* `protocol`   what a flag word means (M-carrying ready/pushed flags) and the pool regions an op uses;
* `schedule`   a call as a Program of steps, run by the CUDA driver (stream memops, copies, kernels) or the
               host driver (CPU pools);
* `base`       OpBase: one Plan per (M, variant) built once, the launch lock and the keyed CUDA-graph replay;
* `ag_gemm`, `ag_plan`   AllGather on copy engines overlapped with the GEMM that consumes it;
* `gemm_rs`    the GEMM whose epilogue scatters tiles to their owners, reduced on `sm_margin` SMs;
* `custom_ops` the ops as torch custom ops with autograd (eager, captured, torch.compile);
* `layers`     the TP MLP layers and `pool_requirements`;
* `validate`   the checks every public entry point runs before any communication;
* `reference`  the unfused NCCL-then-GEMM baseline the tests and benchmarks compare against.
"""
