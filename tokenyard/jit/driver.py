"""The few CUDA driver calls the JIT needs (module load, launch), through ctypes on libcuda."""

from __future__ import annotations

import ctypes
import functools

from .spec import KernelSpec


class DriverError(RuntimeError):
    pass


@functools.lru_cache(maxsize=1)
def libcuda() -> ctypes.CDLL:
    lib = ctypes.CDLL("libcuda.so.1")
    lib.cuGetErrorString.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
    lib.cuLaunchKernel.argtypes = [ctypes.c_void_p] + [ctypes.c_uint] * 7 + [ctypes.c_void_p] * 3
    return lib


# cuLaunchKernel's `extra`: the whole parameter buffer at once (CU_LAUNCH_PARAM_BUFFER_POINTER = 1,
# CU_LAUNCH_PARAM_BUFFER_SIZE = 2, CU_LAUNCH_PARAM_END = 0), cheaper than one pointer per parameter.
_BUFFER_POINTER, _BUFFER_SIZE, _END = 1, 2, 0
_NOT_FOUND = 500  # CUDA_ERROR_NOT_FOUND


def check(status: int, what: str) -> None:
    if status != 0:
        text = ctypes.c_char_p()
        libcuda().cuGetErrorString(status, ctypes.byref(text))
        raise DriverError(f"{what} failed: CUDA driver error {status} ({(text.value or b'?').decode()})")


class Kernel:
    """A loaded kernel: `handle` is its CUfunction, for call plans (backends/cuda/plans.py); `kernel(grid,
    stream, *args, shared_bytes=0)` launches it from Python (tools and tests)."""

    def __init__(self, spec: KernelSpec, cubin: bytes):
        self.spec = spec
        lib = libcuda()
        self._module = ctypes.c_void_p()
        check(lib.cuModuleLoadData(ctypes.byref(self._module), ctypes.c_char_p(cubin)), "cuModuleLoadData")
        self._function = ctypes.c_void_p()
        check(lib.cuModuleGetFunction(ctypes.byref(self._function), self._module, spec.entry.encode()),
              "cuModuleGetFunction")
        self.handle = self._function.value
        self.module = self._module.value  # its CUmodule, which NVSHMEM units register (NOTE [NVSHMEM units])
        self._max_dynamic_shared = 48 * 1024

    def global_address(self, symbol: str):
        """(device address, bytes) of the module's global variable `symbol` (an extern "C" name), or None where
        the module has none."""
        ptr, size = ctypes.c_uint64(), ctypes.c_size_t()
        status = libcuda().cuModuleGetGlobal_v2(ctypes.byref(ptr), ctypes.byref(size), self._module, symbol.encode())
        if status == _NOT_FOUND:
            return None
        check(status, f"cuModuleGetGlobal({symbol})")
        return ptr.value, size.value

    def prepare(self, shared_bytes: int) -> int:
        """The dynamic shared memory of a launch that asks for `shared_bytes`: at least the spec's, every launch's
        (KernelSpec.shared_bytes); launches with it are allowed (above 48 KiB needs an opt-in)."""
        shared_bytes = max(shared_bytes, self.spec.shared_bytes)
        if shared_bytes > self._max_dynamic_shared:
            # CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8
            check(libcuda().cuFuncSetAttribute(self._function, 8, shared_bytes), "cuFuncSetAttribute")
            self._max_dynamic_shared = shared_bytes
        return shared_bytes

    def __call__(self, grid: int, stream: int, shared_bytes: int = 0, **args) -> None:
        """Launch with the kernel's arguments by parameter name (KernelSpec.ordered)."""
        shared_bytes = self.prepare(shared_bytes)
        packed = self.spec.pack(args)
        size = ctypes.c_size_t(ctypes.sizeof(packed))
        extra = (ctypes.c_void_p * 5)(_BUFFER_POINTER, ctypes.addressof(packed), _BUFFER_SIZE,
                                      ctypes.addressof(size), _END)
        check(libcuda().cuLaunchKernel(self._function, grid, 1, 1, self.spec.num_threads, 1, 1, shared_bytes, stream,
                                       None, extra), f"launch of {self.spec.function}")
