"""Bounded host-side waits, the one polling loop the host uses when it waits for the GPU or its peers."""

from __future__ import annotations

import time
from typing import Callable, Optional

POLL_S = 1e-3  # polling without a pause first: a sleep overshoots by tens of microseconds
SLEEP_S = 20e-6  # then a pause between polls


def wait_until(done: Callable[[], bool], timeout_s: float, before_poll: Optional[Callable[[], None]] = None) -> bool:
    """Poll `done` until it holds (-> True) or `timeout_s` has passed (-> False); `before_poll` runs before
    every poll (to raise a failure a kernel recorded, say)."""
    start = time.monotonic()
    deadline, pauses_from = start + timeout_s, start + POLL_S
    while True:
        if before_poll is not None:
            before_poll()
        if done():
            return True
        now = time.monotonic()
        if now > pauses_from:
            if now > deadline:
                return False
            time.sleep(SLEEP_S)
