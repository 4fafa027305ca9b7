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

import argparse
import datetime
import os
import socket
import sys

# NVLink multicast stays off (shared machines; tokenyard does not need it). Set before NCCL starts.
for _name, _value in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
                      ("NVSHMEM_DISABLE_NVLS", "1")):
    os.environ.setdefault(_name, _value)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
import torch.nn.functional as F  # noqa: E402

try:
    from tokenyard import moe
except ImportError:  # run from a checkout without `pip install .`
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from tokenyard import moe

HIDDEN, INTERMEDIATE, NUM_EXPERTS, NUM_TOPK, TOKENS_PER_RANK = 64, 128, 8, 2, 64


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(rank: int, num_ranks: int, port: int, use_cuda: bool) -> torch.device:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    timeout = datetime.timedelta(seconds=120)
    if use_cuda:
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
        dist.init_process_group("nccl", rank=rank, world_size=num_ranks, device_id=device, timeout=timeout)
        return device
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=num_ranks, timeout=timeout)
    return torch.device("cpu")


def train(rank: int, num_ranks: int, port: int, use_cuda: bool, steps: int, backend: str) -> None:
    device = _start(rank, num_ranks, port, use_cuda)
    dtype = torch.bfloat16 if use_cuda else torch.float32

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
    buffer.destroy()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    num_gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    parser.add_argument("--ranks", type=int, default=min(num_gpus, 8) if num_gpus >= 2 else 2)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--backend", default="auto", help="tokenyard backend: auto, reference or cuda")
    args = parser.parse_args()
    use_cuda = num_gpus >= 2
    if use_cuda and args.ranks > num_gpus:
        parser.error(f"--ranks {args.ranks} exceeds the {num_gpus} GPUs")
    if NUM_EXPERTS % args.ranks:
        parser.error(f"--ranks must divide the {NUM_EXPERTS} experts")
    mp.spawn(train, args=(args.ranks, _free_port(), use_cuda, args.steps, args.backend), nprocs=args.ranks)


if __name__ == "__main__":
    main()
