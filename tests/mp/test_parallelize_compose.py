"""A converted model composed with what users train it under, CPU ranks (gloo + host pool): FSDP2 over the
other dimension of a 2-D DeviceMesh (dp 2 x tp 2: loss and every gradient equal the one-process model's on
both dp batches), torch.compile (the default inductor backend: the same loss and gradients as eager), and
transformers' activation checkpointing of the blocks (recomputed forwards call the ops again)."""

import pytest
import torch
import torch._dynamo  # noqa: F401  before init_process_group in the children (see launch/tp_mlp.py)
import torch.distributed as dist

from tests.multiproc import run_ranks

pytest.importorskip("transformers", reason="transformers is not installed (pip install -e '.[hf]')")

FP32_TOLERANCE = 1e-5


def _fsdp_over_dp(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import tp_overlap
    from tests.mp._hf_models import batch, rel, tiny

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    ref, model = tiny("llama"), tiny("llama")
    tp = tp_overlap.parallelize(model, group=mesh["tp"].get_group(), max_tokens=12)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    dp = mesh["dp"].get_local_rank()
    opt_ref, opt = torch.optim.SGD(ref.parameters(), lr=0.1), torch.optim.SGD(model.parameters(), lr=0.1)
    worst_loss = worst_grad = 0.0
    for step in range(3):
        ids = [batch(2 * step + i) for i in range(2)]   # the batch of each dp rank
        opt_ref.zero_grad()
        opt.zero_grad()
        losses_ref = [ref(input_ids=x, labels=x).loss for x in ids]
        (sum(losses_ref) / 2).backward()                # FSDP2 averages the gradient over dp
        loss = model(input_ids=ids[dp], labels=ids[dp]).loss
        loss.backward()
        worst_loss = max(worst_loss, abs(loss.item() - losses_ref[dp].item()) / losses_ref[dp].item())
        grads = tp.full_state_dict(grads=True)
        worst_grad = max([worst_grad] + [rel(grads[n], p.grad) for n, p in ref.named_parameters()])
        opt_ref.step()
        opt.step()
    sharded = sum(hasattr(p, "full_tensor") for p in model.parameters())
    tp.close()
    return worst_loss, worst_grad, sharded


def test_fsdp2_over_dp_with_our_tp_inside_each_tp_group():
    for worst_loss, worst_grad, sharded in run_ranks(_fsdp_over_dp, 4, timeout_s=300):
        assert sharded > 0, "FSDP2 sharded nothing"
        assert worst_loss <= FP32_TOLERANCE and worst_grad <= FP32_TOLERANCE, (worst_loss, worst_grad)


def _compiled(rank, world):
    import tp_overlap
    from tests.mp._hf_models import batch, rel, tiny

    eager, model = tiny("llama"), tiny("llama")
    tp_eager = tp_overlap.parallelize(eager, group=dist.group.WORLD, max_tokens=12, name="eager")
    tp_compiled = tp_overlap.parallelize(model, group=dist.group.WORLD, max_tokens=12, name="compiled")
    compiled = torch.compile(model)
    worst_loss = worst_grad = 0.0
    for step in range(2):
        ids = batch(step)
        loss_eager = eager(input_ids=ids, labels=ids).loss
        loss_eager.backward()
        loss = compiled(input_ids=ids, labels=ids).loss
        loss.backward()
        worst_loss = max(worst_loss, abs(loss.item() - loss_eager.item()) / loss_eager.item())
        grads_eager, grads = tp_eager.full_state_dict(grads=True), tp_compiled.full_state_dict(grads=True)
        worst_grad = max([worst_grad] + [rel(grads[n], grads_eager[n]) for n in grads_eager])
        eager.zero_grad()
        model.zero_grad()
    tp_eager.close()
    tp_compiled.close()
    return worst_loss, worst_grad


def test_torch_compile_matches_eager():
    for worst_loss, worst_grad in run_ranks(_compiled, 2, timeout_s=600, pg_timeout_s=300):
        assert worst_loss <= FP32_TOLERANCE and worst_grad <= FP32_TOLERANCE, (worst_loss, worst_grad)


def _checkpointed(rank, world):
    import tp_overlap
    from tests.mp._hf_models import batch, rel, tiny

    ref, model = tiny("llama"), tiny("llama")
    if hasattr(model, "activation_checkpointing_enable"):   # transformers >= 5.2x renames it
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    tp = tp_overlap.parallelize(model, group=dist.group.WORLD, max_tokens=12)
    ids = batch(0)
    loss, loss_ref = model(input_ids=ids, labels=ids).loss, ref(input_ids=ids, labels=ids).loss
    loss.backward()
    loss_ref.backward()
    grads = tp.full_state_dict(grads=True)
    tp.close()
    return abs(loss.item() - loss_ref.item()), max(rel(grads[n], p.grad) for n, p in ref.named_parameters())


def test_activation_checkpointing_of_the_blocks_recomputes_the_same():
    for loss_error, worst_grad in run_ranks(_checkpointed, 2, timeout_s=180):
        assert loss_error <= FP32_TOLERANCE and worst_grad <= FP32_TOLERANCE, (loss_error, worst_grad)
