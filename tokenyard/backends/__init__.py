"""Backend registry: names to factories, and the choice `backend="auto"` makes."""

from __future__ import annotations

import functools
import warnings
from typing import Optional

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


def make_reference(ctx: GroupContext) -> Backend:
    from .reference import ReferenceBackend

    return ReferenceBackend(ctx)


def _make_cuda(ctx: GroupContext) -> Backend:
    if ctx.device.type != "cuda" or not cuda_available():
        raise BackendUnavailableError("the CUDA backend needs CUDA GPUs and a CUDA compiler (NVRTC from the CUDA "
                                      "PyTorch wheels, or nvcc)")
    from .cuda import CudaBackend

    return CudaBackend(ctx)


_FACTORIES = {"reference": make_reference, "cuda": _make_cuda}


def normal_mode_backend(requested: str, chosen: str, num_nodes: int, internode_kernels: bool = False) -> Optional[str]:
    """NOTE [internode normal mode]
    A Buffer whose group has several nodes (real or virtual, NOTE [virtual nodes]) runs its normal-mode calls
    (layout, dispatch, combine) on the CUDA backend's internode kernels (NOTE [internode kernels]) where every
    rank can run them (`internode_kernels`: NVSHMEM and nvcc there, NOTE [NVSHMEM units]), else on the
    reference backend's hierarchical path (NOTE [internode stages]). Which backend runs them: the Buffer's own
    (`chosen`) with one node, where it is the reference backend, or where it is CUDA with internode kernels;
    "reference" where `backend="auto"` chose CUDA without them (the Buffer says so once, naming the extra);
    None where the caller asked for "cuda" itself: those calls raise BackendUnavailableError. Low-latency calls
    stay on the Buffer's own backend: their meaning does not depend on nodes.

    Examples: ("auto", "cuda", 2) -> "reference"; ("cuda", "cuda", 2) -> None; ("cuda", "cuda", 1) -> "cuda";
    ("cuda", "cuda", 2, internode_kernels=True) -> "cuda".
    """
    if num_nodes <= 1 or chosen == "reference" or internode_kernels:
        return chosen
    return "reference" if requested == "auto" else None


def create_backend(name: str, ctx: GroupContext) -> Backend:
    """Make the named backend; ``"auto"`` takes CUDA where every rank can run it, else reference."""
    if name == "auto":
        return _create_auto(ctx)
    if name not in _FACTORIES:
        raise BackendUnavailableError(f"unknown backend {name!r}; choose from auto, {', '.join(_FACTORIES)}")
    return _FACTORIES[name](ctx)


def _create_auto(ctx: GroupContext) -> Backend:
    """CUDA if it can run on every rank (decided together, so all ranks pick the same), else reference."""
    if ctx.device.type != "cuda":
        return make_reference(ctx)
    backend, reason = None, None
    if not all(ctx.all_gather_object(cuda_available() and cuda_validated())):
        reason = "it cannot run on every rank"
    else:
        try:
            backend = _make_cuda(ctx)
        except BackendUnavailableError as exc:  # e.g. no peer access between two of the GPUs
            reason = str(exc)
        if not all(ctx.all_gather_object(backend is not None)):
            reason = reason or "another rank could not start it"
            if backend is not None:
                backend.destroy(together=False)  # the ranks without one make no such call
                backend = None
    if backend is not None:
        env.log(f"rank {ctx.rank}: backend auto -> cuda")
        return backend
    env.log(f"rank {ctx.rank}: backend auto -> reference ({reason})")
    if ctx.rank == 0:
        warnings.warn(f"tokenyard: using the reference backend (NCCL all-to-all) because the CUDA backend: "
                      f"{reason}. Set TOKENYARD_VERBOSE=1 for details.", stacklevel=4)
    return make_reference(ctx)
