"""Bind each rank to the CPU cores, memory and RDMA NIC nearest its GPU (NUMA/CPU/NIC affinity).

Naive equivalent, on a two-socket machine with 8 GPUs and cores 0-47 / 48-95 (GPUs 0-3 on socket 0)::

    os.sched_setaffinity(0, range(12 * local_rank, 12 * local_rank + 12))  # 12 cores of the GPU's socket
    libnuma.numa_set_preferred(local_rank // 4)                             # allocate on that socket
    os.environ["NVSHMEM_HCA_LIST"] = f"mlx5_{local_rank}:1"                 # the NIC under the GPU's switch

What a user gets from ``bind(local_rank, local_world_size)``, called once per process before it starts
working (before ``init_process_group`` is best, so communication threads inherit the cores):

- the process runs on its share of the cores of its GPU's NUMA node: the node's cores are split evenly,
  in order, among the ranks whose GPUs sit on that node (GPU 5 of 0-7 above: cores 60-71);
- memory is allocated on that node first (libnuma's ``numa_set_preferred``, through ctypes);
- NVSHMEM uses the RDMA NIC nearest the GPU: ``NVSHMEM_HCA_LIST=<nic>:1`` and
  ``NVSHMEM_ENABLE_NIC_PE_MAPPING=1`` (a variable the user has already set is left as it is);
- a `Binding` saying what was chosen, what was applied and why anything was not ("one NUMA node",
  "no RDMA NICs", "libnuma not present", ...). Nothing fails for want of topology: a step that cannot
  apply is skipped and named.

Where the facts come from (all under `root`, "/" unless a test points it at a fake tree; nothing is read
at import time and nvidia-smi is never run):

- GPUs, in CUDA device order: ``torch.cuda`` device properties (PCI domain/bus/device) on a live machine;
  else the PCI addresses in ``/proc/driver/nvidia/gpus/``, ``/sys/bus/pci/drivers/nvidia/``, or NVIDIA
  display/3D controllers in ``/sys/bus/pci/devices/``, sorted by address (CUDA's order under
  ``CUDA_DEVICE_ORDER=PCI_BUS_ID``) and filtered by a numeric ``CUDA_VISIBLE_DEVICES``;
- a device's NUMA node: ``/sys/bus/pci/devices/<bdf>/numa_node`` (-1, unknown, counts as the only node
  of a one-node machine);
- a node's cores: ``/sys/devices/system/node/node<N>/cpulist``, less those outside the container's cpuset
  (``/sys/fs/cgroup/cpuset.cpus.effective``, or cgroup v1's ``/sys/fs/cgroup/cpuset/cpuset.effective_cpus``);
- RDMA NICs: ``/sys/class/infiniband/<dev>/device``, a link to the NIC's PCI device.

NOTE [nearest NIC]
A NIC is nearer a GPU when it is on the GPU's NUMA node and, among those, when the resolved sysfs paths
of the two devices share more PCI components (root complex, root port, switch ports): a GPU and a NIC
under one PCIe switch share the switch's upstream port, so their traffic never crosses the CPU. Example:
GPU ``.../pci0000:00/0000:00:01.0/0000:10:00.0/0000:11:00.0/0000:12:00.0`` and NIC
``.../pci0000:00/0000:00:01.0/0000:10:00.0/0000:11:01.0/0000:13:00.0`` share 3 components; a NIC
under another root port of ``pci0000:00`` shares 1. Ties (several NICs equally near) are spread over the
GPUs in order: the k-th GPU of a node takes the (k mod n)-th of its n nearest NICs.
"""

from __future__ import annotations

import dataclasses
import os
import re
from typing import Dict, List, Optional, Sequence, Tuple

NVIDIA_VENDOR_ID = "0x10de"
GPU_CLASS_PREFIXES = ("0x0300", "0x0302")  # VGA-compatible and 3D controllers
_BDF = re.compile(r"^[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]$")
_PCI_ROOT = re.compile(r"^pci[0-9a-f]{4}:[0-9a-f]{2}$")


@dataclasses.dataclass(frozen=True)
class PciDevice:
    """A GPU or NIC: its name (NIC) or CUDA index (GPU), PCI address, NUMA node and sysfs PCI path."""

    name: str
    bus_id: str
    numa_node: Optional[int]
    pci_path: Tuple[str, ...]  # PCI components of the resolved sysfs path, the device itself last


