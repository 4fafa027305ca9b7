"""DeepEP's ``deep_ep.utils.envs``: the communication domain sizes and the NVLink check. DeepEP's own test and host
helpers there (seeds, `init_dist`, `dist_print`, bandwidth probes) are not offered: asking for one raises an
AttributeError that says so."""

import socket

import torch
import torch.distributed as dist

from ....errors import BackendUnavailableError

__all__ = ["get_physical_domain_size", "get_logical_domain_size", "check_nvlink_connections"]

# The names of DeepEP main's envs module (the version issue 47 compared against) that tokenyard does not offer.
_NOT_OFFERED = ("init_seed", "get_local_seed", "get_global_seed", "dist_print", "init_dist", "check_torch_deterministic",
                "get_nvlink_gbs", "check_fast_rdma_atomic_support", "get_rdma_gbs")


def get_physical_domain_size(group: dist.ProcessGroup) -> tuple:
    """(RDMA ranks, NVLink ranks) of `group`: one NVLink domain of the whole group."""
    return 1, group.size()


def get_logical_domain_size(group: dist.ProcessGroup, allow_hybrid_mode: bool = True) -> tuple:
    """(scale-out ranks, scale-up ranks) of `group`, as `get_physical_domain_size`."""
    del allow_hybrid_mode
    return 1, group.size()


def check_nvlink_connections(group: dist.ProcessGroup) -> None:
    """DeepEP's check, a call every rank of `group` makes: the GPUs the group's ranks use on each host must
    reach one another as peers (what the CUDA backend maps the buffers over).

    Raises:
        BackendUnavailableError: naming the first pair of GPUs without peer access.
    """
    if not torch.cuda.is_available():
        return
    here = (socket.gethostname(), torch.cuda.current_device())
    gathered = [None] * group.size()
    dist.all_gather_object(gathered, here, group=group)
    devices = sorted({device for host, device in gathered if host == here[0]})
    for a in devices:
        for b in devices:
            if a != b and not torch.cuda.can_device_access_peer(a, b):
                raise BackendUnavailableError(f"GPU {a} cannot access GPU {b} as a peer on {here[0]}: the group's "
                                              "GPUs must be joined by NVLink (or peer-capable links)")


def __getattr__(name: str):
    if name in _NOT_OFFERED:
        raise AttributeError(f"deep_ep.utils.envs.{name} is one of DeepEP's own test and host helpers, which "
                             "tokenyard does not offer")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
