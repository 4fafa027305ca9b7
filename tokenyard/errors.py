"""Exception types raised by tokenyard.

Every error the library raises on purpose derives from :class:`TokenyardError`, so callers can catch
the whole family at once; each subclass also derives from the builtin that a plain-PyTorch user would
expect (``ValueError`` for bad input, ``TimeoutError`` for a stalled peer), so existing ``except``
clauses keep working. Errors of communication among the ranks (a late, lost or disagreeing peer) derive from
:class:`CommError`, which names the rank that raised it, the peer (``-1`` where not one known rank) and the stage.
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


class CommError(TokenyardError):
    """A call among the ranks of a group failed: a peer was late, lost or made another call, or the group's
    backend refused a collective. Every subclass says where.

    Attributes:
        rank: the rank that raised it.
        peer: the rank it waited for or lost, ``-1`` when unknown or several (gloo names a lost peer by its
            address only; a mismatch involves every rank, named in `RankMismatchError.ranks`).
        stage: the stage of the operation, ``"<operation>/<step>"``, e.g. ``"dispatch/notify"`` or
            ``"Buffer/agree"`` or ``"Buffer/exchange"`` (a Buffer being made).
    """

    def __init__(self, message: str, *, rank: int, peer: int = -1, stage: str):
        super().__init__(message)
        self.rank = rank
        self.peer = peer
        self.stage = stage

    def __reduce__(self):  # pickled with its attributes (to another process), whatever the subclass's arguments
        return _restore, (type(self), self.args, self.__dict__)


def _restore(cls, args, state):
    error = cls.__new__(cls)
    error.args = args
    error.__dict__.update(state)
    return error


class CommTimeoutError(CommError, TimeoutError):
    """A wait for a peer ran past its deadline (attributes: `CommError`'s)."""

    def __init__(self, rank: int, peer: int, stage: str, detail: str = ""):
        who = f"peer rank {peer}" if peer >= 0 else "a peer"
        msg = f"rank {rank} timed out waiting for {who} at stage '{stage}'"
        if detail:
            msg += f": {detail}"
        super().__init__(msg, rank=rank, peer=peer, stage=stage)


class RankMismatchError(CommError, RuntimeError):
    """The ranks of a group made different calls (one skipped or added a call, or passed another shape),
    found before any data moved; raised on every rank alike.

    Attributes:
        ranks: the ranks grouped by the call each made, ``[[0, 2], [1]]``; and `CommError`'s (`peer` is -1).
    """

    def __init__(self, message: str, ranks, *, rank: int = -1, stage: str = ""):
        super().__init__(message, rank=rank, peer=-1, stage=stage)
        self.ranks = ranks


class PeerLostError(CommError, ConnectionError):
    """A peer left the group during a call (its process died, or its connection closed); the group cannot be
    used again (attributes: `CommError`'s; `peer` is -1 where, as over gloo, the lost peer is known by its
    address only, which the message gives)."""

    def __init__(self, rank: int, stage: str, detail: str, peer: int = -1):
        who = f"peer rank {peer}" if peer >= 0 else "a peer"
        super().__init__(f"rank {rank} lost {who} at stage '{stage}': {detail}. The group cannot be used any more: "
                         "make a new group, and a new Buffer on it", rank=rank, peer=peer, stage=stage)


class CollectiveRefusedError(CommError, RuntimeError):
    """The group's backend refused this rank's part of a collective (gloo's own check of the sizes failed, say:
    the ranks' sizes for it disagree), with no peer lost: this rank sent nothing for it. Where every rank refused
    it alike the group stays usable; a peer that sent its part waits for this rank's instead, until its deadline
    (then the group holds that collective, unfinished). Attributes: `CommError`'s (`peer` is -1)."""

    def __init__(self, rank: int, stage: str, detail: str):
        super().__init__(f"rank {rank}: the group's backend refused this rank's part of the collective at stage "
                         f"'{stage}': {detail}. No peer was lost and this rank sent nothing for it; a peer that made "
                         "its part waits for this rank's until its deadline", rank=rank, peer=-1, stage=stage)
