"""Where a Buffer's ranks work: the device rule, ranks that share a GPU, and nodes (real or virtual).

NOTE [device rule]
A Buffer works on the current CUDA device wherever PyTorch sees a GPU, whatever the group's backend (gloo,
NCCL, a subgroup, a group whose ranks share GPUs), as DeepEP does: the group carries the host-side
exchanges, and tensors that must cross it go through `collectives.Collectives`, which moves CUDA tensors
over a group that cannot (NOTE [device collectives]). Without a GPU it works on the CPU. A call whose
tensors are on the CPU, on a Buffer that works on a GPU, runs on the CPU path (the reference backend over
the same group, which must then move CPU tensors: gloo).

NOTE [shared GPUs]
Ranks may share a GPU: every rank of the group says which GPU it works on (its UUID), and each GPU must
serve the same number of ranks (`ranks_per_gpu`). The CUDA backend maps the peers' buffers by CUDA IPC,
which works between processes of one GPU as between GPUs. Its kernels wait for the peers' kernels, so
those must run at the same time, which needs MPS on a shared GPU (NOTE [MPS] in backends/cuda/backend.py).
Every co-located rank's grid must also be resident at once, so a rank's grids fill at most `sm_budget`
SMs: three quarters of the SMs the process sees, divided by the ranks of its GPU. Without an MPS share
(what tokenyard's launchers leave) each rank sees the whole GPU: 4 ranks on a GPU of 132 SMs fill 24
each. An MPS share (CUDA_MPS_ACTIVE_THREAD_PERCENTAGE) only caps what a client may use and reserves
nothing, so clients' kernels may land on the same SMs: grids that fill whole shares, or most of them, are
not all resident, while the shares divided by the ranks are; so the launchers set no share
(benchmarks/results/mps_residency.md). The whole GPU divided by the ranks is not enough either: grids whose
blocks hold a whole SM's registers each can leave one rank's grid waiting for the others' until a timeout,
hence the quarter kept free (benchmarks/results/moe_8_ranks_shared.md).

NOTE [virtual hosts]
Code for groups over several hosts is tested on one: TOKENYARD_VIRTUAL_HOSTS=n makes each block of n consecutive
ranks of a machine a host of its own (its name the machine's plus the block's number), so nodes default to those
blocks and the CUDA backend maps no memory between them by CUDA IPC, as between machines: what crosses them
goes through NVSHMEM or the group's collectives. A GPU is still one GPU (ranks that share it are counted by its
machine and UUID), so the rules for ranks sharing a GPU hold across virtual hosts.

NOTE [virtual nodes]
DeepEP's runtime queries (`get_num_rdma_ranks`, `get_rdma_rank`, `get_root_rdma_rank`) see the group as
nodes of `ranks_per_node` consecutive ranks. By default a node is a host (the whole group, where it runs on
one). `Buffer(..., ranks_per_node=R)` or TOKENYARD_RANKS_PER_NODE splits the ranks of a host into virtual
nodes of R ranks, so that code written for several nodes runs on one machine: 4 ranks as 2 nodes x 2, 8 as
2 x 4 or 4 x 2. A virtual node never spans two hosts. Normal mode sees the nodes too: on several it takes
the reference backend's hierarchical path (NOTE [internode stages] in backends/internode.py, NOTE [internode
normal mode] in backends/__init__.py); low-latency mode, whose meaning does not depend on nodes, still reaches
every rank of a host over NVLink.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import socket
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from .. import env
from ..errors import InvalidInputError


def buffer_device(cuda_available: bool, current_device: int) -> torch.device:
    """NOTE [device rule]: the current CUDA device where there is a GPU, else the CPU; never the group's say."""
    return torch.device("cuda", current_device) if cuda_available else torch.device("cpu")


def default_device() -> torch.device:
    """`buffer_device` for this process."""
    available = torch.cuda.is_available()
    return buffer_device(available, torch.cuda.current_device() if available else 0)


def runs_where_tensors_are(name: str):
    """NOTE [device rule]: a call whose tensor argument `name` (the first) is on the CPU, made on a Buffer that
    works on a GPU, runs on the Buffer's CPU twin: the reference backend over the same group."""
    def wrap(method):
        @functools.wraps(method)
        def call(self, *args, **kwargs):
            if self.device.type == "cuda":
                first = args[0] if args else kwargs.get(name)
                if isinstance(first, (tuple, list)) and first:
                    first = first[0]
                if isinstance(first, torch.Tensor) and first.device.type == "cpu":
                    return getattr(self._cpu_twin(), method.__name__)(*args, **kwargs)
            return method(self, *args, **kwargs)

        return call

    return wrap


