"""``import tokenyard.compat.deep_ep as deep_ep``: DeepEP's V1 names, backed by tokenyard."""

from ...buffer import Buffer
from ...config import Config
from ...event import EventHandle, EventOverlap
from ... import topk_idx_t
from . import utils

__all__ = ["Buffer", "Config", "EventHandle", "EventOverlap", "topk_idx_t", "utils"]
