"""How many connections a listener holds, and from whom: the bounds, as counts.

Pure bookkeeping, no sockets: :mod:`llmgw_slurm.guard.accept` asks
:meth:`ConnectionLimiter.admit` before it builds a protocol for an accepted
connection, and the connection's :class:`Seat` is released when it closes.
A listener at its total stops accepting (the kernel's backlog holds what
comes meanwhile) and starts again at the first release; a peer at its own
bound has each further connection closed at once, so one user's flood
costs the others nothing but the listener's total.
"""

from __future__ import annotations

import collections
from collections.abc import Callable

__all__ = ["ConnectionLimiter", "Seat"]


class Seat:
    """One admitted connection's place; :meth:`release` gives it back (once)."""

    __slots__ = ("_limiter", "peer")

    def __init__(self, limiter: ConnectionLimiter, peer: str) -> None:
        self._limiter: ConnectionLimiter | None = limiter
        self.peer = peer

    def release(self) -> None:
        limiter, self._limiter = self._limiter, None
        if limiter is not None:
            limiter._release(self.peer)


class ConnectionLimiter:
    """Connections of one listener: at most ``total``, at most ``per_peer`` per peer.

    ``head_timeout``: seconds a connection may take to send a whole request
    head (the accept layer enforces it; kept here so that every protocol
    built on a listener reads one value). Counts of what was refused and why
    are kept for ``/metrics``.
    """

    def __init__(self, name: str, total: int, per_peer: int, head_timeout: float) -> None:
        if total < 1 or per_peer < 1 or head_timeout <= 0:
            raise ValueError(
                f"connections of {name}: total {total} and per_peer {per_peer} must be at "
                f"least 1, head_timeout {head_timeout} above 0"
            )
        self.name = name
        self.total = total
        self.per_peer = min(per_peer, total)
        self.head_timeout = head_timeout
        self.open = 0
        self._by_peer: collections.Counter[str] = collections.Counter()
        # Connections closed unserved, by why: "peer" (its peer at its bound),
        # "total" (accepted in the batch that filled the listener), "head_timeout"
        # (no whole request head in time), "closed" (its client closed it
        # before it was accepted).
        self.refused: collections.Counter[str] = collections.Counter()
        # Times the listener filled up and stopped accepting; accept() failures
        # (EMFILE and the like), after which it waits a moment.
        self.pauses = 0
        self.accept_errors = 0
        self._on_room: Callable[[], None] | None = None

    @property
    def full(self) -> bool:
        return self.open >= self.total

    def peers(self) -> int:
        return len(self._by_peer)

    def held_by(self, peer: str) -> int:
        return self._by_peer.get(peer, 0)

    def on_room(self, callback: Callable[[], None] | None) -> None:
        """``callback`` is called when a release leaves the listener below its total."""
        self._on_room = callback

    def admit(self, peer: str) -> Seat | None:
        """A ticket for a connection from ``peer``, or None: close it unserved."""
        if self.open >= self.total:
            # The accept layer stops accepting first; a connection accepted in
            # the same batch as the last free place is refused here.
            self.refused["total"] += 1
            return None
        if self._by_peer[peer] >= self.per_peer:
            self.refused["peer"] += 1
            return None
        self._by_peer[peer] += 1
        self.open += 1
        if self.open >= self.total:
            self.pauses += 1
        return Seat(self, peer)

    def _release(self, peer: str) -> None:
        was_full = self.open >= self.total
        self.open -= 1
        left = self._by_peer[peer] - 1
        if left > 0:
            self._by_peer[peer] = left
        else:
            del self._by_peer[peer]
        if was_full and self._on_room is not None:
            self._on_room()
