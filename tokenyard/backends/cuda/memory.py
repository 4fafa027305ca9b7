"""Memory every rank of a host maps: a buffer per rank, shared by CUDA IPC (NOTE [symmetric lifetime]), and the
output arena dispatches place their rows in (NOTE [output arena] in csrc/call_plan.cpp)."""

from __future__ import annotations

import ctypes
from typing import Optional, Sequence

import torch

from ...errors import TokenyardError
from ..base import GroupContext
from . import plans, runtime


class SymmetricBuffer:
    """`num_bytes` of device memory on every rank, each rank's mapped into every process by CUDA IPC.

    NOTE [symmetric lifetime]
    A rank zeroes its memory before its IPC handle leaves the process: cudaMemset runs on the legacy stream,
    behind whatever the process queued before, and a peer may write as soon as it holds the handle. A rank
    frees its memory only once no rank maps it (CUDA leaves a cudaFree before every importer's
    cudaIpcCloseMemHandle undefined): at the Buffer's destroy each rank waits for its own kernels, closes its
    mappings of the peers' memory, meets the others once (`meet`), then frees its own. Every rank that calls
    destroy posts that one meeting, met or not, so the group's collectives stay in step for the next Buffer.
    A meeting that fails (a peer gone, or later than its deadline) releases the memory regardless.
    """

    def __init__(self, ctx: GroupContext, num_bytes: int, peers: Optional[Sequence[int]] = None):
        """`peers`: the ranks whose memory this rank maps (default all; the others' bases are 0: ranks of other
        hosts, whose memory CUDA IPC cannot reach)."""
        self.num_bytes = num_bytes
        self.local = runtime.malloc(max(num_bytes, 16))
        runtime.memset(self.local, 0, max(num_bytes, 16))
        torch.cuda.synchronize(ctx.device)
        handles = ctx.all_gather_object(runtime.ipc_handle(self.local))
        mapped = set(range(ctx.num_ranks) if peers is None else peers)
        self.bases = [self.local if r == ctx.rank else runtime.ipc_open(h) if r in mapped else 0
                      for r, h in enumerate(handles)]
        self.rank = ctx.rank
        self.bases_tensor = torch.tensor(self.bases, dtype=torch.int64, device=ctx.device)
        self.tensor = runtime.byte_view(self.local, num_bytes, ctx.device)

    def unmap_peers(self) -> None:
        for r, base in enumerate(self.bases):
            if r != self.rank and base:
                runtime.ipc_close(base)
        self.bases = [self.local]

    def free(self) -> None:
        runtime.free(self.local)
        self.bases = []


def meet(ctx: GroupContext) -> bool:
    """A bounded barrier of the group (NOTE [symmetric lifetime]); a rank that does not come is not waited for.
    -> whether every rank came."""
    try:
        ctx.collectives.meeting("destroy", "meeting")
    except (TokenyardError, RuntimeError, ValueError):  # ValueError: the group was destroyed first
        return False
    return True


class OutputArena:
    """A dispatch's recv_x comes from here where it fits (NOTE [output arena] in csrc/call_plan.cpp, NOTE [placed
    rows] in kernels/dispatch.cuh): `num_bytes` on every rank, mapped by every other as a SymmetricBuffer is, whose
    blocks the host extension's OutputArena (`native`) hands out as tensors. At the Buffer's destroy the peers'
    mappings close and the ranks meet as for the buffers (`memory`), but the memory is freed by `native` once no
    tensor holds a block of it: a recv_x may outlive its Buffer."""

    def __init__(self, ctx: GroupContext, num_bytes: int):
        self.memory = SymmetricBuffer(ctx, num_bytes)
        cuda_free = ctypes.cast(runtime.libcudart().cudaFree, ctypes.c_void_p).value
        self.native = plans.module().OutputArena(ctx.device, self.memory.local, num_bytes, cuda_free)
