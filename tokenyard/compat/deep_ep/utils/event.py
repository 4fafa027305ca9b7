"""DeepEP's ``deep_ep.utils.event``: `EventOverlap` and `EventHandle`."""

from ....event import EventHandle, EventOverlap

__all__ = ["EventHandle", "EventOverlap"]
