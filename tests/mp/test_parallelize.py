"""`tp_overlap.parallelize` on real transformers models, CPU ranks (gloo + host pool): the converted model's
loss and every parameter gradient equal the unconverted model's on one process, step after step (random
token batches, causal mask, rotary embeddings); the pool does not grow with depth; checkpoints round-trip
under the original names; what cannot be converted is refused before any pool exists, naming the module."""

import pytest
import torch
import torch._dynamo  # noqa: F401  before init_process_group in the children (see launch/tp_mlp.py)
import torch.distributed as dist

from tests.multiproc import run_ranks

pytest.importorskip("transformers", reason="transformers is not installed (pip install -e '.[hf]')")

FP32_TOLERANCE = 1e-5


def _train(rank, world, family, optimizer, steps, layers, extra):
    """Worst relative loss and gradient error of the converted model over `steps` optimizer steps, the same
    for an unconverted twin that sums each gradient in another order (two micro-batches), and the pool size."""
    import tp_overlap
    from tests.mp._hf_models import batch, rel, tiny

    ref, twin, model = (tiny(family, layers=layers, **extra) for _ in range(3))
    seq, batch_size = 6, 2
    tp = tp_overlap.parallelize(model, group=dist.group.WORLD, max_tokens=batch_size * seq)
    make = (lambda p: torch.optim.SGD(p, lr=0.1)) if optimizer == "sgd" else (lambda p: torch.optim.AdamW(p, lr=1e-3))
    optimizers = [make(m.parameters()) for m in (ref, twin, model)]
    worst = {"loss": 0.0, "grad": 0.0, "twin_grad": 0.0}
    for step in range(steps):
        ids = batch(step, batch_size=batch_size, seq=seq)
        for opt in optimizers:
            opt.zero_grad()
        loss_ref = ref(input_ids=ids, labels=ids).loss
        loss = model(input_ids=ids, labels=ids).loss
        for m in (ref, model):
            (loss_ref if m is ref else loss).backward()
        for half in ids.chunk(2):
            (twin(input_ids=half, labels=half).loss / 2).backward()
        worst["loss"] = max(worst["loss"], abs(loss.item() - loss_ref.item()) / abs(loss_ref.item()))
        grads = tp.full_state_dict(grads=True)
        assert set(grads) == {n for n, _ in ref.named_parameters()}
        twin_grads = dict(twin.named_parameters())
        for n, p in ref.named_parameters():
            worst["grad"] = max(worst["grad"], rel(grads[n], p.grad))
            worst["twin_grad"] = max(worst["twin_grad"], rel(twin_grads[n].grad, p.grad))
        for opt in optimizers:
            opt.step()
    pool_bytes = tp.pool_bytes
    tp.close()
    return worst, pool_bytes


@pytest.mark.parametrize("world,optimizer,family,extra", [
    (2, "adamw", "llama", {}),
    (3, "sgd", "llama", {"heads": 6, "kv_heads": 3, "ffn": 36}),
    (2, "sgd", "qwen2", {}),                                        # q/k/v biases
    (2, "adamw", "llama", {"attention_bias": True, "kv_heads": 4}),  # o_proj bias too, no GQA
    (2, "sgd", "mistral", {}),
])
def test_loss_and_every_gradient_equal_the_unconverted_model(world, optimizer, family, extra):
    """fp32, <= 1e-5 relative. AdamW divides each gradient element by its own magnitude, so elements whose
    gradient is at rounding level move by a fraction of the learning rate depending on the rounding: the
    unconverted model itself, summing the same gradient in another order (`twin_grad`), departs by ~2e-5
    after its first step. Past that step the bound is twice the twin's departure."""
    steps = 5 if family == "llama" and not extra else 2
    for worst, _ in run_ranks(_train, world, family, optimizer, steps, 2, extra, timeout_s=240):
        bound = FP32_TOLERANCE if optimizer == "sgd" else max(FP32_TOLERANCE, 2 * worst["twin_grad"])
        assert worst["loss"] <= FP32_TOLERANCE and worst["grad"] <= bound, worst


