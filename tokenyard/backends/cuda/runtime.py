"""The CUDA runtime calls the backend needs beyond PyTorch: raw allocations shared by IPC handles, and
pinned host memory that kernels write to. Through ctypes on the libcudart that PyTorch loads."""

from __future__ import annotations

import ctypes
import functools
import glob
import os
import sys

IPC_HANDLE_BYTES = 64
_HOST_ALLOC_PORTABLE_MAPPED = 0x01 | 0x02
_IPC_LAZY_ENABLE_PEER_ACCESS = 0x01


def byte_view(ptr: int, num_bytes: int, device):
    """A uint8 tensor over `num_bytes` of raw device memory at `ptr`, which it does not own."""
    import torch

    class _Array:
        __cuda_array_interface__ = {"shape": (num_bytes,), "typestr": "|u1", "data": (ptr, False), "version": 3,
                                    "strides": None}

    return torch.as_tensor(_Array(), dtype=torch.uint8, device=device)


class RuntimeError_(RuntimeError):
    pass


class _IpcHandle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_char * IPC_HANDLE_BYTES)]


@functools.lru_cache(maxsize=1)
def libcudart() -> ctypes.CDLL:
    candidates = ["libcudart.so.13", "libcudart.so.12", "libcudart.so"]
    for base in sys.path:
        candidates += sorted(glob.glob(os.path.join(base, "nvidia", "cu*", "lib", "libcudart.so*")))
        candidates += sorted(glob.glob(os.path.join(base, "nvidia", "cuda_runtime", "lib", "libcudart.so*")))
    for name in candidates:
        try:
            lib = ctypes.CDLL(name)
        except OSError:
            continue
        lib.cudaGetErrorString.restype = ctypes.c_char_p
        lib.cudaIpcOpenMemHandle.argtypes = [ctypes.POINTER(ctypes.c_void_p), _IpcHandle, ctypes.c_uint]
        return lib
    raise RuntimeError_("libcudart was not found (a CUDA build of PyTorch brings it)")


def _check(status: int, what: str) -> None:
    if status != 0:
        raise RuntimeError_(f"{what} failed: {libcudart().cudaGetErrorString(status).decode()} ({status})")


def malloc(num_bytes: int) -> int:
    ptr = ctypes.c_void_p()
    _check(libcudart().cudaMalloc(ctypes.byref(ptr), ctypes.c_size_t(num_bytes)), f"cudaMalloc({num_bytes})")
    return ptr.value


def free(ptr: int) -> None:
    _check(libcudart().cudaFree(ctypes.c_void_p(ptr)), "cudaFree")


def memset(ptr: int, value: int, num_bytes: int) -> None:
    _check(libcudart().cudaMemset(ctypes.c_void_p(ptr), value, ctypes.c_size_t(num_bytes)), "cudaMemset")


def ipc_handle(ptr: int) -> bytes:
    handle = _IpcHandle()
    _check(libcudart().cudaIpcGetMemHandle(ctypes.byref(handle), ctypes.c_void_p(ptr)), "cudaIpcGetMemHandle")
    return ctypes.string_at(ctypes.addressof(handle), IPC_HANDLE_BYTES)  # .reserved would stop at a NUL


def ipc_open(handle: bytes) -> int:
    raw = _IpcHandle()
    ctypes.memmove(ctypes.addressof(raw), handle, IPC_HANDLE_BYTES)
    ptr = ctypes.c_void_p()
    _check(libcudart().cudaIpcOpenMemHandle(ctypes.byref(ptr), raw, _IPC_LAZY_ENABLE_PEER_ACCESS),
           "cudaIpcOpenMemHandle")
    return ptr.value


def ipc_close(ptr: int) -> None:
    _check(libcudart().cudaIpcCloseMemHandle(ctypes.c_void_p(ptr)), "cudaIpcCloseMemHandle")


def host_alloc_mapped(num_bytes: int) -> int:
    """Pinned host memory that kernels can write through the same pointer (unified addressing)."""
    ptr = ctypes.c_void_p()
    _check(libcudart().cudaHostAlloc(ctypes.byref(ptr), ctypes.c_size_t(num_bytes), _HOST_ALLOC_PORTABLE_MAPPED),
           "cudaHostAlloc")
    ctypes.memset(ptr.value, 0, num_bytes)
    return ptr.value


def host_free(ptr: int) -> None:
    _check(libcudart().cudaFreeHost(ctypes.c_void_p(ptr)), "cudaFreeHost")


def int32_view(ptr: int, count: int):
    """A ctypes int32 array over host memory; every element read goes to memory."""
    return (ctypes.c_int32 * count).from_address(ptr)


_DEV_ATTR_MPS_ENABLED = 133  # cudaDevAttrMpsEnabled: contexts on the device are shared through MPS


def mps_enabled(device_index: int) -> bool:
    """Whether MPS serves this process's contexts on the device (NOTE [MPS] in backend.py)."""
    value = ctypes.c_int()
    _check(libcudart().cudaDeviceGetAttribute(ctypes.byref(value), _DEV_ATTR_MPS_ENABLED, device_index),
           "cudaDeviceGetAttribute(MpsEnabled)")
    return bool(value.value)
