"""The overlapped ops and the layers built on them, bottom-up (the words: docs/ARCHITECTURE.md, "Words"):

* `protocol`   what a flag word means (M-carrying ready/pushed flags) and the pool regions an op uses;
* `program`    a call as a Program of steps, run by the CUDA driver (stream memops, copies, kernels) or the
               host driver (CPU pools);
* `base`       OpBase: one Plan per (M, variant) built once, the launch lock and the keyed CUDA-graph replay;
* `calls`      the tensors of one call (AgCall, RsCall) and the keys of the plans (AgPlanKey, RsPlanKey);
* `ag_gemm`, `ag_chunks`, `ag_consumers`   AllGather on copy engines overlapped with the GEMM that consumes
               it: the op, which chunks arrive in which order, the consumers' GEMMs;
* `gemm_rs`    the GEMM whose epilogue scatters tiles to their owners, reduced on `sm_margin` SMs;
* `custom_ops` the ops as torch custom ops with autograd (eager, captured, torch.compile);
* `layers`     the TP MLP layers and `pool_requirements`;
* `validate`   the checks every public entry point runs before any communication;
* `reference`  the unfused NCCL-then-GEMM baseline the tests and benchmarks compare against.
"""