@dataclasses.dataclass(frozen=True)
class Topology:
    """What `discover` found: GPUs in CUDA order, RDMA NICs, and each NUMA node's cores."""

    gpus: Tuple[PciDevice, ...]
    nics: Tuple[PciDevice, ...]
    node_cores: Dict[int, Tuple[int, ...]]

    def node_of(self, device: PciDevice) -> Optional[int]:
        """The device's NUMA node; an unknown node (-1) on a one-node machine is that node."""
        if device.numa_node in self.node_cores:
            return device.numa_node
        return next(iter(self.node_cores)) if len(self.node_cores) == 1 else None

    def nearest_nics(self, gpu: PciDevice) -> List[PciDevice]:
        """The NICs nearest `gpu` (NOTE [nearest NIC]), in name order; empty without NICs."""
        if not self.nics:
            return []
        node = self.node_of(gpu)

        def score(nic: PciDevice) -> Tuple[bool, int]:
            shared = 0
            for a, b in zip(gpu.pci_path[:-1], nic.pci_path[:-1]):
                if a != b:
                    break
                shared += 1
            return node is not None and self.node_of(nic) == node, shared

        best = max(score(nic) for nic in self.nics)
        return sorted((nic for nic in self.nics if score(nic) == best), key=lambda nic: nic.name)


@dataclasses.dataclass
class Binding:
    """What `bind` chose for one rank and what it applied.

    ``applied`` names the steps taken ("cpu affinity", "memory policy", "NVSHMEM NIC mapping");
    ``not_applied`` says why any step was skipped ("one NUMA node", "no RDMA NICs", "libnuma not present",
    "apply=False", ...).
    """

    local_rank: int
    local_world_size: int
    gpu_bus_id: Optional[str]
    numa_node: Optional[int]
    cores: Tuple[int, ...]
    nic: Optional[str]
    env: Dict[str, str]
    applied: Tuple[str, ...] = ()
    not_applied: Tuple[str, ...] = ()

    def as_dict(self) -> dict:
        """A JSON-ready copy (the benchmark records it under ``affinity``)."""
        out = dataclasses.asdict(self)
        out["cores"] = list(self.cores)
        out["cpulist"] = format_cpulist(self.cores)
        out["applied"], out["not_applied"] = list(self.applied), list(self.not_applied)
        return out


# -- reading sysfs -------------------------------------------------------------------------------------


def parse_cpulist(text: str) -> Tuple[int, ...]:
    """``"0-3,8,10-11"`` -> ``(0, 1, 2, 3, 8, 10, 11)``; the kernel's cpulist format."""
    cores = []
    for part in text.strip().split(","):
        part = part.strip()
        if not part:
            continue
        first, _, last = part.partition("-")
        cores.extend(range(int(first), int(last or first) + 1))
    return tuple(sorted(set(cores)))


def format_cpulist(cores: Sequence[int]) -> str:
    """``(0, 1, 2, 3, 8)`` -> ``"0-3,8"``."""
    ranges, cores = [], sorted(cores)
    for core in cores:
        if ranges and core == ranges[-1][1] + 1:
            ranges[-1][1] = core
        else:
            ranges.append([core, core])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in ranges)


def _path(root: str, *parts: str) -> str:
    return os.path.join(root, *parts)


def _read(path: str) -> Optional[str]:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def _numa_node(device_dir: str) -> Optional[int]:
    text = _read(os.path.join(device_dir, "numa_node"))
    try:
        return int(text) if text is not None else None
    except ValueError:
        return None


def _pci_components(device_dir: str) -> Tuple[str, ...]:
    """The PCI root and addresses along the resolved sysfs path (``pci0000:00``, ``0000:00:01.0``, ...)."""
    parts = os.path.realpath(device_dir).split(os.sep)
    return tuple(p for p in parts if _BDF.match(p) or _PCI_ROOT.match(p))


def normalize_bus_id(bus_id: str) -> str:
    """``"00000000:18:00.0"`` (CUDA's spelling) or ``"18:00.0"`` -> ``"0000:18:00.0"`` (sysfs's)."""
    text = bus_id.strip().lower()
    if text.count(":") == 1:
        text = "0000:" + text
    domain, rest = text.split(":", 1)
    return f"{int(domain, 16):04x}:{rest}"


