"""Starting the ranks of a group on one machine: shared by the benchmark, the examples and the GPU tests.

NOTE [NVLink multicast]
On the shared multi-GPU machines NVLink multicast (NVLS) must stay off: a program that creates multicast
objects can take the host's GPUs out of service. tokenyard never needs it, and every launcher sets
NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1 and NVSHMEM_DISABLE_NVLS=1 (unless already set)
before NCCL or anything else starts.
"""

from __future__ import annotations

import datetime
import os
import socket

NO_MULTICAST_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def disable_nvlink_multicast() -> None:
    """See NOTE [NVLink multicast]."""
    for name, value in NO_MULTICAST_ENV.items():
        os.environ.setdefault(name, value)


def free_port() -> int:
    """A TCP port of 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_rank(rank: int, num_ranks: int, port: int, use_cuda: bool, timeout_s: float = 120.0):
    """Join a group of `num_ranks` on 127.0.0.1:`port`: NCCL on GPU `rank` if `use_cuda`, else gloo.

    Returns the rank's device.
    """
    import torch
    import torch.distributed as dist

    disable_nvlink_multicast()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    timeout = datetime.timedelta(seconds=timeout_s)
    if use_cuda:
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
        dist.init_process_group("nccl", rank=rank, world_size=num_ranks, device_id=device, timeout=timeout)
        return device
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=num_ranks, timeout=timeout)
    return torch.device("cpu")
