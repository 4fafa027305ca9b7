"""The on-disk kernel cache, keyed by content (NOTE [kernel cache])."""

from __future__ import annotations

import fcntl
import hashlib
import os
import tempfile
import threading
from typing import Dict, Optional, Tuple

from .. import env
from . import compiler as compilers
from .spec import KernelSpec

# NOTE [kernel cache]
# The key hashes the generated source, every header under tokenyard/include, the compiler's identity
# (NVRTC or nvcc version), its flags and the target architecture. One process compiles a unit while the
# others that want it wait on a lock file beside it (ranks of one machine start alike and would otherwise
# each compile every kernel), then read what it wrote. The unit is written to a temporary file in the cache
# folder, flushed to disk and renamed into place, so a reader finds a whole file or none.

_lock = threading.Lock()
_loaded: Dict[Tuple[str, int], object] = {}
_compiler = None


def _headers_digest() -> str:
    digest = hashlib.sha256()
    for root, _, files in sorted(os.walk(compilers.INCLUDE_DIR)):
        for name in sorted(files):
            path = os.path.join(root, name)
            digest.update(os.path.relpath(path, compilers.INCLUDE_DIR).encode())
            with open(path, "rb") as f:
                digest.update(f.read())
    return digest.hexdigest()


def get_compiler():
    global _compiler
    if _compiler is None:
        _compiler = compilers.make_compiler(env.settings().compiler)
        if _compiler is None:
            raise compilers.CompileError("no CUDA compiler: install a CUDA build of PyTorch (it brings NVRTC) "
                                         "or put nvcc on PATH")
    return _compiler


def cache_key(spec: KernelSpec, arch: str, identity: str) -> str:
    digest = hashlib.sha256()
    for part in (spec.source(), _headers_digest(), identity, " ".join(compilers.FLAGS), arch):
        digest.update(part.encode())
        digest.update(b"\0")
    return digest.hexdigest()


def _cached(path: str) -> Optional[bytes]:
    if not os.path.exists(path):
        return None
    with open(path, "rb") as f:
        return f.read()


def compile_cubin(spec: KernelSpec, arch: str, cache_dir: Optional[str] = None) -> bytes:
    """The cubin of `spec` for `arch` (e.g. "sm_90a"), from the cache or freshly compiled."""
    compiler = get_compiler()
    include_dirs = [compilers.INCLUDE_DIR] + compilers.cuda_include_dirs()
    key = cache_key(spec, arch, compiler.identity)
    folder = os.path.join(cache_dir or env.settings().cache_dir, key[:2])
    path = os.path.join(folder, key + ".cubin")
    cubin = _cached(path)
    if cubin is not None:
        return cubin
    os.makedirs(folder, exist_ok=True)
    with open(path + ".lock", "wb") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, or when its process dies
        cubin = _cached(path)  # another process compiled it while this one waited
        if cubin is not None:
            return cubin
        cubin = compiler.compile(spec.source(), arch, include_dirs)
        fd, tmp = tempfile.mkstemp(dir=folder, suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(cubin)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise
    env.log(f"compiled {spec.function}<{', '.join(map(str, spec.template_args))}> for {arch} ({len(cubin)} bytes)")
    return cubin


def device_arch(device_index: int) -> str:
    import torch

    major, minor = torch.cuda.get_device_capability(device_index)
    return f"sm_{major}{minor}" + ("a" if major >= 9 else "")


def load(spec: KernelSpec, device_index: int):
    """A launchable kernel on `device_index`, compiled and loaded once per process and device."""
    from .driver import Kernel

    with _lock:
        kernel = _loaded.get((spec, device_index))
        if kernel is None:
            kernel = Kernel(spec, compile_cubin(spec, device_arch(device_index)))
            _loaded[(spec, device_index)] = kernel
        return kernel