def _as_bus_id(name: str) -> Optional[str]:
    """`normalize_bus_id`, or None where `name` is not a PCI address."""
    try:
        bus_id = normalize_bus_id(name)
    except ValueError:
        return None
    return bus_id if _BDF.match(bus_id) else None


def _pci_device(root: str, name: str, bus_id: str) -> PciDevice:
    device_dir = _path(root, "sys", "bus", "pci", "devices", bus_id)
    return PciDevice(name, bus_id, _numa_node(device_dir), _pci_components(device_dir) or (bus_id,))


def _torch_gpu_bus_ids() -> Optional[List[str]]:
    """PCI addresses of this process's CUDA devices, in CUDA order, or None without CUDA."""
    import torch

    if not torch.cuda.is_available():
        return None
    ids = []
    for index in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(index)
        if not hasattr(props, "pci_bus_id"):
            return None
        ids.append(f"{getattr(props, 'pci_domain_id', 0):04x}:{props.pci_bus_id:02x}:"
                   f"{getattr(props, 'pci_device_id', 0):02x}.0")
    return ids


def _sysfs_gpu_bus_ids(root: str) -> List[str]:
    """NVIDIA GPUs' PCI addresses from the driver's folders, else from PCI vendor and class, sorted."""
    for folder in (_path(root, "proc", "driver", "nvidia", "gpus"), _path(root, "sys", "bus", "pci", "drivers",
                                                                          "nvidia")):
        try:
            names = os.listdir(folder)
        except OSError:
            continue
        found = sorted(b for b in map(_as_bus_id, names) if b)  # the driver folder also holds "bind", ...
        if found:
            return found
    devices = _path(root, "sys", "bus", "pci", "devices")
    try:
        names = sorted(os.listdir(devices))
    except OSError:
        return []
    return [n for n in names if _read(os.path.join(devices, n, "vendor")) == NVIDIA_VENDOR_ID
            and (_read(os.path.join(devices, n, "class")) or "").startswith(GPU_CLASS_PREFIXES)]


def _visible(bus_ids: List[str], visible_devices: Optional[str]) -> List[str]:
    """Apply a numeric ``CUDA_VISIBLE_DEVICES`` ("2,3"); UUIDs and MIG names are left unapplied."""
    if not visible_devices:
        return bus_ids
    try:
        indices = [int(part) for part in visible_devices.split(",") if part.strip()]
    except ValueError:
        return bus_ids
    return [bus_ids[i] for i in indices if 0 <= i < len(bus_ids)]


def _node_cores(root: str) -> Dict[int, Tuple[int, ...]]:
    """Each NUMA node's cores; one node of every online core where the kernel lists no nodes."""
    nodes = {}
    folder = _path(root, "sys", "devices", "system", "node")
    try:
        names = os.listdir(folder)
    except OSError:
        names = []
    for name in names:
        match = re.fullmatch(r"node(\d+)", name)
        text = _read(os.path.join(folder, name, "cpulist")) if match else None
        if text:
            nodes[int(match.group(1))] = parse_cpulist(text)
    if not nodes:
        online = _read(_path(root, "sys", "devices", "system", "cpu", "online"))
        if online:
            nodes[0] = parse_cpulist(online)
        elif root == "/":
            nodes[0] = tuple(range(os.cpu_count() or 1))
    return dict(sorted(nodes.items()))


CPUSET_FILES = (("sys", "fs", "cgroup", "cpuset.cpus.effective"),
                ("sys", "fs", "cgroup", "cpuset", "cpuset.effective_cpus"),
                ("sys", "fs", "cgroup", "cpuset", "cpuset.cpus"))


def _cpuset(root: str) -> Optional[Tuple[int, ...]]:
    """The cores the container may use (its cgroup cpuset), or None where no cpuset is published.

    Read from the cgroup rather than ``os.sched_getaffinity``, which a previous binding has narrowed.
    """
    for parts in CPUSET_FILES:
        text = _read(_path(root, *parts))
        if text:
            return parse_cpulist(text)
    return None


