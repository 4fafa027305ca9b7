"""DeepEP's ``deep_ep.utils``: `EventHandle` (DeepEP main's package exports it), `EventOverlap` and
`check_nvlink_connections` (Megatron and torchtitan import them from here, as DeepEP V1's module held them), and the
submodules ``deep_ep.utils.event`` and ``deep_ep.utils.envs``."""

from . import envs, event
from .envs import check_nvlink_connections
from .event import EventHandle, EventOverlap

__all__ = ["EventHandle", "EventOverlap", "check_nvlink_connections", "envs", "event"]
