"""Compilers: NVRTC through its C API (shipped with CUDA builds of PyTorch), or the nvcc command."""

from __future__ import annotations

import ctypes
import glob
import os
import shutil
import subprocess
import sys
import tempfile
from typing import List, Optional

INCLUDE_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "include")
FLAGS = ("-std=c++17",)


class CompileError(RuntimeError):
    """The compiler rejected a kernel; the message holds its log."""


def _site_nvidia_dirs(sub: str) -> List[str]:
    """Folders like site-packages/nvidia/cu13/<sub> from the CUDA pip wheels PyTorch depends on."""
    found = []
    for base in sys.path:
        found += sorted(glob.glob(os.path.join(base, "nvidia", "cu*", sub)))
        found += sorted(glob.glob(os.path.join(base, "nvidia", "cuda_*", sub)))
    return [d for d in found if os.path.isdir(d)]


def include_dirs(spec) -> List[str]:
    """Where `spec`'s unit finds its headers: tokenyard/include, the spec's own root if it has one, CUDA's."""
    return [INCLUDE_DIR] + ([spec.include_root] if spec.include_root else []) + cuda_include_dirs()


def cuda_include_dirs() -> List[str]:
    """Where cuda_bf16.h and friends live: $CUDA_HOME, the pip wheels, /usr/local/cuda."""
    candidates = []
    if os.environ.get("CUDA_HOME"):
        candidates.append(os.path.join(os.environ["CUDA_HOME"], "include"))
    candidates += _site_nvidia_dirs("include")
    candidates.append("/usr/local/cuda/include")
    return [d for d in candidates if os.path.exists(os.path.join(d, "cuda_bf16.h"))]


def _load_nvrtc() -> Optional[ctypes.CDLL]:
    names = []
    for lib_dir in _site_nvidia_dirs("lib"):
        names += sorted(glob.glob(os.path.join(lib_dir, "libnvrtc.so*")))
    names += ["libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so"]
    for name in names:
        if "builtins" in name or ".alt." in name:
            continue
        # NVRTC opens its builtins library by name at its first compile: loaded first from the same folder, it is
        # found where that folder is not on the loader's path (a pip wheel outside PyTorch's).
        for builtins in sorted(glob.glob(os.path.join(os.path.dirname(name), "libnvrtc-builtins.so*"))):
            if ".alt." not in builtins:
                try:
                    ctypes.CDLL(builtins, mode=ctypes.RTLD_GLOBAL)
                except OSError:
                    pass
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    return None


def nvcc_path() -> Optional[str]:
    for candidate in (os.path.join(os.environ.get("CUDA_HOME", ""), "bin", "nvcc"), shutil.which("nvcc"),
                      "/usr/local/cuda/bin/nvcc"):
        if candidate and os.path.isfile(candidate):
            return candidate
    return None


class Nvrtc:
    """NVRTC through ctypes: source in, cubin out."""

    def __init__(self, lib: ctypes.CDLL):
        self.lib = lib
        major, minor = ctypes.c_int(), ctypes.c_int()
        lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor))
        self.identity = f"nvrtc {major.value}.{minor.value}"

    def compile(self, source: str, arch: str, include_dirs: List[str]) -> bytes:
        lib = self.lib
        program = ctypes.c_void_p()
        self._check(lib.nvrtcCreateProgram(ctypes.byref(program), source.encode(), b"tokenyard.cu", 0, None, None),
                    "create")
        try:
            options = [f"--gpu-architecture={arch}".encode(), *(f.encode() for f in FLAGS),
                       *(f"-I{d}".encode() for d in include_dirs)]
            array = (ctypes.c_char_p * len(options))(*options)
            status = lib.nvrtcCompileProgram(program, len(options), array)
            if status != 0:
                size = ctypes.c_size_t()
                lib.nvrtcGetProgramLogSize(program, ctypes.byref(size))
                log = ctypes.create_string_buffer(size.value)
                lib.nvrtcGetProgramLog(program, log)
                raise CompileError(f"NVRTC failed ({arch}):\n{log.value.decode(errors='replace')}\n--- source ---\n{source}")
            size = ctypes.c_size_t()
            self._check(lib.nvrtcGetCUBINSize(program, ctypes.byref(size)), "cubin size")
            cubin = ctypes.create_string_buffer(size.value)
            self._check(lib.nvrtcGetCUBIN(program, cubin), "cubin")
            return cubin.raw
        finally:
            lib.nvrtcDestroyProgram(ctypes.byref(program))

    @staticmethod
    def _check(status: int, what: str) -> None:
        if status != 0:
            raise CompileError(f"NVRTC {what} failed with status {status}")


class Nvcc:
    """The nvcc command: source in, cubin out."""

    def __init__(self, path: str):
        self.path = path
        version = subprocess.run([path, "--version"], capture_output=True, text=True, check=True).stdout
        self.identity = "nvcc " + version.strip().splitlines()[-1]

    def compile(self, source: str, arch: str, include_dirs: List[str]) -> bytes:
        with tempfile.TemporaryDirectory(prefix="tokenyard-nvcc-") as tmp:
            src, out = os.path.join(tmp, "kernel.cu"), os.path.join(tmp, "kernel.cubin")
            with open(src, "w") as f:
                f.write(source)
            gencode = f"-gencode=arch={arch.replace('sm_', 'compute_')},code={arch}"
            cmd = [self.path, "-cubin", gencode, *FLAGS, *(f"-I{d}" for d in include_dirs), "-o", out, src]
            done = subprocess.run(cmd, capture_output=True, text=True)
            if done.returncode != 0:
                raise CompileError(f"nvcc failed: {' '.join(cmd)}\n{done.stderr}\n--- source ---\n{source}")
            with open(out, "rb") as f:
                return f.read()


def make_compiler(choice: str = "auto"):
    """NVRTC where its library loads (choice "auto" or "nvrtc"), else nvcc; None if neither exists."""
    if choice in ("auto", "nvrtc"):
        lib = _load_nvrtc()
        if lib is not None:
            return Nvrtc(lib)
        if choice == "nvrtc":
            return None
    path = nvcc_path()
    return Nvcc(path) if path else None
