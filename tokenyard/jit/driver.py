"""The few CUDA driver calls the JIT needs (module load, launch), through ctypes on libcuda."""

from __future__ import annotations

import ctypes
import functools

from .spec import ENTRY, KernelSpec


class DriverError(RuntimeError):
    pass


@functools.lru_cache(maxsize=1)
def libcuda() -> ctypes.CDLL:
    lib = ctypes.CDLL("libcuda.so.1")
    lib.cuGetErrorString.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
    return lib


def check(status: int, what: str) -> None:
    if status != 0:
        text = ctypes.c_char_p()
        libcuda().cuGetErrorString(status, ctypes.byref(text))
        raise DriverError(f"{what} failed: CUDA driver error {status} ({(text.value or b'?').decode()})")


class Kernel:
    """A loaded kernel: `kernel(grid, stream, *args, shared_bytes=0)` launches it."""

    def __init__(self, spec: KernelSpec, cubin: bytes):
        self.spec = spec
        lib = libcuda()
        self._module = ctypes.c_void_p()
        check(lib.cuModuleLoadData(ctypes.byref(self._module), ctypes.c_char_p(cubin)), "cuModuleLoadData")
        self._function = ctypes.c_void_p()
        check(lib.cuModuleGetFunction(ctypes.byref(self._function), self._module, ENTRY.encode()),
              "cuModuleGetFunction")
        self._max_dynamic_shared = 48 * 1024

    def __call__(self, grid: int, stream: int, *args, shared_bytes: int = 0) -> None:
        lib = libcuda()
        if shared_bytes > self._max_dynamic_shared:
            # CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8
            check(lib.cuFuncSetAttribute(self._function, 8, shared_bytes), "cuFuncSetAttribute")
            self._max_dynamic_shared = shared_bytes
        values = self.spec.pack(args)
        pointers = (ctypes.c_void_p * len(values))(*[ctypes.cast(ctypes.byref(v), ctypes.c_void_p) for v in values])
        check(lib.cuLaunchKernel(self._function, ctypes.c_uint(grid), 1, 1, ctypes.c_uint(self.spec.num_threads), 1, 1,
                                 ctypes.c_uint(shared_bytes), ctypes.c_void_p(stream), pointers, None),
              f"launch of {self.spec.function}")
