"""Train an expert-parallel MoE layer for a few steps with tokenyard's differentiable dispatch and combine.

Every rank starts from the same dense weights (one seed), keeps its share of the experts, and trains on
its own tokens. The router is replicated, so its gradients are averaged over the ranks as in data
parallelism; the experts' gradients already hold every rank's tokens (the backward of dispatch and
combine brought them), so they are only scaled to the global mean.

    python examples/train_step.py                # 2 gloo ranks on CPU, float32
    python examples/train_step.py --ranks 4      # on a machine with 4 GPUs: NCCL, bf16

It runs on NCCL with one rank per GPU where at least two GPUs are visible, else on gloo CPU ranks.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

import _common  # noqa: E402  (puts this checkout first on sys.path)
from tokenyard.layers import moe  # noqa: E402

HIDDEN, INTERMEDIATE, NUM_EXPERTS, NUM_TOPK, TOKENS_PER_RANK = 64, 128, 8, 2, 64


def train(rank: int, num_ranks: int, device: torch.device, steps: int, backend: str) -> None:
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32

    # The dense model's weights, the same on every rank; each rank then keeps experts r*L .. r*L+L-1.
    generator = torch.Generator().manual_seed(0)
    gate_up_proj = torch.randn(NUM_EXPERTS, 2 * INTERMEDIATE, HIDDEN, generator=generator) * HIDDEN ** -0.5
    down_proj = torch.randn(NUM_EXPERTS, HIDDEN, INTERMEDIATE, generator=generator) * INTERMEDIATE ** -0.5
    router = moe.TopKRouter(HIDDEN, NUM_EXPERTS, NUM_TOPK, dtype=dtype, device=device)
    with torch.no_grad():
        router.weight.copy_(torch.randn(NUM_EXPERTS, HIDDEN, generator=generator) * HIDDEN ** -0.5)
    buffer = moe.make_buffer(dist.group.WORLD, HIDDEN, TOKENS_PER_RANK, dtype, backend=backend)
    layer = moe.ExpertParallelMoE.from_dense(buffer, gate_up_proj.to(device, dtype), down_proj.to(device, dtype),
                                             router=router)
    optimizer = torch.optim.Adam(layer.parameters(), lr=1e-2)
    teacher = torch.randn(HIDDEN, HIDDEN, generator=generator).to(device, dtype) * HIDDEN ** -0.5

    # Each rank its own tokens; one fixed batch, so the loss must fall step after step.
    x = torch.randn(TOKENS_PER_RANK, HIDDEN, generator=torch.Generator().manual_seed(1 + rank)).to(device, dtype)
    target = torch.tanh(x @ teacher)
    for step in range(steps):
        loss = F.mse_loss(layer(x).float(), target.float())  # this rank's mean; the global loss is the mean over ranks
        loss.backward()
        for p in layer.gate.parameters():  # replicated: average over ranks
            dist.all_reduce(p.grad)
            p.grad /= num_ranks
        for p in layer.experts.parameters():  # already summed over every rank's loss: scale to the mean
            if p.grad is not None:
                p.grad /= num_ranks
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        global_loss = loss.detach().clone()
        dist.all_reduce(global_loss)
        if rank == 0:
            print(f"step {step}: loss {global_loss.item() / num_ranks:.5f}", flush=True)
    if rank == 0:
        print(f"{num_ranks} ranks on {device.type} ({buffer.backend} backend), experts per rank "
              f"{layer.experts.num_local_experts}, {dtype}")
    buffer.destroy()  # _common leaves the group once this has returned


def main() -> None:
    _common.spawn(train, _common.parse_args(__doc__.split("\n")[0], NUM_EXPERTS, steps=8))


if __name__ == "__main__":
    main()
