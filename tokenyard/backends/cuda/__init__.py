"""The CUDA backend (imported only when a Buffer may use it; importing it loads no CUDA library)."""

from .backend import CudaBackend

__all__ = ["CudaBackend"]
