"""Bounded host-side waits, the one polling loop the host uses when it waits for the GPU or its peers."""

from __future__ import annotations

import time
from typing import Callable, Optional

SPINS_BEFORE_SLEEPING = 20000  # ~ms of polling first: a sleep overshoots by tens of microseconds
SLEEP_S = 20e-6


def wait_until(done: Callable[[], bool], timeout_s: float, before_poll: Optional[Callable[[], None]] = None) -> bool:
    """Poll `done` until it holds (-> True) or `timeout_s` has passed (-> False); `before_poll` runs before
    every poll (to raise a failure a kernel recorded, say)."""
    deadline, spins = time.monotonic() + timeout_s, 0
    while True:
        if before_poll is not None:
            before_poll()
        if done():
            return True
        spins += 1
        if spins > SPINS_BEFORE_SLEEPING:
            if time.monotonic() > deadline:
                return False
            time.sleep(SLEEP_S)
