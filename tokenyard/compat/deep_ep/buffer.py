"""DeepEP's ``deep_ep.buffer`` module (code imports `Buffer` from it)."""

from ...buffer import Buffer
from ...event import EventOverlap

__all__ = ["Buffer", "EventOverlap"]
