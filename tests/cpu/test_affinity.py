"""NUMA/CPU/NIC affinity against fake sysfs trees, and the benchmark's --bind on gloo ranks."""

import json
import os
import pathlib

import pytest

from tokenyard.tools import affinity

from .test_bench import _run_bench

NVSHMEM_VARIABLES = ("NVSHMEM_HCA_LIST", "NVSHMEM_ENABLE_NIC_PE_MAPPING")


def _write(path: pathlib.Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text + "\n")


def _link(link: pathlib.Path, target: pathlib.Path) -> None:
    """A relative link, as sysfs has, so that resolving it stays inside the fake tree."""
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(os.path.relpath(target, link.parent))


def _pci_device(root: pathlib.Path, pci_path, numa_node: int, vendor: str, pci_class: str) -> pathlib.Path:
    """A PCI device at /sys/devices/<pci_path...>, linked from /sys/bus/pci/devices/<bdf>."""
    folder = root.joinpath("sys", "devices", *pci_path)
    _write(folder / "numa_node", str(numa_node))
    _write(folder / "vendor", vendor)
    _write(folder / "class", pci_class)
    _link(root / "sys" / "bus" / "pci" / "devices" / pci_path[-1], folder)
    return folder


def _nodes(root: pathlib.Path, cpulists) -> None:
    for node, cpulist in enumerate(cpulists):
        _write(root / "sys" / "devices" / "system" / "node" / f"node{node}" / "cpulist", cpulist)
    _write(root / "sys" / "devices" / "system" / "node" / "online", f"0-{len(cpulists) - 1}")


def _gpu(root, pci_path, numa_node):
    return _pci_device(root, pci_path, numa_node, "0x10de", "0x030200")


def _nic(root, name, pci_path, numa_node):
    folder = _pci_device(root, pci_path, numa_node, "0x15b3", "0x020700")
    _link(root / "sys" / "class" / "infiniband" / name / "device", folder)


def two_socket_machine(root: pathlib.Path, nic_names=None) -> pathlib.Path:
    """Two sockets (cores 0-47, 48-95); GPU i and NIC i under PCIe switch i; 0-3 on node 0, 4-7 on node 1.

    GPU i: pci0000:HH / root port / switch upstream port / downstream port 0 / GPU; NIC i: the same
    switch's downstream port 1. The driver lists the GPUs in /proc/driver/nvidia/gpus.
    """
    nic_names = nic_names or [f"mlx5_{i}" for i in range(8)]
    _nodes(root, ["0-47", "48-95"])
    for i in range(8):
        node, slot = divmod(i, 4)
        host = 0x80 * node
        bus = host + 0x10 * (slot + 1)
        upstream = ["pci0000:%02x" % host, "0000:%02x:%02x.0" % (host, slot + 1), "0000:%02x:00.0" % bus]
        gpu_bdf, nic_bdf = "0000:%02x:00.0" % (bus + 2), "0000:%02x:00.0" % (bus + 3)
        _gpu(root, upstream + ["0000:%02x:00.0" % (bus + 1), gpu_bdf], node)
        _nic(root, nic_names[i], upstream + ["0000:%02x:01.0" % (bus + 1), nic_bdf], node)
        (root / "proc" / "driver" / "nvidia" / "gpus" / gpu_bdf).mkdir(parents=True)
    return root


def one_node_machine(root: pathlib.Path) -> pathlib.Path:
    """One NUMA node of 16 cores, 2 GPUs found by PCI vendor/class only, no RDMA NICs."""
    _nodes(root, ["0-15"])
    _gpu(root, ["pci0000:00", "0000:00:01.0", "0000:01:00.0"], -1)  # -1: the kernel does not know
    _gpu(root, ["pci0000:00", "0000:00:02.0", "0000:02:00.0"], -1)
    _pci_device(root, ["pci0000:00", "0000:00:1f.0"], -1, "0x8086", "0x060100")  # not a GPU
    return root


@pytest.fixture
def nvshmem_env():
    """Remove the NVSHMEM variables for the test and put back what was there."""
    saved = {name: os.environ.pop(name, None) for name in NVSHMEM_VARIABLES}
    yield
    for name, value in saved.items():
        os.environ.pop(name, None)
        if value is not None:
            os.environ[name] = value


