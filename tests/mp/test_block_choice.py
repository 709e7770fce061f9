"""One block choice for every GEMM: the fused AllGather consumer and the scatter GEMM ask `choose_blocks` with
the layout each call's weight really has (row-major [K, N], or `weight.t()` of a row-major [N, K]) and the
GPU of the op's device, and a call of each layout runs a plan of its own; a GPU without a table gets the
heuristic, and the results say which chose."""

import torch
import torch.distributed as dist

from tests.multiproc import run_ranks


def _recorded_choices(rank, world):
    import tp_overlap.ops.ag_consumers as ag_consumers
    import tp_overlap.ops.rs_scatter as gemm_rs_module
    from tp_overlap.config.schema import AgGemmConfig, GemmRsConfig
    from tp_overlap.ops.ag_gemm import AgGemm
    from tp_overlap.ops.gemm_rs import GemmRs
    from tp_overlap.ops.reference import ag_gemm_reference
    from tp_overlap.symm_mem.pool import SymmetricPool

    seen = []

    def spy(real):
        def choose(m, n, k, **kwargs):
            seen.append((n, k, kwargs.get("b_transposed"), kwargs.get("gpu", "missing")))
            return real(m, n, k, **kwargs)
        return choose

    ag_consumers.choose_blocks = spy(ag_consumers.choose_blocks)
    gemm_rs_module.choose_blocks = spy(gemm_rs_module.choose_blocks)
    group, rows, k, n = dist.group.WORLD, 8, 24, 16
    gen = torch.Generator().manual_seed(rank)
    with SymmetricPool(1 << 20, group=group) as pool:
        ag = AgGemm(group=group, pool=pool, max_m=rows * world, k=k, n_local=None, dtype=torch.float32,
                    config=AgGemmConfig(method="fused", comm_stream_priority=0), name="ag")
        rs = GemmRs(group=group, pool=pool, max_m=rows * world, k_local=None, n=k, dtype=torch.float32,
                    config=GemmRsConfig(method="fused", sm_margin=1, num_comm_sms=1, comm_stream_priority=0), name="rs")
        x = torch.randn(rows, k, generator=gen)
        w_kn = torch.randn(k, n, generator=gen)                      # row-major [K, N]
        w_nk = torch.randn(n, k, generator=gen).t()                  # nn.Linear's [N, K], transposed
        out_kn, out_nk = ag(x, w_kn), ag(x, w_nk)
        a = torch.randn(rows * world, n, generator=gen)
        rs(a, torch.randn(n, k, generator=gen))
        rs(a, torch.randn(k, n, generator=gen).t())
        plans = sorted((key.n, key.b_transposed) for key in ag._plans) + sorted(
            (key.k, key.b_transposed) for key in rs._plans)
        gathered = ag_gemm_reference(x, w_kn, group=group)[1]
        ok = torch.allclose(out_kn, gathered @ w_kn, atol=1e-4) and torch.allclose(out_nk, gathered @ w_nk, atol=1e-4)
        ag.close()
        rs.close()
    return seen, plans, ok


def test_the_fused_gemms_choose_blocks_by_the_layout_of_each_call_and_the_ops_gpu():
    for seen, plans, ok in run_ranks(_recorded_choices, 2, timeout_s=180):
        assert ok
        # AG: (n, k) of the consumer GEMM; RS: (n, k_local) of the scatter GEMM; one plan per layout
        assert (16, 24, False, None) in seen and (16, 24, True, None) in seen, seen   # CPU: no GPU, no table
        assert (24, 16, False, None) in seen and (24, 16, True, None) in seen, seen
        assert plans == [(16, False), (16, True), (16, False), (16, True)], plans


def test_the_results_say_what_chose_the_blocks():
    from tp_overlap.gemm.blocks import choose_blocks, gpu_slug, heuristic_blocks
    from tp_overlap.launch.output.report import gemm_blocks_source

    assert gemm_blocks_source("NVIDIA H200") == "h200.yaml"
    assert gemm_blocks_source("NVIDIA H100 80GB HBM3") == "h100.yaml"
    assert gemm_blocks_source("NVIDIA A100-SXM4-80GB") == "heuristic (no table for a100)"
    assert gpu_slug("NVIDIA H100 80GB HBM3") == "h100"
    # a GPU without a table: the heuristic, whatever the layout
    for transposed in (False, True):
        assert choose_blocks(4096, 1536, 4096, b_transposed=transposed, gpu="a100") == \
            heuristic_blocks(4096, 1536, 4096, sm_count=132)


def test_the_h200_table_differs_by_layout_where_it_was_measured_to():
    from tp_overlap.gemm.blocks import load_block_table

    table = load_block_table("h200")
    differ = [(e.m, e.n, e.k) for e in table.entries
              if e.layout == "kn" and (entry := table.lookup(e.m, e.n, e.k, "nk")) is not None
              and entry.blocks != e.blocks]
    assert differ, "every shape chose the same blocks in both layouts: the layout would not matter"
