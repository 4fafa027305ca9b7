"""The CUDA backend's host-side extension (tokenyard/csrc/call_plan.cpp), built on first use and cached.

NOTE [host extension]
`pip install .` compiles nothing, so the C++ half of the call path is built like the kernels: at the first
use, with PyTorch's extension builder (a C++ compiler and ninja, as Triton's launchers need), into
TOKENYARD_CACHE_DIR/host/<key>, the key hashing the source, PyTorch's version and the Python ABI. Ranks of
one machine take turns through an flock on that folder (released by the kernel when a holder dies, unlike
the builder's own lock file, which a killed builder leaves behind and every later build would wait on
forever: whoever holds the flock removes it); later processes load the built module (a second or less). It holds no CUDA code: the driver entry points come from libcuda as
addresses (`set_driver`), so it also builds against PyTorch's CPU build, where CI compiles and tests it.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import os
import sys
import threading

from .. import env

SOURCE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "csrc", "call_plan.cpp")
_lock = threading.Lock()


def build_key() -> str:
    import torch

    digest = hashlib.sha256()
    with open(SOURCE, "rb") as f:
        digest.update(f.read())
    digest.update(torch.__version__.encode())
    digest.update(sys.implementation.cache_tag.encode())
    return digest.hexdigest()[:16]


@functools.lru_cache(maxsize=None)
def call_plans(cache_dir: str = ""):
    """The built module (`Plan`, `set_driver`); builds it at the first call in this cache folder."""
    from torch.utils import cpp_extension

    key = build_key()
    folder = os.path.join(cache_dir or env.settings().cache_dir, "host", key)
    os.makedirs(folder, exist_ok=True)
    with _lock, open(os.path.join(folder, "tokenyard.lock"), "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        stale = os.path.join(folder, "lock")  # the builder's own lock file: nobody else builds now
        if os.path.exists(stale):
            os.remove(stale)
        return cpp_extension.load(name=f"tokenyard_call_plan_{key}", sources=[SOURCE], build_directory=folder,
                                  extra_cflags=["-O2"], verbose=env.settings().verbose)
