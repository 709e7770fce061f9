"""One AgGemm and one GemmRs shared by layers of different widths (custom_ops.SharedOps, what a converted model
runs): each call brings its own weight width and gets its own plan, outputs equal the plain collectives' for
interleaved widths, and the pool holds one region per op whatever the number of layers."""

import torch
import torch._dynamo  # noqa: F401  before init_process_group in the children (see launch/tp_mlp.py)
import torch.distributed as dist

from tests.multiproc import run_ranks

HIDDEN, ROWS = 40, 9


def _shared(rank, world):
    import tp_overlap
    from tp_overlap.config.presets import load_preset
    from tp_overlap.ops.custom_ops import SharedOps
    from tp_overlap.ops.layers import ColumnParallelLinear, RowParallelLinear, pool_requirements
    from tp_overlap.ops.reference import ag_gemm_reference, gemm_rs_reference
    from tp_overlap.symm_mem.pool import SymmetricPool

    group, config = dist.group.WORLD, load_preset("cpu", world)
    req = pool_requirements(hidden=HIDDEN, max_m=ROWS * world, world_size=world, dtype=torch.float32, num_layers=1)
    out = {}
    with SymmetricPool(req.size_bytes, group=group, num_signal_words=req.num_signal_words,
                       num_device_words=req.num_device_words) as pool:
        shared = SharedOps(group=group, pool=pool, max_m=ROWS * world, hidden=HIDDEN, dtype=torch.float32,
                           config=config)
        gen = torch.Generator().manual_seed(rank)
        worst = 0.0
        for step, width in enumerate((24, 8, 56, 24, 8)):   # interleaved widths, repeated
            x = torch.randn(ROWS, HIDDEN, generator=gen)
            w = torch.randn(HIDDEN, width, generator=torch.Generator().manual_seed(step))
            got, want = shared.ag(x, w), ag_gemm_reference(x, w, group=group)[0]
            a = torch.randn(ROWS * world, width, generator=gen)
            w2 = torch.randn(width, HIDDEN, generator=torch.Generator().manual_seed(100 + step))
            got2, want2 = shared.rs(a, w2), gemm_rs_reference(a, w2, group=group)
            worst = max(worst, ((got - want).norm() / want.norm()).item(), ((got2 - want2).norm() / want2.norm()).item())
        out["worst"] = worst
        out["ag_widths"] = sorted({key.n for key in shared.ag._plans})
        out["rs_widths"] = sorted({key.k for key in shared.rs._plans})
        # the pool is exactly one layer's (num_layers=1): a layer that reserved anything would not fit
        layers = [cls(HIDDEN if cls is ColumnParallelLinear else width * world,
                      width * world if cls is ColumnParallelLinear else HIDDEN, group=group, max_m=ROWS * world,
                      dtype=torch.float32, shared=shared, save_gathered="copy", name=f"l{i}")
                  for i, (cls, width) in enumerate([(ColumnParallelLinear, 12), (RowParallelLinear, 12),
                                                    (ColumnParallelLinear, 20), (RowParallelLinear, 4)])]
        try:
            ColumnParallelLinear(HIDDEN, 8 * world, group=group, max_m=ROWS * world, dtype=torch.float32,
                                 shared=shared, name="view")
            out["view"] = "accepted"
        except tp_overlap.OverlapError as exc:
            out["view"] = str(exc)
        for layer in layers:
            layer.close()
        shared.close()
    return out


def test_one_op_of_each_kind_serves_every_width():
    for out in run_ranks(_shared, 2, timeout_s=180):
        assert out["worst"] <= 1e-5, out
        assert out["ag_widths"] == [8, 24, 56] and out["rs_widths"] == [8, 24, 56], out
        assert "save_gathered='copy'" in out["view"], out["view"]
