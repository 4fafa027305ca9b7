"""NVSHMEM as the pip wheel ships it (nvidia-nvshmem-cu13, `pip install tokenyard[internode]`): where it is, how a
kernel that calls it compiles, and the host shim through which Python starts it. The engine for what crosses
nodes (issue 25); tokenyard writes no transport of its own.

NOTE [NVSHMEM units]
A kernel that calls NVSHMEM's device API (`KernelSpec.nvshmem`) is compiled by nvcc with relocatable device
code and linked by nvlink with the wheel's static device library (lib/libnvshmem_device.a) into a cubin.
NVSHMEM's device state is a variable of that library, so every module holds its own copy, which
`nvshmemx_cumodule_init` fills after the module loads and before its first launch (`Transport.load` in
backends/cuda/transport.py). NVRTC cannot link a static library (the wheel's bitcode, libnvshmem_device.bc,
would need nvJitLink): these units need nvcc whatever TOKENYARD_COMPILER says. NVSHMEM's headers need CCCL's
cuda/std, which CUDA 13 keeps under include/cccl. A unit's cache key adds NVSHMEM's version to the compiler's
identity (NOTE [kernel cache]).

NOTE [NVSHMEM host shim]
NVSHMEM's start from a unique id (`nvshmemx_init_attr`) is inline code in its headers that needs the static
host library the wheel lacks, and ctypes cannot call inline code: tokenyard/csrc/nvshmem_shim.cpp writes the
few host calls we make as C functions against the wheel's libnvshmem_host.so.3. It is built with g++ at first
use into TOKENYARD_CACHE_DIR/nvshmem/<key>/ (the key hashes the source and NVSHMEM's version), ranks of one
machine taking turns through an flock, as the call-plan extension is (NOTE [host extension] in host.py).
"""

from __future__ import annotations

import dataclasses
import fcntl
import functools
import hashlib
import os
import re
import subprocess
import tempfile
from typing import List, Optional

from .. import env
from . import compiler as compilers

SHIM_SOURCE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "csrc", "nvshmem_shim.cpp")
WHEEL = "nvidia-nvshmem-cu13"


@dataclasses.dataclass(frozen=True)
class Install:
    """An NVSHMEM installation with what the JIT needs: headers, the static device library, the host library."""

    root: str
    version: str

    @property
    def include_dir(self) -> str:
        return os.path.join(self.root, "include")

    @property
    def lib_dir(self) -> str:
        return os.path.join(self.root, "lib")

    def include_dirs(self) -> List[str]:
        """NVSHMEM's headers, then CUDA's and CCCL's (cuda/std), which they include."""
        cccl = [os.path.join(d, "cccl") for d in compilers.cuda_include_dirs() + ["/usr/local/cuda/include"]]
        return [self.include_dir] + compilers.cuda_include_dirs() + [d for d in cccl if os.path.isdir(d)]


@functools.lru_cache(maxsize=1)
def find() -> Optional[Install]:
    """NVSHMEM from $NVSHMEM_HOME or the pip wheel, or None where neither has the three parts."""
    roots = [os.environ["NVSHMEM_HOME"]] if os.environ.get("NVSHMEM_HOME") else []
    try:
        import nvidia.nvshmem

        roots += list(nvidia.nvshmem.__path__)
    except ImportError:
        pass
    for root in roots:
        parts = (os.path.join(root, "include", "nvshmem.h"), os.path.join(root, "lib", "libnvshmem_device.a"),
                 os.path.join(root, "lib", "libnvshmem_host.so.3"))
        if all(os.path.isfile(p) for p in parts):
            return Install(root, _version(root))
    return None


def missing_reason() -> str:
    """Why `find()` found nothing, naming the extra that brings it."""
    return (f"NVSHMEM was not found (no {WHEEL} wheel and no $NVSHMEM_HOME with include/nvshmem.h, "
            "lib/libnvshmem_device.a and lib/libnvshmem_host.so.3): pip install tokenyard[internode]")


