"""The on-disk kernel cache, keyed by content (NOTE [kernel cache])."""

from __future__ import annotations

import fcntl
import hashlib
import os
import re
import tempfile
import threading
from typing import Dict, Optional, Tuple

from .. import env
from ..errors import TokenyardError
from . import compiler as compilers
from .spec import KernelSpec

# NOTE [kernel cache]
# The key hashes the generated source, the headers it includes from tokenyard/include (or from the spec's
# include_root), followed through their own includes, so a change to one header recompiles only the units
# that include it, the compiler's identity (NVRTC or nvcc version, and NVSHMEM's for units linked with it,
# NOTE [NVSHMEM units] in nvshmem.py), its flags and the target architecture. One process compiles a unit while the
# others that want it wait on a lock file beside it (ranks of one machine start alike and would otherwise
# each compile every kernel), then read what it wrote. The unit is written to a temporary file in the cache
# folder, flushed to disk and renamed into place, so a reader finds a whole file or none; the file ends with
# a trailer (TRAILER_MAGIC, the cubin's size and its SHA-256), and a file whose trailer does not match its
# contents (truncated, emptied, written by something else) is compiled again and replaced.

TRAILER_MAGIC = b"tokenyard-cubin-1"
_TRAILER = len(TRAILER_MAGIC) + 8 + 32


class KernelCacheError(TokenyardError, OSError):
    """A compiled kernel could not be written to the cache folder (TOKENYARD_CACHE_DIR)."""


def with_trailer(cubin: bytes) -> bytes:
    """What the cache stores for `cubin`: the cubin, then its trailer."""
    return cubin + TRAILER_MAGIC + len(cubin).to_bytes(8, "little") + hashlib.sha256(cubin).digest()


def without_trailer(stored: bytes) -> Optional[bytes]:
    """The cubin a cache file holds, or None where its trailer does not match its contents."""
    if len(stored) < _TRAILER:
        return None
    cubin, trailer = stored[:-_TRAILER], stored[-_TRAILER:]
    size = int.from_bytes(trailer[len(TRAILER_MAGIC):len(TRAILER_MAGIC) + 8], "little")
    if trailer[:len(TRAILER_MAGIC)] != TRAILER_MAGIC or size != len(cubin) or \
            trailer[-32:] != hashlib.sha256(cubin).digest():
        return None
    return cubin

_lock = threading.Lock()
_loaded: Dict[Tuple[str, int], object] = {}
_compiler = None


_INCLUDE = re.compile(r'^\s*#\s*include\s*[<"]([^>"]+)[>"]', re.MULTILINE)


def _includes_digest(source: str, roots: Tuple[str, ...]) -> str:
    """The headers `source` includes from `roots`, followed through theirs (NOTE [kernel cache]): each file's
    path within its root and its bytes. A quoted or angled name is looked for beside the including header,
    then in each root; names found in neither (CUDA's, the C++ library's) are not ours to hash. An include
    inside an #if is followed whatever the condition: hashing more than is compiled only costs a compile."""
    digest = hashlib.sha256()
    seen = set()
    pending = [(source, None)]
    while pending:
        text, here = pending.pop()
        for name in _INCLUDE.findall(text):
            for folder in ([here] if here else []) + list(roots):
                path = os.path.normpath(os.path.join(folder, name))
                if os.path.isfile(path):
                    break
            else:
                continue
            if path in seen:
                continue
            seen.add(path)
            root = next(r for r in roots if path.startswith(os.path.join(r, "")))
            with open(path) as f:
                header = f.read()
            digest.update(os.path.relpath(path, root).encode() + b"\0" + header.encode() + b"\0")
            pending.append((header, os.path.dirname(path)))
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
    source = spec.source()
    roots = tuple(os.path.normpath(r) for r in (compilers.INCLUDE_DIR, spec.include_root) if r)
    for part in (source, _includes_digest(source, roots), identity, " ".join(compilers.FLAGS), arch):
        digest.update(part.encode())
        digest.update(b"\0")
    return digest.hexdigest()


def _name(spec: KernelSpec) -> str:
    return f"{spec.function}<{', '.join(map(str, spec.template_args))}>"


def _cached(path: str) -> Optional[bytes]:
    """The cubin cached at `path`, or None where there is none or it is damaged (then compiled again)."""
    if not os.path.exists(path):
        return None
    with open(path, "rb") as f:
        cubin = without_trailer(f.read())
    if cubin is None:
        env.log(f"kernel cache file {path} is damaged (its trailer does not match): compiling again")
    return cubin


def compiler_for(spec: KernelSpec):
    """The compiler of `spec`'s unit: nvcc and NVSHMEM's device library for an NVSHMEM unit, else get_compiler();
    raises CompileError where it is missing."""
    if spec.nvshmem:
        from . import nvshmem

        return nvshmem.linker()
    return get_compiler()


def cubin_path(key: str, cache_dir: Optional[str] = None) -> str:
    """Where the cache keeps the unit of `key`."""
    return os.path.join(cache_dir or env.settings().cache_dir, key[:2], key + ".cubin")


def compile_cubin(spec: KernelSpec, arch: str, cache_dir: Optional[str] = None) -> bytes:
    """The cubin of `spec` for `arch` (e.g. "sm_90a"), from the cache or freshly compiled."""
    compiler = compiler_for(spec)
    if env.settings().jit_manifest:  # NOTE [kernel manifest]
        from . import manifest

        manifest.record(env.settings().jit_manifest, spec, arch, compiler.identity)
    key = cache_key(spec, arch, compiler.identity)
    path = cubin_path(key, cache_dir)
    folder = os.path.dirname(path)
    cubin = _cached(path)
    if cubin is not None:
        return cubin
    try:
        os.makedirs(folder, exist_ok=True)
        lock = open(path + ".lock", "wb")
    except OSError as exc:
        raise KernelCacheError(f"cannot use the kernel cache at {folder} for kernel {_name(spec)}: {exc}; set "
                               "TOKENYARD_CACHE_DIR to a writable folder") from exc
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, or when its process dies
        cubin = _cached(path)  # another process compiled it while this one waited
        if cubin is not None:
            return cubin
        cubin = compiler.compile(spec.source(), arch, compilers.include_dirs(spec))
        tmp = None
        try:
            fd, tmp = tempfile.mkstemp(dir=folder, suffix=".tmp")
            with os.fdopen(fd, "wb") as f:
                f.write(with_trailer(cubin))
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except OSError as exc:
            raise KernelCacheError(f"could not write kernel {_name(spec)} to the kernel cache at {path}: {exc}; set "
                                   "TOKENYARD_CACHE_DIR to a writable folder") from exc
        finally:
            if tmp is not None and os.path.exists(tmp):
                os.unlink(tmp)
    env.log(f"compiled {_name(spec)} for {arch} ({len(cubin)} bytes)")
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
