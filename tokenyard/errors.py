"""Exception types raised by tokenyard.

Every error the library raises on purpose derives from :class:`TokenyardError`, so callers can catch
the whole family at once; each subclass also derives from the builtin that a plain-PyTorch user would
expect (``ValueError`` for bad input, ``TimeoutError`` for a stalled peer), so existing ``except``
clauses keep working.
"""

from __future__ import annotations


class TokenyardError(Exception):
    """Base class of every exception tokenyard raises deliberately."""


class InvalidInputError(TokenyardError, ValueError):
    """An argument has the wrong dtype, device, shape, layout or value. Raised before any communication."""


class CapacityError(TokenyardError, ValueError):
    """A request needs more communication buffer than the `Buffer` holds.

    Attributes:
        required_bytes: the buffer size the request needs.
        available_bytes: the size the buffer has.
        which: ``"num_nvl_bytes"`` or ``"num_rdma_bytes"``, the constructor argument to raise.
    """

    def __init__(self, message: str, *, required_bytes: int, available_bytes: int, which: str):
        super().__init__(message)
        self.required_bytes = required_bytes
        self.available_bytes = available_bytes
        self.which = which


class HandleError(TokenyardError, ValueError):
    """A handle was passed to a buffer that did not create it, or to the wrong kind of call."""


class BackendUnavailableError(TokenyardError, RuntimeError):
    """The requested backend cannot run here (no GPU, no peer access, no compiler...)."""


class CommTimeoutError(TokenyardError, TimeoutError):
    """A wait for a peer ran past its deadline.

    Attributes:
        rank: the rank that waited.
        peer: the rank it waited for (``-1`` when unknown or several).
        stage: the stage of the operation, e.g. ``"dispatch/notify"``.
    """

    def __init__(self, rank: int, peer: int, stage: str, detail: str = ""):
        who = f"peer rank {peer}" if peer >= 0 else "a peer"
        msg = f"rank {rank} timed out waiting for {who} at stage '{stage}'"
        if detail:
            msg += f": {detail}"
        super().__init__(msg)
        self.rank = rank
        self.peer = peer
        self.stage = stage


class RankMismatchError(TokenyardError, RuntimeError):
    """The ranks of a group made different calls (one skipped or added a call, or passed another shape),
    found before any data moved; raised on every rank alike.

    Attributes:
        ranks: the ranks grouped by the call each made, ``[[0, 2], [1]]``.
    """

    def __init__(self, message: str, ranks):
        super().__init__(message)
        self.ranks = ranks


class PeerLostError(TokenyardError, ConnectionError):
    """A peer left the group during a call (its process died, or its connection closed).

    Attributes:
        rank: the rank that noticed; stage: where.
    """

    def __init__(self, rank: int, stage: str, detail: str):
        super().__init__(f"rank {rank} lost a peer at stage '{stage}': {detail}. The group cannot be used any more: "
                         "make a new group, and a new Buffer on it")
        self.rank = rank
        self.stage = stage