class FakeLibnuma:
    def __init__(self):
        self.preferred = []

    def numa_available(self):
        return 0

    def numa_set_preferred(self, node):
        self.preferred.append(node)


def test_cpulists_parse_and_format_as_the_kernel_writes_them():
    assert affinity.parse_cpulist("0-3,8,10-11\n") == (0, 1, 2, 3, 8, 10, 11)
    assert affinity.format_cpulist((48, 49, 50, 60, 0)) == "0,48-50,60"
    assert affinity.normalize_bus_id("00000000:1A:00.0") == "0000:1a:00.0"
    assert affinity.normalize_bus_id("18:00.0") == "0000:18:00.0"


def test_two_socket_machine_gives_each_gpu_its_nodes_twelve_cores_and_the_nic_under_its_switch(tmp_path):
    root = str(two_socket_machine(tmp_path))
    bindings = [affinity.bind(rank, 8, root=root, apply=False) for rank in range(8)]
    gpu5 = bindings[5]
    assert (gpu5.numa_node, gpu5.cores, gpu5.nic) == (1, tuple(range(60, 72)), "mlx5_5")
    assert gpu5.gpu_bus_id == "0000:a2:00.0"
    assert gpu5.env == {"NVSHMEM_HCA_LIST": "mlx5_5:1", "NVSHMEM_ENABLE_NIC_PE_MAPPING": "1"}
    assert gpu5.applied == () and "apply=False" in gpu5.not_applied
    for rank, b in enumerate(bindings):
        assert b.numa_node == rank // 4 and b.nic == f"mlx5_{rank}"
        assert b.cores == tuple(range(12 * rank, 12 * rank + 12)), f"rank {rank}: {b.cores}"
    assert b.as_dict()["cpulist"] == "84-95"
    json.dumps([b.as_dict() for b in bindings])  # the benchmark records them as JSON


def test_four_ranks_on_an_eight_gpu_machine_share_the_first_socket(tmp_path):
    root = str(two_socket_machine(tmp_path))
    bindings = [affinity.bind(rank, 4, root=root, apply=False) for rank in range(4)]
    assert [b.numa_node for b in bindings] == [0, 0, 0, 0]
    assert [b.cores[0] for b in bindings] == [0, 12, 24, 36] and all(len(b.cores) == 12 for b in bindings)


def test_cores_outside_the_containers_cpuset_are_left_out(tmp_path):
    root = two_socket_machine(tmp_path)
    _write(root / "sys" / "fs" / "cgroup" / "cpuset.cpus.effective", "0-23,48-71")
    bindings = [affinity.bind(rank, 8, root=str(root), apply=False) for rank in range(8)]
    assert bindings[1].cores == tuple(range(6, 12)) and bindings[4].cores == tuple(range(48, 54))


def test_nearest_nic_follows_the_pci_switch_not_the_nic_name(tmp_path):
    names = ["mlx5_3", "mlx5_2", "mlx5_1", "mlx5_0", "mlx5_7", "mlx5_6", "mlx5_5", "mlx5_4"]  # reversed per socket
    root = str(two_socket_machine(tmp_path, nic_names=names))
    assert [affinity.bind(rank, 8, root=root, apply=False).nic for rank in range(8)] == names


def test_apply_binds_cores_prefers_the_node_and_sets_nvshmem_variables(tmp_path, monkeypatch, nvshmem_env):
    root = str(two_socket_machine(tmp_path))
    calls, libnuma = [], FakeLibnuma()
    monkeypatch.setattr(affinity.os, "sched_setaffinity", lambda pid, cores: calls.append((pid, tuple(cores))))
    monkeypatch.setattr(affinity, "_load_libnuma", lambda: libnuma)
    binding = affinity.bind(6, 8, root=root)
    assert calls == [(0, tuple(range(72, 84)))]
    assert libnuma.preferred == [1]
    assert os.environ["NVSHMEM_HCA_LIST"] == "mlx5_6:1" and os.environ["NVSHMEM_ENABLE_NIC_PE_MAPPING"] == "1"
    assert binding.applied == ("cpu affinity", "memory policy", "NVSHMEM NIC mapping")
    assert binding.not_applied == ()


