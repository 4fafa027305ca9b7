"""Events for overlapping communication with computation (DeepEP's `EventHandle` and `EventOverlap`)."""

from __future__ import annotations

from typing import Optional, Sequence

import torch


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
    """An event plus the tensors that must stay alive until it completes.

    ``with buffer.dispatch(..., async_finish=True)[-1]:`` runs the block while the communication is in
    flight and makes the current stream wait for it on exit, as in DeepEP.
    """

    def __init__(self, event: Optional[EventHandle] = None,
                 extra_tensors: Optional[Sequence[Optional[torch.Tensor]]] = None):
        self.event = event
        self.extra_tensors = extra_tensors

    def current_stream_wait(self) -> None:
        """The current stream waits for the event; a no-op where there is none (CPU backends)."""
        if self.event is not None:
            self.event.current_stream_wait()

    def __enter__(self) -> "EventOverlap":
        return self

    def __exit__(self, exc_type, exc_value, traceback) -> None:
        if self.event is not None:
            self.event.current_stream_wait()
