"""The hold queue: requests waiting for a cold model to start, and who may take how much.

A request for a model with no ready replica waits for one (the gateway's
``_hold``), holding a connection and a coroutine. The queue is bounded, and
so is each party's share of a model's queue, checked in this order, each
with a 429 of its own that names the share (and ``Retry-After``):

- the model's queue (``router.max_held``) and every model's together
  (``max_held_total``): ``too_many_held_requests``;
- one key's share (``max_held_per_key``, a quarter of ``max_held`` by
  default): ``too_many_held_requests_for_key``;
- one user's, over all their keys (``max_held_per_user``, by default the
  same as a key's): ``too_many_held_requests_for_user``. Before it, a user
  who took several keys with ``llmgw login`` took a key's share with each;
- one Slurm account's, over all its users (``max_held_per_account``, half
  of ``max_held`` by default): ``too_many_held_requests_for_account``, so
  that one group cannot fill a cold model's queue and leave no room for
  anyone else's request when the model comes up.

Shares count per model: waiting for one model leaves another's queue alone.
"""

from __future__ import annotations

from dataclasses import dataclass

from llmgw_slurm.auth.keys import KeyRecord
from llmgw_slurm.config import RouterConfig
from llmgw_slurm.router.answers import Reply, error

__all__ = ["HoldQueue", "Place"]


def _too_many(message: str, code: str, retry_after: int | None) -> Reply:
    headers = {"Retry-After": str(retry_after)} if retry_after is not None else None
    return error(429, message, "rate_limit_error", code, headers)


# (whose, the share's words in a refusal, its config field): in the order checked.
_SHARES = (
    ("key", "Your key", "max_held_per_key"),
    ("user", "User {name}", "max_held_per_user"),
    ("account", "Slurm account {name}", "max_held_per_account"),
)


@dataclass
class Place:
    """One request's place in a model's queue, from :meth:`HoldQueue.take` until
    :meth:`release` (once; later calls do nothing)."""

    queue: HoldQueue
    model: str
    shares: tuple[tuple[str, str, str], ...]  # (whose, name, model)
    taken: bool = True

    def release(self) -> None:
        if self.taken:
            self.taken = False
            self.queue._leave(self)


class HoldQueue:
    """How many requests wait for each model, in all, and per key, user and account."""

    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        self.held: dict[str, int] = {}  # per model (0 once its queue emptied)
        self.total = 0
        self._shares: dict[tuple[str, str, str], int] = {}

    def cap(self, whose: str) -> int:
        """The most requests one ``whose`` ("key", "user", "account") may have waiting
        for one model."""
        cfg = self.config
        quarter = max(1, cfg.max_held // 4)
        if whose == "key":
            return cfg.max_held_per_key or quarter
        if whose == "user":
            return cfg.max_held_per_user or cfg.max_held_per_key or quarter
        return cfg.max_held_per_account or max(1, cfg.max_held // 2)

    def waiting(self, whose: str, name: str, model: str) -> int:
        """How many requests of ``whose`` ``name`` wait for ``model``."""
        return self._shares.get((whose, name, model), 0)

    def take(self, model: str, key: KeyRecord | None) -> Place | Reply:
        """A place in ``model``'s queue for a request of ``key`` (None: keys off), or
        the 429 naming the queue or share that is full."""
        cfg = self.config
        if self.held.get(model, 0) >= cfg.max_held or self.total >= cfg.max_held_total:
            return _too_many(
                f"Too many requests are waiting for model '{model}' to start; try again later.",
                "too_many_held_requests",
                None,
            )
        shares = _shares_of(key, model)
        for (whose, words, field), share in zip(_SHARES, shares, strict=False):
            n = self._shares.get(share, 0)
            if share[1] and n >= self.cap(whose):
                return _too_many(
                    f"{words.format(name=share[1])} has {n} requests waiting for model "
                    f"'{model}' to start, the most one {whose} may (router.{field}); try "
                    "again when it is ready.",
                    f"too_many_held_requests_for_{whose}",
                    cfg.retry_after,
                )
        for share in shares:
            if share[1]:
                self._shares[share] = self._shares.get(share, 0) + 1
        self.held[model] = self.held.get(model, 0) + 1
        self.total += 1
        return Place(self, model, shares)

    def _leave(self, place: Place) -> None:
        for share in place.shares:
            if not share[1]:
                continue
            n = self._shares.get(share, 0) - 1
            if n > 0:
                self._shares[share] = n
            else:
                self._shares.pop(share, None)
        self.held[place.model] -= 1
        self.total -= 1


def _shares_of(key: KeyRecord | None, model: str) -> tuple[tuple[str, str, str], ...]:
    """The shares of ``model``'s queue a request of ``key`` counts in (an empty
    name: none, e.g. a key without an account)."""
    if key is None:
        return ()
    return (("key", key.key_id, model), ("user", key.user, model), ("account", key.project, model))
