"""`tp_overlap.parallelize` on ONE GPU shared by W processes (gloo, the ipc pool backend): a small
transformers Llama converted and checked against the unconverted model on the same GPU (fp32 reference,
bf16 converted model: the GEMM tolerance), eager, under torch.compile, and with a whole training step
(forward + backward) captured in a CUDA graph and replayed; the checkpoint round trip; and whether FSDP2 can
run dp x tp with several processes on one GPU (reported, not required: NCCL refuses two ranks on a device).

    python -m tests.gpu.smoke_model [--worlds 2,4] [--json FILE]   (one line per check; exit 1 on a failure)
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist

from tests.gpu.smoke_one_gpu import Checks, run_worlds

TOL = 3e-2   # bf16 GEMMs chained through 2 blocks against an fp32 model (loss and every gradient)
BATCH, SEQ = 2, 128


def _models(dev):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=8, num_key_value_heads=4, attn_implementation="sdpa")
    torch.manual_seed(0)
    ref = LlamaForCausalLM(config).to(dev)
    model = LlamaForCausalLM(config).to(dev)
    model.load_state_dict(ref.state_dict())
    return ref, model.to(torch.bfloat16)


def _ids(step: int, dev) -> torch.Tensor:
    return torch.randint(0, 512, (BATCH, SEQ), generator=torch.Generator().manual_seed(step)).to(dev)


def _rel(a, b) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def _compare(tp, ref, loss, loss_ref) -> float:
    grads = tp.full_state_dict(grads=True)
    worst = abs(loss - loss_ref) / abs(loss_ref)
    return max([worst] + [_rel(grads[n], p.grad) for n, p in ref.named_parameters()])


def _step(run, ids):
    loss = run(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss


def _eager_or_compiled(c, mode: str | None) -> str:
    """mode None: eager; else torch.compile(mode=mode). reduce-overhead reports how many CUDA-graph
    recordings inductor skipped (a model may not allow them: the numbers must match either way)."""
    import tp_overlap
    from torch._dynamo.utils import counters
    ref, model = _models(c.dev)
    skips = counters["inductor"]["cudagraph_skips"]
    with tp_overlap.parallelize(model, group=dist.group.WORLD, max_tokens=BATCH * SEQ,
                                name=f"model.{mode}") as tp:
        run = torch.compile(model, mode=mode) if mode else model
        worst = 0.0
        for step in range(3):
            ids = _ids(step, c.dev)
            ref.zero_grad()
            model.zero_grad()
            loss_ref, loss = _step(ref, ids).item(), _step(run, ids).item()
            worst = max(worst, _compare(tp, ref, loss, loss_ref))
        tp.check_errors()
    assert worst < TOL, worst
    skipped = counters["inductor"]["cudagraph_skips"] - skips
    return f"worst {worst:.2e}" + (f", CUDA-graph recordings skipped: {skipped}" if mode == "reduce-overhead" else "")


def _captured(c) -> str:
    import tp_overlap
    ref, model = _models(c.dev)
    with tp_overlap.parallelize(model, group=dist.group.WORLD, max_tokens=BATCH * SEQ, name="model.graph") as tp:
        ids = _ids(0, c.dev).clone()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):   # warm: every plan built, every allocation made
                model.zero_grad(set_to_none=False)
                _step(model, ids)
            torch.cuda.synchronize()
            dist.barrier()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=side):
                model.zero_grad(set_to_none=False)
                loss = _step(model, ids)
            worst = 0.0
            for step in range(1, 4):
                ids.copy_(_ids(step, c.dev))
                graph.replay()
                torch.cuda.synchronize()
                ref.zero_grad()
                loss_ref = _step(ref, ids).item()
                worst = max(worst, _compare(tp, ref, loss.item(), loss_ref))
        tp.check_errors()
    assert worst < TOL, worst
    return f"worst {worst:.2e} over 3 replays"


def _checkpoint(c) -> str:
    import tp_overlap
    ref, model = _models(c.dev)
    with tp_overlap.parallelize(model, group=dist.group.WORLD, max_tokens=BATCH * SEQ, name="model.ckpt") as tp:
        full = tp.full_state_dict()
        expected = {k: v.to(torch.bfloat16) for k, v in ref.state_dict().items()}
        assert set(full) == set(expected)
        bad = [k for k in expected if full[k].shape != expected[k].shape or not torch.equal(full[k], expected[k])]
        assert not bad, bad[:4]
        tp.load_full_state_dict(full)
    return f"{len(full)} entries"


def _fsdp_probe(c) -> str:
    """FSDP2 over dp with our TP inside, several processes on one GPU: reported, never a failure."""
    try:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        import tp_overlap
        mesh = init_device_mesh("cuda", (c.world // 2, 2), mesh_dim_names=("dp", "tp"))
        _, model = _models(c.dev)
        with tp_overlap.parallelize(model, group=mesh["tp"].get_group(), max_tokens=BATCH * SEQ, name="model.fsdp"):
            for layer in model.model.layers:
                fully_shard(layer, mesh=mesh["dp"])
            fully_shard(model, mesh=mesh["dp"])
            _step(model, _ids(0, c.dev))
            torch.cuda.synchronize()
        return "runs"
    except Exception as exc:  # noqa: BLE001 - what the backends allow is the finding
        return f"not possible here: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}"


def _checks(rank, world):
    torch.cuda.set_device(0)
    c = Checks(rank, world, torch.device("cuda", 0))
    c.run("converted model eager", lambda: _eager_or_compiled(c, None))
    c.run("converted model torch.compile", lambda: _eager_or_compiled(c, "default"))
    c.run("converted model torch.compile(mode=reduce-overhead)", lambda: _eager_or_compiled(c, "reduce-overhead"))
    c.run("converted model whole step captured and replayed", lambda: _captured(c))
    c.run("converted model checkpoint round trip", lambda: _checkpoint(c))
    if world >= 4:
        c.run("FSDP2 dp x tp on one GPU (probe)", lambda: _fsdp_probe(c))
    return c.lines


def main(argv=None) -> int:
    # the options "--worlds" and "--json" are run_worlds's (tests/gpu/smoke_one_gpu.py)
    return run_worlds("tests.gpu.smoke_model", _checks, "2,4", argv)


if __name__ == "__main__":
    sys.exit(main())
