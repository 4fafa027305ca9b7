"""DeepEP's ``deep_ep.buffers.elastic``: V2's `ElasticBuffer` and `EPHandle`, with the events its module imports."""

from ....elastic import ElasticBuffer, EPHandle
from ....event import EventHandle, EventOverlap

__all__ = ["ElasticBuffer", "EPHandle", "EventHandle", "EventOverlap"]
