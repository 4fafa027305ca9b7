"""The CUDA backend (imported only when a Buffer may use it; importing it loads no CUDA library)."""

from .backend import CudaBackend
from .copy_limit import measure_copy_limit_gbps
from .kernels import COPY_PATTERNS

__all__ = ["COPY_PATTERNS", "CudaBackend", "measure_copy_limit_gbps"]
