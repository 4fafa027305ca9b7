"""DeepEP's ``deep_ep.utils`` names (Megatron and torchtitan import `EventOverlap` from here)."""

from ...event import EventHandle, EventOverlap

__all__ = ["EventHandle", "EventOverlap"]
