"""GemmRs's copy-engine schedules for W = 2 and the column backward: `bulk` and the `decomposed` pair.

Both run the GEMM on cuBLAS and move the other owner's rows with the copy engine into its slot of the
`<name>.partials` region (the same slots and epochs as every GemmRs method, see overlap/gemm_rs.py),
then reduce on the compute stream after the caller's work: at W = 2 one elementwise add after a bounded
wait for the peer's pushed-slot flag (flag words of their own, written by a stream memop), no reduction
kernel spinning beside the GEMMs and no copy of this rank's rows; at W > 2 the row-block flags and the
reduction kernel of `decomposed`.
A mixin of GemmRs: it uses the op's pool, streams, epochs and validation.
"""

from __future__ import annotations

import torch

from .triton_gemm import sm_carveout

__all__ = ["CopyEngineSchedules"]


class CopyEngineSchedules:
    def bulk(self, a: torch.Tensor, w: torch.Tensor, work):
        """(out_shard [M/W, N] = reduce_scatter(a @ w), work()), the reduce-scatter overlapping `work`.

        For a GEMM+RS followed by independent GPU work (a column layer's backward: the weight-grad GEMM).
        a @ w runs whole (cuBLAS, every SM) on the current stream; the copy engine moves each owner's rows
        to it while `work()` enqueues on the current stream; then this rank's W partials are summed there
        on every SM. Same pool region and epochs as `__call__` (at W = 2 the pushed-slot flags, else the same
flags); both results are valid on the
        current stream on return (CUDA), or at once (CPU: no overlap, the same protocol).
        """
        self._validate(a, w)
        rows = a.shape[0] // self.world_size
        with self._guard:
            self._epoch += 1
            out = torch.empty(rows, self.n, dtype=self.dtype, device=self.device)
            if self.device.type == "cpu":
                self._run_host(a, w, out)
                return out, work()
            compute = torch.cuda.current_stream(self.device)
            self._begin_cuda(compute)
            partials = torch.mm(a, w)
            self._mark(1, compute)
            pair = self.world_size == 2
            try:
                self._push(partials, rows, compute, own=not pair, pair=pair)
                result = work()
                self._mark(2, compute)
                if pair:  # one elementwise add of our rows and the peer's: no copy of our own rows
                    self._add_pair(partials[self.rank * rows:(self.rank + 1) * rows], out)
                else:
                    # our own flags first: replayed, they are kernels, and a reduction spinning on every
                    # SM for the peers' flags must not keep them from running
                    compute.wait_stream(self._comm_stream)
                    self._reduce(rows, out, programs=self.num_sms)
            finally:  # also if work() raised: partials (caching allocator) is freed on return
                compute.wait_stream(self._comm_stream)
            self._mark(3, compute)
        return out, result

    def _add_pair(self, own_partial, out) -> None:
        """W = 2, on the compute stream: bounded wait for the peer's pushed partial, out = own_partial + it."""
        from kernels.flags import write_flag

        peer = 1 - self.rank
        region = f"{self.name}.partials"
        self.pool.wait(region, self._pair_flag0 + peer, self._pushed_value(), timeout_s=self.timeout_s,
                       peer=peer, op=self.name)
        if self.cuda_graphs:  # the toggle back to 0 lands before the reduced signal lets the peer push again
            write_flag(self.pool.signals(region), self._pair_flag0 + peer, 0)
        torch.add(own_partial, self._slots(self.rank, out.shape[0])[peer], out=out)
        self._signal_reduced()

    def _pushed_value(self) -> int:
        """What the pushed-slot flag holds once this call's partial has landed: the host epoch, or replayed
        the constant 1 (reset by the owner), so that a stream memory operation can write it."""
        return 1 if self.cuda_graphs else self._epoch

    def _run_decomposed_pair(self, a, w, out) -> None:
        """W = 2 with num_comm_sms = 0: the peer's rows first, pushed on the copy engine while our own
        rows' GEMM runs, then one add on every SM (no reduction kernel spinning beside the GEMMs)."""
        rows = a.shape[0] // 2
        peer = 1 - self.rank
        compute = torch.cuda.current_stream(self.device)
        self._begin_cuda(compute)
        with sm_carveout(self.config.sm_margin):
            staged = torch.mm(a[peer * rows:(peer + 1) * rows], w, out=self._staging[:rows])
            self._push_rows(staged, peer, compute, pair=True)
            own = torch.mm(a[self.rank * rows:(self.rank + 1) * rows], w)
        self._mark(1, compute)
        self._mark(2, compute)
        self._add_pair(own, out)
        compute.wait_stream(self._comm_stream)  # the staging buffer is rewritten by the next call
        self._mark(3, compute)

    def _push_rows(self, rows_of_owner, owner, compute, *, pair: bool) -> None:
        """Copy-engine push of `rows_of_owner` [M/W, N] into owner's slot of this rank, then its flags:
        pair=True (the owner reduces with `_add_pair`) the pushed-slot flag, by a stream memory operation,
        which needs no SM while a GEMM holds them all; else every row-block flag (a kernel), which the
        reduction kernel waits for."""
        from kernels.flags import launch_signal_range, write_flag

        flags = self.pool.peer_signals(f"{self.name}.partials", owner)
        self._comm_stream.wait_stream(compute)
        with torch.cuda.stream(self._comm_stream):
            self._slots(owner, rows_of_owner.shape[0])[self.rank].copy_(rows_of_owner, non_blocking=True)
            if pair:
                write_flag(flags, self._pair_flag0 + self.rank, self._pushed_value())
            else:
                launch_signal_range(flags, self.rank * self.flags_per_source, self.flags_per_source,
                                    self._step_epoch())

    def _push(self, partials, rows, compute, *, own: bool, pair: bool) -> None:
        """`_push_rows` for every owner's rows of `partials` [M, N], ring order (own=False: not this rank's
        rows, which the caller reads from `partials`)."""
        for owner in self.owners() if own else self.owners()[:-1]:
            self._push_rows(partials[owner * rows:(owner + 1) * rows], owner, compute, pair=pair)
