"""DeepEP's ``deep_ep.utils`` names (Megatron and torchtitan import `EventOverlap` from here)."""

import socket

import torch
import torch.distributed as dist

from ...errors import BackendUnavailableError
from ...event import EventHandle, EventOverlap

__all__ = ["EventHandle", "EventOverlap", "check_nvlink_connections"]


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
