"""DeepEP's ``deep_ep.buffers``: ``legacy`` (V1's `Buffer`) and ``elastic`` (V2's `ElasticBuffer`)."""

from . import elastic, legacy

__all__ = ["elastic", "legacy"]
