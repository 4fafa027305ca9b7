"""DeepEP V2's expanded layout on the GPU (tokenyard/semantics/expand.py), the part of the CUDA backend that runs it:
a mixin `CudaBackend` inherits, whose methods fall back to `Backend`'s where their kernels do not apply."""

from __future__ import annotations

import math

import torch

from . import heuristics, kernels


class ExpandCalls:
    # -- DeepEP V2's expanded layout (tokenyard/semantics/expand.py) ------------------------------------------
    # Each runs as a plan (NOTE [call plans]) whose row counts are scalars, so a dispatch with the CPU sync,
    # whose counts change at every call, reuses it too; the kernels stride over their rows, so the grids are
    # sized for the most rows there can be.

    def _strided_grid(self, most_items: int, per_block: int = kernels.EXPAND_THREADS // 32) -> int:
        """Blocks for up to `most_items` (a warp each by default), at most four per SM."""
        return max(1, min(-(-most_items // per_block), self.device_sms * 4))

    def expanded_layout(self, recv_topk_idx, recv_src_idx, psum_per_rank, num_local, alignment, num_max,
                        num_expanded):
        usable = recv_topk_idx.is_contiguous() and recv_src_idx.is_contiguous() and recv_src_idx.dtype == torch.int32
        if recv_topk_idx.device.type != "cuda" or psum_per_rank.dtype != torch.int32 or not usable:
            return super().expanded_layout(recv_topk_idx, recv_src_idx, psum_per_rank, num_local, alignment, num_max,
                                           num_expanded)
        num_rows, num_topk = recv_topk_idx.shape
        num_ranks, expanded = psum_per_rank.numel(), num_expanded is not None
        topk_dtype, stride = recv_topk_idx.dtype, psum_per_rank.stride(0)

        def build():
            i32 = torch.int32
            b = self._builder(("recv_topk_idx", "recv_src_idx", "psum_per_rank"), ("num_rows", "num_expanded"))
            rows = b.scalar("num_rows")
            counts = b.output("counts", (num_local,), i32, zero=True)
            row_of = b.output("row_of", (rows, num_topk), i32)
            metadata = b.output("metadata", (rows, num_topk + 2), i32)
            b.launch(self._kernel(kernels.expand_count(num_topk, topk_dtype)),
                     self._strided_grid(num_ranks * num_max, per_block=kernels.EXPAND_THREADS), dict(
                         recv_topk_idx=b.inp("recv_topk_idx"), recv_src_idx=b.inp("recv_src_idx"),
                         psum_per_rank=b.inp("psum_per_rank"), psum_stride=stride, num_ranks=num_ranks,
                         num_rows=rows, num_local=num_local, num_max=num_max, counts=counts, row_of=row_of,
                         metadata=metadata), shared_bytes=num_local * 4)
            psum = b.output("psum_per_expert", (num_local,), i32)
            if expanded:
                source_row = b.output("source_row", (b.scalar("num_expanded"),), i32, fill=0xFF)  # -1: padding
                b.launch(self._kernel(kernels.expand_place(num_topk, topk_dtype)), num_local, dict(
                    recv_topk_idx=b.inp("recv_topk_idx"), num_rows=rows, alignment=alignment, counts=counts,
                    ends=psum, row_of=row_of, metadata=metadata, source_row=source_row))
            else:
                b.launch(self._kernel(kernels.expand_psum()), 1, dict(num_local=num_local, alignment=alignment,
                                                                      counts=counts, psum=psum))
            return b.build()

        plan = self.plan(("expanded_layout", num_topk, topk_dtype, num_ranks, stride, num_local, alignment, num_max,
                          expanded), build)
        made = plan.named(plan.run_here(self._stream(), (recv_topk_idx, recv_src_idx, psum_per_rank),
                                        (num_rows, num_expanded or 0)))
        return made["counts"], made["psum_per_expert"], made["row_of"] if expanded else None, \
            made.get("source_row"), made["metadata"]

    def source_ranks(self, topk_idx: torch.Tensor, num_experts: int) -> torch.Tensor:
        if topk_idx.device.type != "cuda" or not topk_idx.is_contiguous() or topk_idx.dim() != 2:
            return super().source_ranks(topk_idx, num_experts)
        (num_tokens, num_topk), topk_dtype = topk_idx.shape, topk_idx.dtype
        threads = kernels.SOURCE_RANKS_THREADS

        def build():
            b = self._builder(("topk_idx",), ())
            out = b.output("ranks", (num_tokens, num_topk), torch.int32)
            if num_tokens:
                b.launch(self._kernel(kernels.source_ranks(num_topk, topk_dtype)), -(-num_tokens // threads),
                         dict(topk_idx=b.inp("topk_idx"), num_tokens=num_tokens, num_experts=num_experts, ranks=out),
                         shared_bytes=(threads // 32 + 1) * num_experts * 4)
            return b.build()

        plan = self.plan(("source_ranks", num_tokens, num_topk, topk_dtype, num_experts), build)
        return plan.run_here(self._stream(), (topk_idx,))[0]

    def expands_in_dispatch(self, num_sms: int, fresh: bool) -> bool:
        return heuristics.expands_in_dispatch(num_sms, self.ctx.num_ranks, fresh)

    def gather_rows(self, rows: torch.Tensor, source_row: torch.Tensor, zero_fill: bool) -> torch.Tensor:
        row_bytes = math.prod(rows.shape[1:]) * rows.element_size()  # also where no row was received
        if rows.device.type != "cuda" or rows.dim() == 1 or row_bytes % 16 or not rows.is_contiguous() or \
                rows.data_ptr() % 16 or source_row.dtype != torch.int32 or not source_row.is_contiguous():
            return super().gather_rows(rows, source_row, zero_fill)
        tail = tuple(rows.shape[1:])

        def build():
            b = self._builder(("rows", "source_row"), ("num_expanded",))
            m = b.scalar("num_expanded")
            out = b.output("out", (m,) + tail, rows.dtype)
            b.launch(self._kernel(kernels.expand_rows(row_bytes // 16)), self._strided_grid(1 << 30), dict(
                rows=b.inp("rows"), source_row=b.inp("source_row"), num_expanded=m, zero_fill=int(zero_fill),
                out=out))
            return b.build()

        plan = self.plan(("gather_rows", tail, rows.dtype, zero_fill), build)
        return plan.run_here(self._stream(), (rows, source_row), (source_row.numel(),))[0]

    def reduce_expanded(self, x: torch.Tensor, row_of: torch.Tensor) -> torch.Tensor:
        if x.device.type != "cuda" or x.dtype != torch.bfloat16 or x.size(1) % 8 or not x.is_contiguous() or \
                row_of.dtype != torch.int32 or not row_of.is_contiguous():
            return super().reduce_expanded(x, row_of)
        num_rows, num_topk = row_of.shape
        hidden = x.size(1)

        def build():
            b = self._builder(("x", "row_of"), ("num_rows",))
            n = b.scalar("num_rows")
            out = b.output("out", (n, hidden), torch.bfloat16)
            b.launch(self._kernel(kernels.reduce_expanded(hidden // 8, num_topk)), self._strided_grid(1 << 30),
                     dict(x=b.inp("x"), row_of=b.inp("row_of"), num_rows=n, out=out))
            return b.build()

        plan = self.plan(("reduce_expanded", hidden, num_topk), build)
        return plan.run_here(self._stream(), (x, row_of), (num_rows,))[0]

    def _move_weights(self, row_of: torch.Tensor, given: torch.Tensor, out_rows: int, to_expanded: bool,
                      zero_fill: bool) -> torch.Tensor:
        """move_weights as a plan: `given` the pairs' weights ([N, K]) to an expanded [out_rows], or the
        expanded weights to the pairs' [N, K]."""
        num_topk = row_of.size(1)

        def build():
            b = self._builder(("row_of", "given"), ("num_pairs", "out_rows"))
            shape = (b.scalar("out_rows"),) if to_expanded else (b.scalar("out_rows"), num_topk)
            out = b.output("out", shape, torch.float32, zero=to_expanded and zero_fill)
            pairs, expanded = (b.inp("given"), out) if to_expanded else (out, b.inp("given"))
            b.launch(self._kernel(kernels.move_weights()), self._strided_grid(1 << 30, kernels.EXPAND_THREADS),
                     dict(row_of=b.inp("row_of"), num_pairs=b.scalar("num_pairs"), to_expanded=int(to_expanded),
                          pairs=pairs, expanded=expanded))
            return b.build()

        plan = self.plan(("move_weights", num_topk, to_expanded, zero_fill), build)
        return plan.run_here(self._stream(), (row_of, given), (row_of.numel(), out_rows))[0]

    def expand_weights(self, topk_weights, row_of, num_expanded, zero_fill):
        if topk_weights.device.type != "cuda" or row_of.dtype != torch.int32 or not row_of.is_contiguous():
            return super().expand_weights(topk_weights, row_of, num_expanded, zero_fill)
        return self._move_weights(row_of, topk_weights.float().contiguous(), num_expanded, True, zero_fill)

    def local_weights(self, topk_weights, recv_topk_idx):
        if topk_weights.device.type != "cuda" or topk_weights.dtype != torch.float32 or \
                not topk_weights.is_contiguous() or not recv_topk_idx.is_contiguous() or \
                topk_weights.shape != recv_topk_idx.shape:
            return super().local_weights(topk_weights, recv_topk_idx)
        topk_dtype, (num_rows, num_topk) = recv_topk_idx.dtype, topk_weights.shape

        def build():
            b = self._builder(("recv_topk_idx", "weights"), ("num_rows", "num_pairs"))
            out = b.output("out", (b.scalar("num_rows"), num_topk), torch.float32)
            grid = self._strided_grid(1 << 30, kernels.EXPAND_THREADS)
            b.launch(self._kernel(kernels.local_weights(topk_dtype)), grid,
                     dict(recv_topk_idx=b.inp("recv_topk_idx"), weights=b.inp("weights"),
                          num_pairs=b.scalar("num_pairs"), out=out))
            return b.build()

        plan = self.plan(("local_weights", topk_dtype, num_topk), build)
        return plan.run_here(self._stream(), (recv_topk_idx, topk_weights), (num_rows, num_rows * num_topk))[0]

    def gather_weights(self, topk_weights, row_of):
        if topk_weights.device.type != "cuda" or row_of.dtype != torch.int32 or not row_of.is_contiguous():
            return super().gather_weights(topk_weights, row_of)
        return self._move_weights(row_of, topk_weights.float().contiguous(), row_of.size(0), False, False)
