"""``import tokenyard.compat.deep_ep as deep_ep``: DeepEP's V1 names, backed by tokenyard.

Also `deep_ep.buffer.Buffer`, `deep_ep.utils`, and the seed README's `AutoTuner`, `Benchmark` and
``python -m deep_ep.benchmark`` (here ``python -m tokenyard.compat.deep_ep.benchmark``, the same command
line as ``python -m tokenyard.tools.bench``).
"""

from ... import __version__, topk_idx_t
from ...buffer import Buffer
from ...config import Config
from ...event import EventHandle, EventOverlap
from . import buffer, utils

__all__ = ["Buffer", "Config", "EventHandle", "EventOverlap", "topk_idx_t", "utils", "buffer", "AutoTuner",
           "Benchmark", "__version__"]


def __getattr__(name: str):
    """`AutoTuner` and `Benchmark` load the benchmark machinery, so they load when first named."""
    if name in ("AutoTuner", "Benchmark"):
        import tokenyard

        return getattr(tokenyard, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
