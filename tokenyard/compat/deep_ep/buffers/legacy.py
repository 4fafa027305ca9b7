"""DeepEP's ``deep_ep.buffers.legacy``: V1's `Buffer`, with the `Config` and events its module imports."""

from ....buffer import Buffer
from ....config import Config
from ....event import EventHandle, EventOverlap

__all__ = ["Buffer", "Config", "EventHandle", "EventOverlap"]
