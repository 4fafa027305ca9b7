"""Run-time compilation of CUDA kernels from the headers under tokenyard/include.

Knows nothing about MoE: a `KernelSpec` names a header, a device function template with its template
arguments, and the kernel parameters; `load(spec)` compiles it once (NVRTC, else nvcc), caches the cubin
on disk keyed by content, and returns a launchable `Kernel`. Importing this package loads no CUDA library.
"""

from .spec import KernelSpec, Param
from .cache import load

__all__ = ["KernelSpec", "Param", "load"]