def test_the_pool_does_not_grow_with_depth():
    shallow = run_ranks(_train, 2, "llama", "sgd", 2, 2, {}, timeout_s=240)
    deep = run_ranks(_train, 2, "llama", "sgd", 2, 8, {}, timeout_s=300)
    for (worst2, pool2), (worst8, pool8) in zip(shallow, deep):
        assert pool2 == pool8 > 0
        assert worst2["grad"] <= FP32_TOLERANCE and worst8["grad"] <= FP32_TOLERANCE, (worst2, worst8)


def _checkpoints(rank, world):
    import tp_overlap
    from tests.mp._hf_models import batch, rel, tiny

    ref, model, fresh = tiny("qwen2", seed=0), tiny("qwen2", seed=0), tiny("qwen2", seed=7)
    tp = tp_overlap.parallelize(model, group=dist.group.WORLD, max_tokens=12)
    full = tp.full_state_dict()
    expected = ref.state_dict()
    assert set(full) == set(expected)
    assert all(full[k].shape == expected[k].shape and torch.equal(full[k], expected[k]) for k in expected)
    ids = batch(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    trained = tp.full_state_dict()
    # the trained weights leave as a plain transformers model ...
    fresh.load_state_dict(trained)
    out_full = fresh(input_ids=batch(1)).logits
    with torch.no_grad():
        out_tp = model(input_ids=batch(1)).logits
    # ... and come back into another converted model (a resumed run), which computes the same
    other = tiny("qwen2", seed=3)
    tp_other = tp_overlap.parallelize(other, group=dist.group.WORLD, max_tokens=12, name="resumed")
    tp_other.load_full_state_dict(trained)
    with torch.no_grad():
        out_resumed = other(input_ids=batch(1)).logits
    errors = (rel(out_tp, out_full), rel(out_resumed, out_full))
    try:
        tp_other.load_full_state_dict({k: v for k, v in trained.items() if "k_proj" not in k})
        missing = "accepted"
    except tp_overlap.OverlapError as exc:
        missing = str(exc)
    tp.close()
    tp_other.close()
    return errors, missing


def test_checkpoints_round_trip_under_the_original_names_and_shapes():
    for (err_tp, err_resumed), missing in run_ranks(_checkpoints, 2, timeout_s=240):
        assert err_tp <= FP32_TOLERANCE and err_resumed <= FP32_TOLERANCE, (err_tp, err_resumed)
        assert "load_full_state_dict: no model.layers.0.self_attn.k_proj." in missing, missing


def _refusals(rank, world):
    import torch.nn as nn

    import tp_overlap
    from tp_overlap.symm_mem.pool import live_pool_count
    from tests.mp._hf_models import tiny

    def refused(model, **kwargs):
        try:
            tp_overlap.parallelize(model, group=dist.group.WORLD, **{"max_tokens": 12, **kwargs})
        except tp_overlap.OverlapError as exc:
            return str(exc), live_pool_count()
        return "converted", live_pool_count()

    odd_heads = tiny("llama", heads=3, kv_heads=1, head_dim=8, ffn=48)
    extra_module = tiny("llama")
    extra_module.model.layers[1].self_attn.q_norm = nn.LayerNorm(8)   # a module the conversion does not know
    gelu = tiny("llama", hidden_act="gelu")
    biased = tiny("llama", mlp_bias=True)
    return {"heads": refused(odd_heads), "unknown": refused(extra_module), "gelu": refused(gelu),
            "mlp_bias": refused(biased), "no_match": refused(tiny("llama"), plan={"model.blocks.*": "mlp"}),
            "tokens": refused(tiny("llama"), max_tokens=13)}


def test_what_cannot_be_converted_is_refused_before_any_pool_naming_the_module():
    for found in run_ranks(_refusals, 2, timeout_s=180):
        expected = {"heads": "model.layers.0.self_attn: num_attention_heads = 3 is not divisible by the TP size 2",
                    "unknown": "model.layers.1.self_attn: LlamaAttention has module(s) q_norm",
                    "gelu": "model.layers.0.mlp: its activation is not SiLU",
                    "mlp_bias": "model.layers.0.mlp.gate_proj: has a bias",
                    "no_match": "plan['model.blocks.*'] matches no module",
                    "tokens": "max_tokens=13 must be divisible by the TP group size (2)"}
        for case, text in expected.items():
            message, pools = found[case]
            assert text in message and pools == 0, (case, message, pools)
