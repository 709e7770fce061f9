"""No host rendezvous on the hot path (DESIGN.md): an op call meets its peers only in the flags of its own
protocol, never through the process group's store, a pool barrier or agreement step, or a torch.distributed
collective (CPU ranks, gloo, the host pool, real processes). Every such call made during warm op calls of
each method and schedule, and a TP MLP's forward and backward, is counted: the count must be 0, and the
pool's own counters (`stats()`: allocations, rendezvous) must not move, from the first call on."""

import contextlib

import torch
import torch._dynamo  # noqa: F401  before init_process_group in the children: see launch/tp_mlp.py
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from tp_overlap.config.presets import load_preset
from tp_overlap.config.schema import AgGemmConfig, GemmRsConfig
from tp_overlap.ops.ag_gemm import AgGemm
from tp_overlap.ops.gemm_rs import GemmRs
from tp_overlap.ops.layers import TPMLP, pool_requirements
from tp_overlap.symm_mem.pool import SymmetricPool
from tp_overlap.symm_mem.rendezvous import Rendezvous
from tests.multiproc import run_ranks

COLLECTIVES = ("barrier", "monitored_barrier", "all_reduce", "all_gather", "all_gather_object",
               "all_gather_into_tensor", "reduce_scatter", "reduce_scatter_tensor", "broadcast",
               "broadcast_object_list", "gather", "scatter", "reduce", "all_to_all", "all_to_all_single", "send",
               "recv", "isend", "irecv", "batch_isend_irecv")
STORE_METHODS = ("set", "get", "add", "check", "wait", "compare_set", "delete_key", "multi_get", "multi_set",
                 "append", "num_keys")
K, N, ROWS = 16, 8, 4


class _Counter:
    def __init__(self):
        self.calls: dict[str, int] = {}

    def wrap(self, name, fn):
        def counted(*args, **kwargs):
            self.calls[name] = self.calls.get(name, 0) + 1
            return fn(*args, **kwargs)
        return counted


class _CountingStore:
    """The process group's store, every method call counted."""

    def __init__(self, store, counter):
        self._store, self._counter = store, counter

    def __getattr__(self, name):
        value = getattr(self._store, name)
        return self._counter.wrap(f"store.{name}", value) if name in STORE_METHODS else value


@contextlib.contextmanager
def _counting(pools):
    """Count every collective, store call, pool barrier / agreement and rendezvous step meanwhile."""
    counter, saved = _Counter(), []

    def patch(owner, name, label):
        if hasattr(owner, name):
            saved.append((owner, name, getattr(owner, name)))
            setattr(owner, name, counter.wrap(label, getattr(owner, name)))

    for name in COLLECTIVES:
        patch(dist, name, f"dist.{name}")
        patch(c10d, name, f"c10d.{name}")
    for name in ("barrier", "agree"):
        patch(SymmetricPool, name, f"pool.{name}")
    patch(Rendezvous, "exchange", "rendezvous.exchange")
    stores = [(pool._rendezvous, pool._rendezvous.store) for pool in pools]
    for rendezvous, store in stores:
        rendezvous.store = _CountingStore(store, counter)
    patch(c10d, "_get_default_store", "store._get_default_store")
    try:
        yield counter
    finally:
        for owner, name, value in reversed(saved):
            setattr(owner, name, value)
        for rendezvous, store in stores:
            rendezvous.store = store


def _ops(group, pool, world):
    return {
        "ag decomposed": AgGemm(group=group, pool=pool, max_m=ROWS * world, k=K, n_local=N, dtype=torch.float32,
                                config=AgGemmConfig(method="decomposed", chunks_per_rank=2, comm_stream_priority=0),
                                name="agd"),
        "ag fused": AgGemm(group=group, pool=pool, max_m=ROWS * world, k=K, n_local=N, dtype=torch.float32,
                           config=AgGemmConfig(method="fused", comm_stream_priority=0), name="agf"),
        "rs decomposed": GemmRs(group=group, pool=pool, max_m=ROWS * world, k_local=K, n=N, dtype=torch.float32,
                                config=GemmRsConfig(method="decomposed", num_comm_sms=1, comm_stream_priority=0),
                                name="rsd"),
        "rs pair": GemmRs(group=group, pool=pool, max_m=ROWS * world, k_local=K, n=N, dtype=torch.float32,
                          config=GemmRsConfig(method="pair", sm_margin=0, comm_stream_priority=0), name="rsp"),
        "rs fused": GemmRs(group=group, pool=pool, max_m=ROWS * world, k_local=K, n=N, dtype=torch.float32,
                           config=GemmRsConfig(method="fused", sm_margin=1, num_comm_sms=1, comm_stream_priority=0),
                           name="rsf"),
    }


def _calls(ops, world):
    """One call of each op, method and schedule (all_gather, bulk with a weight grad, reduce_scatter too)."""
    a, w = torch.randn(ROWS, K), torch.randn(K, N)
    a_rs, g = torch.randn(ROWS * world, K), torch.randn(ROWS * world, 3)
    for name, op in ops.items():
        if name.startswith("ag"):
            op(a, w)
            op(a, w, wgrad_of=g)
            op.all_gather(a)
        else:
            op(a_rs, w)
            op.bulk(a_rs, w, wgrad_of=g)
            op.reduce_scatter(torch.randn(ROWS * world, N))


def _hot_path(rank, world):
    group = dist.group.WORLD
    req = pool_requirements(hidden=K, max_m=ROWS * world, world_size=world, dtype=torch.float32)
    with SymmetricPool(1 << 22, group=group) as pool, \
            SymmetricPool(req.size_bytes, num_signal_words=req.num_signal_words,
                          num_device_words=req.num_device_words, group=group) as mlp_pool:
        ops = _ops(group, pool, world)
        mlp = TPMLP(K, 4 * world, group=group, max_m=ROWS * world, dtype=torch.float32, pool=mlp_pool,
                    config=load_preset("cpu", world))
        x = torch.randn(ROWS, K, requires_grad=True)
        built = pool.stats(), mlp_pool.stats()
        _calls(ops, world)   # warm: every plan built
        mlp(x).sum().backward()
        before = pool.stats(), mlp_pool.stats()
        with _counting([pool, mlp_pool]) as counter:
            for _ in range(3):
                _calls(ops, world)
                mlp(x).sum().backward()
        after = pool.stats(), mlp_pool.stats()
        calls = sum(op.calls for op in ops.values())
        for op in ops.values():
            op.close()
        mlp.close()
    return counter.calls, before == after, calls, built == before


def test_op_calls_and_a_layer_step_make_no_store_barrier_or_collective_call():
    for counted, stats_unchanged, calls, first_calls_allocate_nothing in run_ranks(_hot_path, 2, timeout_s=240):
        assert calls == 4 * 5 * 3, calls   # the warm round and 3 counted ones, 5 ops, 3 calls each
        assert counted == {}, counted
        assert stats_unchanged
        # nor the first calls: a first call may run inside torch.compile's CUDA-graph-tree warm-up, which
        # refuses any allocation it leaves alive (reduce-overhead); the ops make theirs when built
        assert first_calls_allocate_nothing