def _version(root: str) -> str:
    """NVSHMEM's version as its header states it (the wheel's version need not be the install's)."""
    with open(os.path.join(root, "include", "non_abi", "nvshmem_version.h")) as f:
        text = f.read()
    numbers = [re.search(rf"#define NVSHMEM_VENDOR_{part}_VERSION\s+(\d+)", text)
               for part in ("MAJOR", "MINOR", "PATCH")]
    if all(numbers):
        return ".".join(m.group(1) for m in numbers)
    return "header " + hashlib.sha256(text.encode()).hexdigest()[:12]


class Linker:
    """nvcc with relocatable device code, then nvlink with NVSHMEM's device library (NOTE [NVSHMEM units])."""

    def __init__(self, install: Install, nvcc: str):
        self.install, self.nvcc = install, nvcc
        self.nvlink = os.path.join(os.path.dirname(nvcc), "nvlink")
        base = compilers.Nvcc(nvcc).identity
        self.identity = f"{base} + nvshmem {install.version} (rdc, nvlink)"

    def compile(self, source: str, arch: str, include_dirs: List[str]) -> bytes:
        with tempfile.TemporaryDirectory(prefix="tokenyard-nvshmem-") as tmp:
            src, rdc, out = (os.path.join(tmp, name) for name in ("kernel.cu", "kernel.rdc.cubin", "kernel.cubin"))
            with open(src, "w") as f:
                f.write(source)
            includes = [f"-I{d}" for d in include_dirs + self.install.include_dirs()]
            steps = ([self.nvcc, "-cubin", "-rdc=true", f"-arch={arch}", *compilers.FLAGS, *includes, "-o", rdc, src],
                     [self.nvlink, f"-arch={arch}", rdc, f"-L{self.install.lib_dir}", "-lnvshmem_device", "-o", out])
            for cmd in steps:
                done = subprocess.run(cmd, capture_output=True, text=True)
                if done.returncode != 0:
                    raise compilers.CompileError(f"{os.path.basename(cmd[0])} failed: {' '.join(cmd)}\n"
                                                 f"{done.stderr}\n--- source ---\n{source}")
            with open(out, "rb") as f:
                return f.read()


@functools.lru_cache(maxsize=1)
def linker() -> Linker:
    """The compiler of NVSHMEM units; raises CompileError where NVSHMEM or nvcc is missing."""
    install, nvcc = find(), compilers.nvcc_path()
    if install is None:
        raise compilers.CompileError(missing_reason())
    if nvcc is None:
        raise compilers.CompileError("kernels that call NVSHMEM are linked by nvcc and nvlink (NVRTC cannot link "
                                     "its device library): put nvcc on PATH or set CUDA_HOME")
    return Linker(install, nvcc)


def shim_path(cache_dir: str = "") -> str:
    """The built host shim (NOTE [NVSHMEM host shim]); builds it at the first call in this cache folder."""
    install = find()
    if install is None:
        raise compilers.CompileError(missing_reason())
    digest = hashlib.sha256()
    with open(SHIM_SOURCE, "rb") as f:
        digest.update(f.read())
    digest.update(install.version.encode() + b"\0" + install.root.encode())
    folder = os.path.join(cache_dir or env.settings().cache_dir, "nvshmem", digest.hexdigest()[:16])
    path = os.path.join(folder, "shim.so")
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "tokenyard.lock"), "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        if os.path.exists(path):
            return path
        tmp = path + f".{os.getpid()}.tmp"
        cmd = ["g++", "-shared", "-fPIC", "-O2", "-std=c++17", SHIM_SOURCE,
               *(f"-I{d}" for d in install.include_dirs()), f"-L{install.lib_dir}", "-l:libnvshmem_host.so.3",
               f"-Wl,-rpath,{install.lib_dir}", "-Wl,--no-undefined", "-o", tmp]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            raise compilers.CompileError(f"the NVSHMEM host shim did not build: {' '.join(cmd)}\n{done.stderr}")
        os.replace(tmp, path)
        env.log(f"built the NVSHMEM host shim ({path})")
        return path
