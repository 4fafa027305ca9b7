"""Does NVSHMEM, as the pip wheel ships it (nvidia-nvshmem-cu13), carry a kernel we build at run time between
processes that share one GPU under MPS (issue 25's first question)? A probe, not a transport: it writes down
what works, for docs/cuda_backend.md.

The steps, each reported:
1. build, with the library's own pieces (tokenyard/jit/nvshmem.py): the host shim (g++) for the NVSHMEM calls its
   headers make inline or versioned (the UID bootstrap's init, `nvshmemx_hostlib_init_attr`,
   `nvshmemx_cumodule_init`), and a kernel compiled with relocatable device code (nvcc -rdc) then linked with the
   wheel's libnvshmem_device.a (nvlink) into a cubin;
2. on each of `--num_ranks` spawned ranks (a gloo group, ranks spread over the GPUs there are): the unique id
   from rank 0 through the torch group, NVSHMEM initialised from it (no MPI, no nvshmrun), a symmetric buffer;
3. the cubin loaded through the driver and registered (`nvshmemx_cumodule_init`), then a ping: PE 0 puts a
   value with a signal into every other PE's buffer, each waits for its signal and reads the value.

    python benchmarks/nvshmem_probe.py [--num_ranks 2] [--json out.json]

Environment it sets unless given: NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME=lo (the bootstrap's sockets on loopback),
NVSHMEM_IGNORE_CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=1 (several PEs on a GPU under MPS without percentages),
NVSHMEM_DISABLE_NVLS=1 (NVLink multicast stays off), NVSHMEM_SYMMETRIC_SIZE=64M.
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the checkout's tokenyard

ENV = {"NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME": "lo", "NVSHMEM_IGNORE_CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "1",
       "NVSHMEM_DISABLE_NVLS": "1", "NVSHMEM_SYMMETRIC_SIZE": "64M"}

KERNEL = r"""
#include <nvshmem.h>
#include <nvshmemx.h>

// PE 0 puts `value` into `data` on every other PE with a signal; each waits for its signal and copies what came
// to `out`.
extern "C" __global__ void probe_ping(int* data, uint64_t* signal, int value, int* out) {
    if (threadIdx.x != 0 || blockIdx.x != 0)
        return;
    if (nvshmem_my_pe() == 0) {
        for (int pe = 1; pe < nvshmem_n_pes(); ++pe)
            nvshmem_int_put_signal(data, &value, 1, signal, 1, NVSHMEM_SIGNAL_SET, pe);
        nvshmem_quiet();
        *out = -1;
    } else {
        nvshmem_signal_wait_until(signal, NVSHMEM_CMP_EQ, 1);
        *out = *reinterpret_cast<volatile int*>(data);
    }
}
"""


def build(folder: str, arch: str) -> dict:
    """-> {"shim": path, "cubin": path, "seconds": {...}} with the library's own pieces (NOTE [NVSHMEM units],
    NOTE [NVSHMEM host shim] in tokenyard/jit/nvshmem.py); raises CompileError with the compiler's words."""
    from tokenyard.jit import nvshmem

    seconds = {}
    start = time.time()
    shim = nvshmem.shim_path(folder)
    seconds["shim"] = round(time.time() - start, 2)
    start = time.time()
    cubin = nvshmem.linker().compile(KERNEL, arch, [])
    seconds["kernel"] = round(time.time() - start, 2)
    path = os.path.join(folder, "ping.cubin")
    with open(path, "wb") as f:
        f.write(cubin)
    return {"shim": shim, "cubin": path, "seconds": seconds, "cubin_bytes": len(cubin)}