def test_a_users_nvshmem_hca_list_is_kept_and_a_missing_libnuma_is_reported(tmp_path, monkeypatch, nvshmem_env):
    root = str(two_socket_machine(tmp_path))
    monkeypatch.setattr(affinity.os, "sched_setaffinity", lambda pid, cores: None)
    monkeypatch.setattr(affinity, "_load_libnuma", lambda: None)
    os.environ["NVSHMEM_HCA_LIST"] = "mlx5_0:1,mlx5_1:1"
    binding = affinity.bind(2, 8, root=root)
    assert os.environ["NVSHMEM_HCA_LIST"] == "mlx5_0:1,mlx5_1:1"
    assert os.environ["NVSHMEM_ENABLE_NIC_PE_MAPPING"] == "1"
    assert "libnuma not present" in binding.not_applied
    assert any(note.startswith("NVSHMEM_HCA_LIST already set") for note in binding.not_applied)
    assert binding.applied == ("cpu affinity", "NVSHMEM NIC mapping")


def test_one_node_machine_without_nics_splits_its_cores_and_says_what_did_not_apply(tmp_path, monkeypatch,
                                                                                    nvshmem_env):
    root = str(one_node_machine(tmp_path))
    topology = affinity.discover(root)
    assert [g.bus_id for g in topology.gpus] == ["0000:01:00.0", "0000:02:00.0"]  # the bridge is not a GPU
    calls = []
    monkeypatch.setattr(affinity.os, "sched_setaffinity", lambda pid, cores: calls.append(tuple(cores)))
    monkeypatch.setattr(affinity, "_load_libnuma", lambda: pytest.fail("one node needs no memory policy"))
    binding = affinity.bind(1, 2, root=root)
    assert (binding.numa_node, binding.cores, binding.nic, binding.env) == (0, tuple(range(8, 16)), None, {})
    assert calls == [tuple(range(8, 16))]
    assert binding.applied == ("cpu affinity",)
    assert "one NUMA node" in binding.not_applied and "no RDMA NICs" in binding.not_applied
    assert "NVSHMEM_HCA_LIST" not in os.environ


def test_cpu_ranks_without_gpus_spread_over_the_nodes(tmp_path):
    root = str(two_socket_machine(tmp_path))
    bindings = [affinity.bind(rank, 4, root=root, apply=False, gpu_bus_ids=[]) for rank in range(4)]
    assert [b.numa_node for b in bindings] == [0, 0, 1, 1]
    assert [(b.cores[0], b.cores[-1]) for b in bindings] == [(0, 23), (24, 47), (48, 71), (72, 95)]
    assert [b.nic for b in bindings] == ["mlx5_0", "mlx5_1", "mlx5_4", "mlx5_5"]
    assert all(b.gpu_bus_id is None for b in bindings)


def test_more_ranks_than_cores_take_one_core_each_round_robin(tmp_path):
    root = str(one_node_machine(tmp_path))
    assert affinity._share(tuple(range(3)), 4, 5) == (1,)
    assert [affinity._share(tuple(range(50)), p, 4)[0] for p in range(4)] == [0, 13, 26, 38]
    with pytest.raises(ValueError, match="outside"):
        affinity.bind(2, 2, root=root, apply=False)


def test_bench_bind_records_each_ranks_binding_in_the_json(tmp_path):
    json_path = tmp_path / "bench.json"
    done = _run_bench("--num_ranks", "2", "--num_tokens", "8", "--hidden_size", "128", "--num_experts", "4",
                      "--num_topk", "2", "--iters", "1", "--warmup", "0", "--mode", "normal", "--bind",
                      "--json", str(json_path), "--quiet")
    assert done.returncode == 0, f"exit {done.returncode}\nstdout:\n{done.stdout}\nstderr:\n{done.stderr}"
    doc = json.loads(json_path.read_text())
    assert doc["settings"]["bind"] is True
    assert [b["local_rank"] for b in doc["affinity"]] == [0, 1]
    for b in doc["affinity"]:
        assert b["local_world_size"] == 2 and b["cores"], b
        assert "cpu affinity" in b["applied"], b
    if len(os.sched_getaffinity(0)) >= 2:
        assert not set(doc["affinity"][0]["cores"]) & set(doc["affinity"][1]["cores"]), "ranks share a core"
