"""The engine really lets go of a released tensor's device memory (CPU: the same references as on CUDA).

`_release` drops the engine's reference; the memory is only freed if nothing else holds the tensor. torch
keeps the pack hook of every tensor saved under `saved_tensors_hooks` until that node's backward has run, so
whatever the hook's closure holds (e.g. a matcher that captured h) outlives the release. These checks look
at the storages themselves (weak references) at the point of the peak: the start of backward, after the
release, when the prefetched copies of the last layers already sit beside them.
"""

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef

from tp_overlap.launch.measure.bench_mlp import BenchMLP
from tp_overlap.offload.engine import OffloadEngine, host_bytes
from tp_overlap.offload.host_pool import HostPool
from tp_overlap.offload.planner import MLPShape, Rates, plan_offload

H, F, M, LAYERS = 16, 24, 32, 3
RATES = Rates(d2h_gbps=50, h2d_gbps=50, gemm_tflops=400, hbm_gbps=3000)


def _live(refs):
    return sorted(key for key, ref in refs.items() if not ref.expired())


@pytest.mark.parametrize("forced", [{"x": "offload", "h": "offload", "a": "offload"},
                                    {"x": "offload", "h": "offload", "a": "recompute"}])
def test_released_and_recomputed_tensors_hold_no_device_memory_at_the_start_of_backward(forced, monkeypatch):
    torch.manual_seed(0)
    mlps = [BenchMLP(H, F, device="cpu", dtype=torch.float32) for _ in range(LAYERS)]
    plan = plan_offload(MLPShape(hidden=H, ffn_hidden=F, m=M, dtype_bytes=4, num_layers=LAYERS), RATES,
                        forced=forced)
    saved, inputs = {}, {}   # (layer, name) -> weak ref to the storage the engine was handed
    plain_pack = OffloadEngine._pack

    def pack(self, layer, name, t):
        if plan.decision(layer, name) != "keep":
            saved[(layer, name)] = StorageWeakRef(t.untyped_storage())
        return plain_pack(self, layer, name, t)

    monkeypatch.setattr(OffloadEngine, "_pack", pack)
    with HostPool(host_bytes(plan), device="cpu") as pool:
        engine = OffloadEngine(plan, pool=pool)
        for step in range(2):
            saved.clear()
            inputs.clear()
            x, dy = torch.randn(M, H), torch.randn(M, H)
            y = x
            for i, m in enumerate(mlps):
                if i:
                    inputs[i] = StorageWeakRef(y.untyped_storage())  # the previous layer's output
                y = engine.forward(i, m, y)
            seen = {}
            # registered after the engine's hook: runs right after the release and the first prefetches
            y.register_hook(lambda g: seen.update(saved=_live(saved), inputs=_live(inputs)))
            y.backward(dy)
            assert len(saved) == sum(d != "keep" for _, _, d in plan.decisions)
            assert seen == {"saved": [], "inputs": []}, f"step {step}: still on the device: {seen}"
            assert _live(saved) == [] and engine.stats()["slots_in_use"] == 0
        engine.close()
