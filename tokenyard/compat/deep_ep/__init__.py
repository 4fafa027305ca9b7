"""``import tokenyard.compat.deep_ep as deep_ep``: DeepEP's V1 and V2 names, backed by tokenyard.

Also the modules of DeepEP's package layout (`SUBMODULES`: V1's ``deep_ep.buffer`` and ``deep_ep.utils``, DeepEP
main's ``deep_ep.buffers.legacy``, ``deep_ep.buffers.elastic``, ``deep_ep.utils.event`` and ``deep_ep.utils.envs``),
and the seed README's `AutoTuner`, `Benchmark` and ``python -m deep_ep.benchmark`` (here ``python -m
tokenyard.compat.deep_ep.benchmark``, the same command line as ``python -m tokenyard.tools.bench``).
"""

from ... import __version__, topk_idx_t
from ...buffer import Buffer
from ...config import Config
from ...elastic import ElasticBuffer, EPHandle
from ...event import EventHandle, EventOverlap
from . import buffer, buffers, utils
from .utils.envs import get_logical_domain_size, get_physical_domain_size

__all__ = ["Buffer", "ElasticBuffer", "EPHandle", "get_physical_domain_size", "get_logical_domain_size",
           "Config", "EventHandle", "EventOverlap", "topk_idx_t", "utils", "buffer", "buffers", "AutoTuner",
           "Benchmark", "__version__"]

# The modules below this package, by their names under it: the alias (tokenyard.compat.alias) makes each
# ``deep_ep.<name>`` this package's module.
SUBMODULES = ("buffer", "buffers", "buffers.legacy", "buffers.elastic", "utils", "utils.event", "utils.envs")


def __getattr__(name: str):
    """`AutoTuner` and `Benchmark` load the benchmark machinery, so they load when first named."""
    if name in ("AutoTuner", "Benchmark"):
        import tokenyard

        return getattr(tokenyard, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
