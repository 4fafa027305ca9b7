"""The CUDA backend (imported only when a Buffer may use it; importing it loads no CUDA library)."""

from .backend import CudaBackend
from .copy_limit import measure_copy_limit_gbps

__all__ = ["CudaBackend", "measure_copy_limit_gbps"]