def _trim(nodes: Dict[int, Tuple[int, ...]], allowed: Optional[Tuple[int, ...]]) -> Dict[int, Tuple[int, ...]]:
    """Each node's cores within `allowed`; a node left with none keeps its own (the kernel will say no)."""
    if not allowed:
        return nodes
    allowed_set = set(allowed)
    return {node: tuple(c for c in cores if c in allowed_set) or cores for node, cores in nodes.items()}


def _nics(root: str) -> List[PciDevice]:
    folder = _path(root, "sys", "class", "infiniband")
    try:
        names = sorted(os.listdir(folder))
    except OSError:
        return []
    nics = []
    for name in names:
        device_dir = os.path.join(folder, name, "device")
        if not os.path.exists(device_dir):
            continue
        bus_id = os.path.basename(os.path.realpath(device_dir))
        nics.append(PciDevice(name, bus_id, _numa_node(device_dir), _pci_components(device_dir) or (bus_id,)))
    return nics


def discover(root: str = "/", gpu_bus_ids: Optional[Sequence[str]] = None) -> Topology:
    """Read the machine's GPUs, RDMA NICs and NUMA nodes from sysfs under `root`.

    Arguments:
        root: the file-system root to read ("/"; tests pass a fake tree). Off "/", torch.cuda and
            ``CUDA_VISIBLE_DEVICES`` are not consulted, since they describe this machine, not the tree.
        gpu_bus_ids: the GPUs' PCI addresses in CUDA order, where the caller knows them.
    Returns:
        a `Topology`; empty parts where the machine has no GPUs, NICs or NUMA information.
    """
    if gpu_bus_ids is None and root == "/":
        gpu_bus_ids = _torch_gpu_bus_ids()
    if gpu_bus_ids is None:
        gpu_bus_ids = _visible(_sysfs_gpu_bus_ids(root),
                               os.environ.get("CUDA_VISIBLE_DEVICES") if root == "/" else None)
    gpus = tuple(_pci_device(root, str(i), normalize_bus_id(b)) for i, b in enumerate(gpu_bus_ids))
    return Topology(gpus, tuple(_nics(root)), _trim(_node_cores(root), _cpuset(root)))


# -- choosing and applying -------------------------------------------------------------------------------


def _share(cores: Sequence[int], position: int, num_sharers: int) -> Tuple[int, ...]:
    """The `position`-th of `num_sharers` even, contiguous shares of `cores`.

    The first ``len(cores) % num_sharers`` shares get one core more (50 cores, 4 ranks: 13, 13, 12, 12);
    with fewer cores than sharers each takes one core, round robin.
    """
    if not cores:
        return ()
    if num_sharers > len(cores):
        return (cores[position % len(cores)],)
    base, extra = divmod(len(cores), num_sharers)
    start = position * base + min(position, extra)
    return tuple(cores[start:start + base + (position < extra)])


