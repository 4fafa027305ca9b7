"""``import tokenyard.compat.deep_ep as deep_ep``: DeepEP's V1 and V2 names, backed by tokenyard.

Also `deep_ep.buffer.Buffer`, `deep_ep.utils`, and the seed README's `AutoTuner`, `Benchmark` and
``python -m deep_ep.benchmark`` (here ``python -m tokenyard.compat.deep_ep.benchmark``, the same command
line as ``python -m tokenyard.tools.bench``).
"""

from ... import __version__, topk_idx_t
from ...buffer import Buffer
from ...config import Config
from ...elastic import ElasticBuffer, EPHandle
from ...event import EventHandle, EventOverlap
from . import buffer, utils

__all__ = ["Buffer", "ElasticBuffer", "EPHandle", "get_physical_domain_size", "get_logical_domain_size",
           "Config", "EventHandle", "EventOverlap", "topk_idx_t", "utils", "buffer", "AutoTuner",
           "Benchmark", "__version__"]


def get_physical_domain_size(group) -> tuple:
    """(RDMA ranks, NVLink ranks) of `group`: one NVLink domain of the whole group."""
    return 1, group.size()


def get_logical_domain_size(group, allow_hybrid_mode: bool = True) -> tuple:
    """(scale-out ranks, scale-up ranks) of `group`, as `get_physical_domain_size`."""
    del allow_hybrid_mode
    return 1, group.size()


def __getattr__(name: str):
    """`AutoTuner` and `Benchmark` load the benchmark machinery, so they load when first named."""
    if name in ("AutoTuner", "Benchmark"):
        import tokenyard

        return getattr(tokenyard, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
