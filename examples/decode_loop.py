"""Greedy decoding through an expert-parallel MoE layer in low-latency mode.

Each rank decodes its own batch of sequences with a toy model (embedding -> MoE block with a residual ->
output head). Per step: route the batch, `low_latency_dispatch` (bf16, ``use_fp8=False``) to the
experts' ranks, run each local expert on its slots of the packed ``[L, R*M, H]`` layout (the first
``packed_recv_count[l]`` rows), and `low_latency_combine` the outputs back with the top-k weights. Every
step is checked against the same block computed densely on this rank with all experts.

    python examples/decode_loop.py               # 2 gloo ranks on CPU
    python examples/decode_loop.py --ranks 4     # on a machine with 4 GPUs: NCCL

It runs on NCCL with one rank per GPU where at least two GPUs are visible, else on gloo CPU ranks.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

import _common  # noqa: E402  (puts this checkout first on sys.path)
from tokenyard import Buffer  # noqa: E402
from tokenyard.layers import moe  # noqa: E402

VOCAB, HIDDEN, INTERMEDIATE, NUM_EXPERTS, NUM_TOPK = 256, 128, 256, 16, 4
BATCH_PER_RANK = 8                   # sequences decoded by each rank
NUM_MAX_DISPATCH_TOKENS_PER_RANK = 8  # M: the most tokens any rank dispatches in one step


def decode(rank: int, num_ranks: int, device: torch.device, steps: int, backend: str) -> None:
    dtype = torch.bfloat16

    # The whole model, the same on every rank (one seed); each rank runs only experts r*L .. r*L+L-1.
    generator = torch.Generator().manual_seed(0)
    embedding = torch.randn(VOCAB, HIDDEN, generator=generator).to(device, dtype)
    head = torch.randn(VOCAB, HIDDEN, generator=generator).to(device, torch.float32)
    gate_up_proj = (torch.randn(NUM_EXPERTS, 2 * INTERMEDIATE, HIDDEN, generator=generator) * HIDDEN ** -0.5)
    down_proj = torch.randn(NUM_EXPERTS, HIDDEN, INTERMEDIATE, generator=generator) * INTERMEDIATE ** -0.5
    gate_up_proj, down_proj = gate_up_proj.to(device, dtype), down_proj.to(device, dtype)
    router = moe.TopKRouter(HIDDEN, NUM_EXPERTS, NUM_TOPK, dtype=dtype, device=device)
    with torch.no_grad():
        router.weight.copy_(torch.randn(NUM_EXPERTS, HIDDEN, generator=generator) * HIDDEN ** -0.5)
    experts = moe.GatedExperts.from_dense(gate_up_proj, down_proj, rank, num_ranks)
    all_experts = moe.GatedExperts.from_dense(gate_up_proj, down_proj, 0, 1)  # only for the check

    num_rdma_bytes = Buffer.get_low_latency_rdma_size_hint(NUM_MAX_DISPATCH_TOKENS_PER_RANK, HIDDEN, num_ranks,
                                                           NUM_EXPERTS)
    buffer = Buffer(dist.group.WORLD, 0, num_rdma_bytes, low_latency_mode=True, backend=backend)
    tokens = torch.randint(0, VOCAB, (BATCH_PER_RANK,), generator=torch.Generator().manual_seed(rank + 1))
    tokens = tokens.to(device)
    sequences, worst = [tokens], 0.0
    with torch.no_grad():
        for _ in range(steps):
            h = embedding[tokens]
            topk_idx, topk_weights = router(h)
            packed_x, packed_count, handle, _, _ = buffer.low_latency_dispatch(
                h, topk_idx, NUM_MAX_DISPATCH_TOKENS_PER_RANK, NUM_EXPERTS, use_fp8=False)
            # packed_x[l, :packed_count[l]] are the tokens (from every rank) for local expert l.
            expert_out = experts.forward_packed(packed_x, packed_count)
            moe_out, _, _ = buffer.low_latency_combine(expert_out, topk_idx, topk_weights, handle)

            dense = torch.zeros(h.shape, dtype=torch.float32, device=device)
            for k in range(NUM_TOPK):
                for t in range(h.size(0)):
                    dense[t] += topk_weights[t, k] * all_experts.expert(int(topk_idx[t, k]), h[t:t + 1])[0].float()
            worst = max(worst, (moe_out.float() - dense).abs().max().item() / dense.abs().max().item())

            h = h + moe_out
            tokens = (h.float() @ head.T).argmax(dim=-1)
            sequences.append(tokens)
    decoded = torch.stack(sequences, dim=1).cpu()
    gathered = [None] * num_ranks
    dist.all_gather_object(gathered, (decoded.tolist(), worst))
    if rank == 0:
        for r, (rows, error) in enumerate(gathered):
            print(f"rank {r}: {rows[0]} ... (largest difference from the dense block: {error:.2g} of its scale)")
        print(f"{num_ranks} ranks on {device.type} ({buffer.backend} backend), {steps} steps of "
              f"{BATCH_PER_RANK} tokens per rank, {NUM_EXPERTS // num_ranks} experts per rank")
        if max(error for _, error in gathered) > 2 ** -6:
            raise SystemExit("the expert-parallel output drifted from the dense block beyond bf16 rounding")
    buffer.destroy()  # _common leaves the group once this has returned


def main() -> None:
    _common.spawn(decode, _common.parse_args(__doc__.split("\n")[0], NUM_EXPERTS, steps=6))


if __name__ == "__main__":
    main()
