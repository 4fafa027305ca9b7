"""tokenyard: expert-parallel dispatch and combine for Mixture-of-Experts models, DeepEP-compatible.

``import tokenyard`` loads no CUDA code; the CUDA backend compiles its kernels on first use.
`AutoTuner` (tokenyard.tools.autotune) and `Benchmark` (tokenyard.benchmark) load on first use;
`tokenyard.tools.affinity` binds a rank to its GPU's cores, NUMA memory and NIC.
"""

import torch

from .buffer import Buffer
from .config import Config
from .elastic import ElasticBuffer, EPHandle
from .errors import (BackendUnavailableError, CapacityError, CollectiveRefusedError, CommError, CommTimeoutError,
                     HandleError, InvalidInputError, PeerLostError, RankMismatchError, TokenyardError)
from .event import EventHandle, EventOverlap
from .handle import DispatchHandle, InternodeHandle, LowLatencyHandle
from .semantics import quant, routing
from .semantics.quant import dequantize_fp8, dequantize_int8, quantize_fp8, quantize_int8

topk_idx_t = torch.int64
"""The dtype of expert indices, as DeepEP names it (int32 is accepted too)."""

__version__ = "0.1.0"

__all__ = [
    "Buffer", "ElasticBuffer", "EPHandle", "Config", "EventHandle", "EventOverlap", "DispatchHandle",
    "InternodeHandle", "LowLatencyHandle", "topk_idx_t",
    "TokenyardError", "InvalidInputError", "CapacityError", "HandleError", "CommError", "CommTimeoutError",
    "RankMismatchError", "PeerLostError", "CollectiveRefusedError",
    "BackendUnavailableError", "quantize_fp8", "dequantize_fp8", "quantize_int8", "dequantize_int8",
    "quant", "routing", "AutoTuner", "Benchmark",
]

_LAZY = {"AutoTuner": "tools.autotune", "Benchmark": "benchmark"}


def __getattr__(name: str):
    """`AutoTuner` and `Benchmark` import the benchmark machinery, so they load when first named."""
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
