"""Who may act on Slurm: the fence every sbatch and scancel of the reconciler goes through.

With one daemon (no ``database:``) it always may: :class:`Unfenced`. With
several daemons on one database (``llmgw_slurm.db.lease``) only the holder of
the reconciler's lease may, and only while it knows it holds it: before
each command :meth:`Fence.begin` writes the action, under the lease, to the
database, and a daemon that cannot (its lease gone, its database out of
reach, its own deadline passed) does not act. The epoch of the lease goes
into the job's comment, so ``sacct`` shows which leader submitted each job.

A new leader waits out the actions an earlier one began and did not finish
(:meth:`Fence.open_submits`): a replica whose sbatch may still be on its way
to slurmctld is not submitted a second time.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from typing import Protocol

__all__ = ["Fence", "OpenSubmit", "Ticket", "Unfenced"]


@dataclass(frozen=True)
class Ticket:
    """An action the fence let through: its row (0 when nothing is recorded) and epoch."""

    action_id: int
    epoch: int | None


@dataclass(frozen=True)
class OpenSubmit:
    """A submission an earlier leader began and never said it finished."""

    model: str
    replica_id: str
    target: str  # the job name


class Fence(Protocol):
    def acting(self) -> bool:
        """Whether this daemon may act now (its own view; :meth:`begin` asks the database)."""
        ...

    @property
    def epoch(self) -> int | None:
        """The lease's epoch while this daemon holds it; None otherwise."""
        ...

    async def begin(self, kind: str, model: str, replica_id: str, target: str) -> Ticket | None:
        """Record an action about to be taken; None: this daemon must not take it."""
        ...

    async def end(self, ticket: Ticket, outcome: str) -> None:
        """The action is done (``outcome`` says how); never raises."""
        ...

    async def open_submits(self, listed: Collection[str]) -> list[OpenSubmit]:
        """Earlier leaders' submissions still open, whose jobs ``listed`` (job names
        listed now) does not show; those it shows are closed here."""
        ...


class Unfenced:
    """One daemon, no database: always acting, nothing recorded."""

    epoch: int | None = None

    def acting(self) -> bool:
        return True

    async def begin(self, kind: str, model: str, replica_id: str, target: str) -> Ticket | None:
        return Ticket(0, None)

    async def end(self, ticket: Ticket, outcome: str) -> None:
        return None

    async def open_submits(self, listed: Collection[str]) -> list[OpenSubmit]:
        return []
