"""Backend registry: names to factories, and the choice `backend="auto"` makes."""

from __future__ import annotations

import functools
import warnings

from .. import env
from ..errors import BackendUnavailableError
from .base import Backend, GroupContext


@functools.lru_cache(maxsize=1)
def cuda_available() -> bool:
    """Whether the CUDA backend can run in this process (a GPU, peer access, a compiler)."""
    try:
        from .cuda import CudaBackend
    except ImportError:
        return False
    return CudaBackend.available()


def cuda_validated() -> bool:
    """Whether `backend="auto"` may pick the CUDA backend (its GPU tests have passed)."""
    from .cuda import CudaBackend

    return CudaBackend.VALIDATED


def _make_reference(ctx: GroupContext) -> Backend:
    from .reference import ReferenceBackend

    return ReferenceBackend(ctx)


def _make_cuda(ctx: GroupContext) -> Backend:
    if ctx.device.type != "cuda" or not cuda_available():
        raise BackendUnavailableError("the CUDA backend needs CUDA GPUs, an NCCL (or mpi4py) group and a "
                                      "CUDA compiler (NVRTC from the CUDA PyTorch wheels, or nvcc)")
    from .cuda import CudaBackend

    return CudaBackend(ctx)


_FACTORIES = {"reference": _make_reference, "cuda": _make_cuda}


def create_backend(name: str, ctx: GroupContext) -> Backend:
    """Make the named backend; ``"auto"`` takes CUDA where every rank can run it, else reference."""
    if name == "auto":
        usable = ctx.device.type == "cuda" and cuda_available() and cuda_validated()
        if ctx.device.type == "cuda":
            usable = all(ctx.all_gather_object(usable))  # every rank must agree on one backend
        name = "cuda" if usable else "reference"
        env.log(f"rank {ctx.rank}: backend auto -> {name}")
        if ctx.device.type == "cuda" and name == "reference" and ctx.rank == 0:
            warnings.warn("tokenyard: the CUDA backend cannot run on every rank here; using the reference "
                          "backend (NCCL all-to-all). Set TOKENYARD_VERBOSE=1 to see why.", stacklevel=3)
    if name not in _FACTORIES:
        raise BackendUnavailableError(f"unknown backend {name!r}; choose from auto, {', '.join(_FACTORIES)}")
    return _FACTORIES[name](ctx)