@dataclasses.dataclass(frozen=True)
class RankPlace:
    """What one rank tells the others about where it works."""

    host: str
    gpu: str = ""          # the GPU's UUID; "" for a rank on the CPU
    visible_sms: int = 0   # multiprocessors this process sees (fewer under an MPS share)
    mps: bool = False      # MPS serves this process's GPU
    machine: str = ""      # the machine `host` is, where that is a virtual host (NOTE [virtual hosts]); "" = `host`


def this_rank(device: torch.device) -> RankPlace:
    """This process's `RankPlace` on `device`."""
    host = socket.gethostname()
    if device.type != "cuda":
        return RankPlace(host)
    index = device.index if device.index is not None else torch.cuda.current_device()
    props = torch.cuda.get_device_properties(index)
    return RankPlace(host, str(props.uuid), props.multi_processor_count, _mps_serves(index))


def _mps_serves(device_index: int) -> bool:
    """Whether contexts on this GPU are MPS clients (the device attribute; False where it cannot be read)."""
    try:
        from ..backends.cuda import runtime

        return runtime.mps_enabled(device_index)
    except Exception:  # noqa: BLE001 - no libcudart, or a driver without the attribute: not known to be MPS
        return False


def sm_budget(visible_sms: int, ranks_per_gpu: int) -> int:
    """SMs one rank's grids may fill (NOTE [shared GPUs]): all it sees where it has the GPU to itself, else
    three quarters of it, divided by the ranks of its GPU.

    Examples: 132 seen by each of 4 ranks -> 24; 66 seen under a 50% MPS share by each of 2 ranks -> 24.
    """
    if ranks_per_gpu <= 1:
        return max(1, visible_sms)
    return max(1, visible_sms * 3 // 4 // ranks_per_gpu)


@dataclasses.dataclass(frozen=True)
class Topology:
    """Where every rank of a group works (built by `make_topology`, which checks it)."""

    rank: int
    places: Tuple[RankPlace, ...]
    ranks_per_gpu: int
    ranks_per_node: int

    @property
    def num_ranks(self) -> int:
        return len(self.places)

    @property
    def shares_gpu(self) -> bool:
        return self.ranks_per_gpu > 1

    @property
    def sm_budget(self) -> int:
        mine = self.places[self.rank]
        return sm_budget(mine.visible_sms, self.ranks_per_gpu)

    @property
    def num_nodes(self) -> int:
        return self.num_ranks // self.ranks_per_node

    @property
    def num_hosts(self) -> int:
        return len({p.host for p in self.places})

    def same_host(self) -> List[int]:
        """The ranks on this rank's host (virtual hosts apart, NOTE [virtual hosts])."""
        mine = self.places[self.rank].host
        return [r for r, p in enumerate(self.places) if p.host == mine]

    @property
    def node(self) -> int:
        """This rank's node: DeepEP's RDMA rank."""
        return self.rank // self.ranks_per_node

    @property
    def local_rank(self) -> int:
        """This rank within its node: DeepEP's NVLink rank."""
        return self.rank % self.ranks_per_node

    def without_mps(self) -> List[str]:
        """The GPUs of this host that several ranks share but MPS does not serve, each as "GPU <uuid> (ranks ...)"."""
        by_gpu = _ranks_by_gpu(self.places)
        return [f"GPU {gpu} of {host} (ranks {ranks})" for (host, gpu), ranks in by_gpu.items()
                if len(ranks) > 1 and not all(self.places[r].mps for r in ranks)]


def gather_topology(rank: int, all_gather_object: Callable, device: torch.device,
                    ranks_per_node: Optional[int] = None) -> Topology:
    """Every rank's `RankPlace` on `device`, gathered (a collective), checked by `make_topology`."""
    place = this_rank(device)
    per_host = env.settings().virtual_hosts
    if per_host:  # NOTE [virtual hosts]
        place = dataclasses.replace(place, host=f"{place.host}/virtual-host-{rank // per_host}", machine=place.host)
    return make_topology(rank, all_gather_object(place), ranks_per_node)


def _ranks_by_gpu(places: Sequence[RankPlace]) -> Dict[Tuple[str, str], List[int]]:
    """The ranks of each GPU, keyed by (its machine, its UUID): ranks of virtual hosts that share a GPU are
    counted together (NOTE [virtual hosts]); one UUID on two machines is two GPUs."""
    by_gpu: Dict[Tuple[str, str], List[int]] = collections.defaultdict(list)
    for r, p in enumerate(places):
        if p.gpu:
            by_gpu[(p.machine or p.host, p.gpu)].append(r)
    return dict(by_gpu)


def make_topology(rank: int, places: Sequence[RankPlace], ranks_per_node: Optional[int] = None) -> Topology:
    """Check where the ranks work and derive ranks per GPU and per node (NOTE [shared GPUs], [virtual nodes]).

    Raises:
        InvalidInputError: some ranks on a GPU and others on the CPU; GPUs serving different numbers of
            ranks; `ranks_per_node` not dividing the group, or a node of it spanning two hosts.
    """
    places = tuple(places)
    num_ranks = len(places)
    on_gpu = [r for r, p in enumerate(places) if p.gpu]
    if on_gpu and len(on_gpu) != num_ranks:
        on_cpu = [r for r, p in enumerate(places) if not p.gpu]
        raise InvalidInputError(f"ranks {on_cpu} work on the CPU and ranks {on_gpu} on GPUs: a Buffer's ranks "
                                "must all work on GPUs (tokenyard takes the current CUDA device wherever PyTorch "
                                "sees one) or all on the CPU")
    by_gpu = _ranks_by_gpu(places)
    counts = {len(ranks) for ranks in by_gpu.values()}
    if len(counts) > 1:
        detail = "; ".join(f"GPU {gpu} of {host}: ranks {ranks}" for (host, gpu), ranks in by_gpu.items())
        raise InvalidInputError(f"every GPU must serve the same number of ranks, but {detail}")
    ranks_per_gpu = counts.pop() if counts else 1
    if ranks_per_node is None:
        ranks_per_node = _ranks_per_host(places)
    else:
        ranks_per_node = _checked_ranks_per_node(ranks_per_node, places)
    return Topology(rank, places, ranks_per_gpu, ranks_per_node)


def _ranks_per_host(places: Sequence[RankPlace]) -> int:
    """One node per host where each host holds an equal block of consecutive ranks, else the whole group."""
    num_ranks = len(places)
    per_host = collections.Counter(p.host for p in places)
    if len(per_host) == 1:
        return num_ranks
    size = per_host[places[0].host]
    blocks_ok = num_ranks % size == 0 and all(
        len({p.host for p in places[begin:begin + size]}) == 1 for begin in range(0, num_ranks, size))
    return size if blocks_ok else num_ranks


def _checked_ranks_per_node(ranks_per_node, places: Sequence[RankPlace]) -> int:
    num_ranks = len(places)
    if isinstance(ranks_per_node, bool) or not isinstance(ranks_per_node, int) or ranks_per_node < 1 \
            or num_ranks % ranks_per_node:
        raise InvalidInputError(f"ranks_per_node must be a positive int that divides the group's {num_ranks} ranks, "
                                f"got {ranks_per_node!r}")
    for begin in range(0, num_ranks, ranks_per_node):
        hosts = sorted({p.host for p in places[begin:begin + ranks_per_node]})
        if len(hosts) > 1:
            raise InvalidInputError(f"ranks_per_node={ranks_per_node} puts ranks {begin}..{begin + ranks_per_node - 1} "
                                    f"in one node, but they run on the hosts {hosts}: a node never spans two hosts")
    return ranks_per_node


def launch_layout(num_ranks: int, num_gpus: int) -> Tuple[int, int]:
    """How a launcher spreads `num_ranks` over a machine's `num_gpus`: (GPUs used, ranks per GPU), using
    the most GPUs that share the ranks evenly. Examples: 8 ranks on 1 GPU -> (1, 8); 8 on 4 -> (4, 2);
    6 on 4 -> (3, 2); 2 on 8 -> (2, 1)."""
    if num_gpus < 1:
        raise InvalidInputError("no GPU to launch ranks on")
    used = max(g for g in range(1, min(num_ranks, num_gpus) + 1) if num_ranks % g == 0)
    return used, num_ranks // used


def launch_gpu(rank: int, ranks_per_gpu: int) -> int:
    """The GPU a launcher gives `rank`: consecutive ranks share one (ranks 0, 1 on GPU 0 at 2 per GPU)."""
    return rank // ranks_per_gpu
