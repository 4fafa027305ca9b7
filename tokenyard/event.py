"""Events for overlapping communication with computation (DeepEP's `EventHandle` and `EventOverlap`)."""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch

from .errors import InvalidInputError


def _cuda_ready() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_initialized()


class EventHandle:
    """A CUDA event recorded on the current stream at construction (nothing on a machine without CUDA)."""

    def __init__(self, stream: Optional["torch.cuda.Stream"] = None):
        self.event = None
        if _cuda_ready():
            self.event = torch.cuda.Event()
            self.event.record(stream if stream is not None else torch.cuda.current_stream())

    def current_stream_wait(self) -> None:
        """Make the current stream wait for the event."""
        if self.event is not None:
            torch.cuda.current_stream().wait_event(self.event)

    def synchronize(self) -> None:
        if self.event is not None:
            self.event.synchronize()


class EventOverlap:
    """An event plus the tensors that must stay alive until it completes (DeepEP's, V2's included).

    ``with buffer.dispatch(..., async_finish=True)[-1]:`` runs the block while the communication is in
    flight and makes the current stream wait for it on exit, as in DeepEP; ``with event(release_handle=True):``
    also drops the event after that wait. A hook registered with `register_hook_after_wait` runs once, after the
    next wait (DeepEP V2 sorts a deterministic dispatch's rows there; tokenyard's rows come in that order
    already, docs/semantics.md "ElasticBuffer").
    """

    def __init__(self, event: Optional[EventHandle] = None,
                 extra_tensors: Optional[Sequence[Optional[torch.Tensor]]] = None):
        self.event = event
        self.extra_tensors = extra_tensors
        self.hook_after_wait: Optional[Callable[[], None]] = None
        self._release_handle_by_call = False

    def current_stream_wait(self, release_handle: bool = False) -> None:
        """The current stream waits for the event (nothing to wait for where there is none: CPU backends, a call
        without `async_finish`), then the hook registered after the wait runs; `release_handle` drops the event
        (and the tensors it keeps) afterwards."""
        if self.event is not None:
            self.event.current_stream_wait()
        if self.hook_after_wait is not None:
            hook, self.hook_after_wait = self.hook_after_wait, None
            hook()
        if release_handle:
            self.event = None

    def register_hook_after_wait(self, hook_after_wait: Callable[[], None]) -> None:
        """Run `hook_after_wait` after the next `current_stream_wait` (or the end of a ``with`` block).

        Raises:
            InvalidInputError: a hook is registered already.
        """
        if self.hook_after_wait is not None:
            raise InvalidInputError("a hook is registered on this EventOverlap already (one at a time, as in DeepEP)")
        self.hook_after_wait = hook_after_wait

    def __call__(self, release_handle: bool = False) -> "EventOverlap":
        """``with event(release_handle=True):``: the block's end drops the event after waiting; returns `self`."""
        self._release_handle_by_call = release_handle
        return self

    def __enter__(self) -> "EventOverlap":
        return self

    def __exit__(self, exc_type, exc_value, traceback) -> None:
        release, self._release_handle_by_call = self._release_handle_by_call, False
        self.current_stream_wait(release_handle=release)