def rank_main(built: dict) -> dict:
    import torch
    import torch.distributed as dist

    from tokenyard.jit.driver import check, libcuda

    rank, num_ranks = dist.get_rank(), dist.get_world_size()
    report = {"rank": rank}
    shim = ctypes.CDLL(built["shim"])
    shim.tokenyard_nvshmem_calloc.restype = ctypes.c_void_p
    shim.tokenyard_nvshmem_calloc.argtypes = [ctypes.c_size_t]
    uid = ctypes.create_string_buffer(shim.tokenyard_nvshmem_uid_bytes())
    if rank == 0:
        assert shim.tokenyard_nvshmem_uid(uid) == 0, "nvshmemx_get_uniqueid failed"
    uids = [uid.raw if rank == 0 else None]
    dist.broadcast_object_list(uids, src=0)
    start = time.time()
    status = shim.tokenyard_nvshmem_init(rank, num_ranks, ctypes.create_string_buffer(uids[0], len(uids[0])))
    report["init"] = {"status": status, "seconds": round(time.time() - start, 2)}
    assert status == 0, f"nvshmemx_hostlib_init_attr returned {status}"
    report["pe"] = (shim.tokenyard_nvshmem_my_pe(), shim.tokenyard_nvshmem_n_pes())
    data = shim.tokenyard_nvshmem_calloc(64)
    report["symmetric"] = data is not None
    lib = libcuda()
    module = ctypes.c_void_p()
    with open(built["cubin"], "rb") as f:
        image = f.read()
    check(lib.cuModuleLoadData(ctypes.byref(module), image), "cuModuleLoadData")
    report["cumodule_init"] = shim.tokenyard_nvshmem_cumodule_init(module)
    assert report["cumodule_init"] == 0, "nvshmemx_cumodule_init failed"
    function = ctypes.c_void_p()
    check(lib.cuModuleGetFunction(ctypes.byref(function), module, b"probe_ping"), "cuModuleGetFunction")
    out = torch.full((1,), -7, dtype=torch.int32, device="cuda")
    shim.tokenyard_nvshmem_barrier_all()
    args = [ctypes.c_void_p(data), ctypes.c_void_p(data + 16), ctypes.c_int(1234), ctypes.c_void_p(out.data_ptr())]
    params = (ctypes.c_void_p * len(args))(*[ctypes.cast(ctypes.pointer(a), ctypes.c_void_p) for a in args])
    stream = torch.cuda.current_stream().cuda_stream
    start = time.time()
    check(lib.cuLaunchKernel(function, 1, 1, 1, 32, 1, 1, 0, ctypes.c_void_p(stream), params, None), "cuLaunchKernel")
    torch.cuda.synchronize()
    report["ping"] = {"seen": int(out.item()), "expected": 1234 if rank > 0 else -1,
                      "seconds": round(time.time() - start, 3)}
    shim.tokenyard_nvshmem_barrier_all()
    shim.tokenyard_nvshmem_free(ctypes.c_void_p(data))
    shim.tokenyard_nvshmem_finalize()
    return report


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num_ranks", type=int, default=2)
    parser.add_argument("--arch", default="sm_90")
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    for name, value in ENV.items():
        os.environ.setdefault(name, value)

    from tokenyard.tools.bench.report import git_commit
    from tokenyard.tools.launch import run_on_ranks

    now = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    result = {"commit": git_commit(), "date": now, "settings": dict(vars(args), env={k: os.environ[k] for k in ENV})}
    try:
        from importlib.metadata import version

        result["nvshmem"] = version("nvidia-nvshmem-cu13")
    except Exception as exc:  # noqa: BLE001 - the probe's answer
        result["nvshmem"] = f"not installed: {exc}"
    with tempfile.TemporaryDirectory() as folder:
        try:
            built = build(folder, args.arch)
            result["build"] = {k: built[k] for k in ("seconds", "cubin_bytes")}
            print(f"build: {result['build']}", flush=True)
            result["ranks"] = run_on_ranks(args.num_ranks, rank_main, built, use_cuda=True, timeout_s=120.0)
        except Exception as exc:  # noqa: BLE001 - the probe's answer
            result["error"] = f"{type(exc).__name__}: {str(exc)[-3000:]}"
    print(json.dumps({k: v for k, v in result.items() if k != "settings"}, indent=1), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    ok = "error" not in result and all(r["ping"]["seen"] == r["ping"]["expected"] for r in result.get("ranks", []))
    print("NVSHMEM ping between ranks sharing a GPU:", "works" if ok else "failed")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