def plan(topology: Topology, local_rank: int, local_world_size: int) -> Binding:
    """Choose node, cores and NIC for `local_rank` of `local_world_size` ranks (applies nothing).

    Rank i drives GPU i. Without a GPU for every rank (CPU ranks), ranks are spread evenly over the
    NUMA nodes in order (4 ranks, 2 nodes: 0, 0, 1, 1) and take a NIC of their node.
    """
    if not 0 <= local_rank < local_world_size:
        raise ValueError(f"local_rank {local_rank} is outside [0, {local_world_size})")
    notes = []
    nodes = list(topology.node_cores)
    if local_world_size <= len(topology.gpus):
        gpus = topology.gpus[:local_world_size]
        rank_nodes = [topology.node_of(gpu) for gpu in gpus]
        gpu = gpus[local_rank]
    else:
        if topology.gpus:
            notes.append(f"{local_world_size} ranks but {len(topology.gpus)} GPUs: ranks spread over NUMA nodes")
        rank_nodes = [nodes[r * len(nodes) // local_world_size] if nodes else None for r in range(local_world_size)]
        gpu = None
    node = rank_nodes[local_rank]
    sharers = [r for r, n in enumerate(rank_nodes) if n == node]
    position = sharers.index(local_rank)
    if node is not None:
        pool = topology.node_cores[node]
    else:
        notes.append("the GPU's NUMA node is unknown: sharing every core")
        pool = tuple(sorted({c for cores in topology.node_cores.values() for c in cores}))
    cores = _share(pool, position, len(sharers))

    nic = None
    if gpu is not None:
        nearest = topology.nearest_nics(gpu)
    else:
        nearest = sorted((n for n in topology.nics if node is not None and topology.node_of(n) == node),
                         key=lambda n: n.name) or sorted(topology.nics, key=lambda n: n.name)
    if nearest:
        nic = nearest[position % len(nearest)].name
    env = {"NVSHMEM_HCA_LIST": f"{nic}:1", "NVSHMEM_ENABLE_NIC_PE_MAPPING": "1"} if nic else {}
    return Binding(local_rank, local_world_size, gpu.bus_id if gpu else None, node, cores, nic, env,
                   not_applied=tuple(notes))


def _load_libnuma():
    """libnuma through ctypes, or None where it is not installed."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("numa")
    for candidate in ([name] if name else []) + ["libnuma.so.1", "libnuma.so"]:
        try:
            lib = ctypes.CDLL(candidate)
        except OSError:
            continue
        lib.numa_available.restype = ctypes.c_int
        lib.numa_set_preferred.argtypes = [ctypes.c_int]
        lib.numa_set_preferred.restype = None
        return lib
    return None


def _apply(binding: Binding, topology: Topology) -> Tuple[List[str], List[str]]:
    applied, skipped = [], []
    if binding.cores:
        try:
            os.sched_setaffinity(0, binding.cores)
            applied.append("cpu affinity")
        except (OSError, AttributeError) as exc:
            skipped.append(f"cpu affinity: {exc}")
    else:
        skipped.append("no CPU list in sysfs")

    if len(topology.node_cores) <= 1:
        skipped.append("one NUMA node")
    elif binding.numa_node is None:
        skipped.append("memory policy: the NUMA node is unknown")
    else:
        libnuma = _load_libnuma()
        if libnuma is None:
            skipped.append("libnuma not present")
        elif libnuma.numa_available() == -1:
            skipped.append("libnuma: NUMA not available in this kernel")
        else:
            libnuma.numa_set_preferred(binding.numa_node)
            applied.append("memory policy")

    if not binding.env:
        skipped.append("no RDMA NICs")
    else:
        kept = [name for name, value in binding.env.items() if os.environ.get(name, value) != value]
        for name in kept:
            skipped.append(f"{name} already set to {os.environ[name]!r}: left as is")
        for name, value in binding.env.items():
            os.environ.setdefault(name, value)
        if len(kept) < len(binding.env):
            applied.append("NVSHMEM NIC mapping")
    return applied, skipped


def bind(local_rank: int, local_world_size: int, *, root: str = "/", apply: bool = True,
         gpu_bus_ids: Optional[Sequence[str]] = None) -> Binding:
    """Bind this process to the cores, memory node and NIC of its GPU (see the module docstring).

    Naive equivalent: ``os.sched_setaffinity(0, my_share_of(node_of(gpu[local_rank]).cores))``, then
    ``numa_set_preferred(node)`` and ``NVSHMEM_HCA_LIST=<nearest nic>:1``.

    Arguments:
        local_rank: this process's rank on the machine; it drives CUDA device `local_rank`.
        local_world_size: ranks on the machine.
        root: file-system root of sysfs and procfs ("/"; tests pass a fake tree).
        apply: False to choose only (nothing changes; the `Binding` says what would be done).
        gpu_bus_ids: the GPUs' PCI addresses in CUDA order, where the caller knows them better.
    Returns:
        a `Binding`: GPU, node, cores, NIC, the NVSHMEM variables, what was applied and why not.
    Raises:
        ValueError: `local_rank` outside ``[0, local_world_size)``.
    """
    topology = discover(root, gpu_bus_ids)
    binding = plan(topology, local_rank, local_world_size)
    if not apply:
        skipped = ["apply=False"] + ([] if binding.cores else ["no CPU list in sysfs"])
        skipped += (["one NUMA node"] if len(topology.node_cores) <= 1 else []) + ([] if binding.env else
                                                                                  ["no RDMA NICs"])
        binding.not_applied = binding.not_applied + tuple(skipped)
        return binding
    applied, skipped = _apply(binding, topology)  # a cpuset may trim the cores: os.sched_getaffinity(0)
    binding.applied = tuple(applied)
    binding.not_applied = binding.not_applied + tuple(skipped)
    return binding
