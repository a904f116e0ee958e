"""Prefix-aware replica choice: consistent hashing with bounded loads.

A model whose catalog entry says ``routing: {policy: prefix}`` sends requests
whose prompts begin alike to the same replica, so that the engine's prefix
cache answers the shared part (a long system prompt is prefilled once per
replica instead of once per request). Least-outstanding balancing, the
default, spreads such requests over every replica and each recomputes it.

The key is the first ``prefix_chars`` characters of the prompt's text (the
messages in order, or the prompt, or the input). It is hashed onto a ring on
which each replica has ``VNODES`` points. Two bounds, after Mirrokni, Thorup
and Zadimoghaddam ("Consistent Hashing with Bounded Loads", 2018):

- **Keys** (what fills a replica's cache): :class:`Placement` remembers the
  keys seen in the last ``KEY_WINDOW_S`` (the newest ``KEY_CAPACITY``) and
  the replica each lives on. A key lives on the first replica clockwise from
  its point that holds fewer than ``ceil(key_factor * active keys / replicas)``
  keys. Plain consistent hashing leaves the split to chance (8 prefixes on 2
  replicas: 6 or more on one of them 29% of the time, and that replica's
  cache thrashes while the other's idles); the bound makes it even.
- **Load** (requests in flight): a request whose key's replica already has
  ``ceil(load_factor * (total load + 1) / replicas)`` goes on clockwise to
  the first replica under that bound (so a hot prefix spills to the same
  next replica, whose cache then warms for it too), and else to the least
  loaded one. The key stays where it lives.

A replica joining takes the keys whose ring arcs it takes (about 1/(n+1) of
them), plus what the key bound sends it; a replica leaving gives up only its
own keys, and keys that had walked past a full replica walk back as room
opens. Keys move lazily, when next used.

The key is made at admission (``admit``, in the request's plan) and passed
to the replica choice (``replicas.Replicas.pick``).
"""

from __future__ import annotations

import bisect
import hashlib
import math
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from typing import Any

__all__ = [
    "KEY_CAPACITY",
    "KEY_WINDOW_S",
    "VNODES",
    "Placement",
    "Ring",
    "choose",
    "prefix_key",
]

# Points per replica: with 100 the arcs of n replicas differ by some 10-20%,
# and a ring of 8 replicas is 800 points (a few microseconds to search).
VNODES = 100

# A key unused this long no longer counts as active: its prompt has most
# likely left the engine's cache (an engine's cache turns over in seconds to
# minutes under load), and the room it took goes to the keys in use.
KEY_WINDOW_S = 600.0
# The most keys a model's placement remembers (the least recently used go
# first): bounds its memory (a key is kept as its 8-byte hash) with many
# distinct prompts, where an even split of keys matters least.
KEY_CAPACITY = 4096

def _hash(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")


class Ring:
    """The hash ring of a set of replica ids."""

    def __init__(self, ids: Sequence[str], vnodes: int = VNODES) -> None:
        points = sorted((_hash(f"{rid}#{i}"), rid) for rid in ids for i in range(vnodes))
        self._hashes = [h for h, _ in points]
        self._ids = [rid for _, rid in points]
        self.size = len(set(ids))

    def walk(self, key: str) -> Iterator[str]:
        """Every replica once, clockwise from the key's point."""
        return self.walk_from(_hash(key))

    def walk_from(self, point: int) -> Iterator[str]:
        """Every replica once, clockwise from ``point``."""
        if not self._ids:
            return
        start = bisect.bisect(self._hashes, point)
        seen: set[str] = set()
        n = len(self._ids)
        for i in range(n):
            rid = self._ids[(start + i) % n]
            if rid not in seen:
                seen.add(rid)
                yield rid
                if len(seen) == self.size:
                    return


# Rings by replica set: a model's set changes only when a replica joins or
# leaves, and building one costs far more than a lookup.
_rings: dict[tuple[str, ...], Ring] = {}
_MAX_RINGS = 256


def _ring(ids: Sequence[str]) -> Ring:
    key = tuple(sorted(ids))
    ring = _rings.get(key)
    if ring is None:
        if len(_rings) >= _MAX_RINGS:
            _rings.clear()
        ring = _rings[key] = Ring(key)
    return ring


def bound(loads: Sequence[int], load_factor: float) -> int:
    """The most requests a replica may have, counting the one being placed."""
    return math.ceil(load_factor * (sum(loads) + 1) / len(loads))


def key_bound(active: int, replicas: int, key_factor: float) -> int:
    """The most keys a replica may hold, of ``active`` keys (the one being placed counted)."""
    return math.ceil(key_factor * active / replicas)


class Placement:
    """Which replica each active key lives on, no replica above the key bound.

    One per model. ``place`` is called with the model's replicas (those that
    may take new work: draining ones left out, so their keys move) for each
    request's key; a replica not in the list counts as gone, and its keys
    are placed again when next used. ``key_factor`` >= 1 (the catalog
    refuses less): at 1 the keys split as evenly as they can.
    """

    def __init__(
        self,
        key_factor: float,
        *,
        window_s: float = KEY_WINDOW_S,
        capacity: int = KEY_CAPACITY,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.key_factor = key_factor
        self.window_s = window_s
        self.capacity = capacity
        self._clock = clock
        # Key hash -> (replica id, last use), least recently used first.
        self._keys: OrderedDict[int, tuple[str, float]] = OrderedDict()
        self._count: dict[str, int] = {}

    def _drop(self, point: int) -> None:
        rid, _ = self._keys.pop(point)
        left = self._count[rid] - 1
        if left:
            self._count[rid] = left
        else:
            del self._count[rid]

    def _expire(self, now: float) -> None:
        while self._keys:
            point, (_, used) = next(iter(self._keys.items()))
            if now - used < self.window_s and len(self._keys) <= self.capacity:
                return
            self._drop(point)

    def counts(self, ids: Sequence[str]) -> list[int]:
        """How many active keys live on each of ``ids``."""
        self._expire(self._clock())
        return [self._count.get(r, 0) for r in ids]

    def home(self, key: str) -> str | None:
        """The replica ``key`` lives on now (it may since have gone), None if not active."""
        got = self._keys.get(_hash(key))
        return got[0] if got is not None else None

    def place(self, ids: Sequence[str], key: str) -> str:
        """The replica ``key`` lives on among ``ids`` (moving it if it must)."""
        now = self._clock()
        self._expire(now)
        point = _hash(key)
        got = self._keys.get(point)
        cur = got[0] if got is not None else None
        present = set(ids)
        active = sum(self._count.get(r, 0) for r in present)
        if cur not in present:
            active += 1
        limit = key_bound(active, len(present), self.key_factor)
        home = None
        for rid in _ring(ids).walk_from(point):
            have = self._count.get(rid, 0)
            # Its own replica counts it already; another must have room for it.
            if have + (0 if rid == cur else 1) <= limit:
                home = rid
                break
        if home is None:
            # Only below key_factor 1 (or no replicas): the fewest keys.
            home = min(ids, key=lambda r: self._count.get(r, 0))
        if got is not None and cur != home:
            self._drop(point)
        if cur != home:
            self._count[home] = self._count.get(home, 0) + 1
        self._keys[point] = (home, now)
        self._keys.move_to_end(point)
        if len(self._keys) > self.capacity:
            self._expire(now)
        return home


def choose(
    ids: Sequence[str],
    loads: Sequence[int],
    key: str,
    load_factor: float,
    home: str | None = None,
) -> int:
    """The index in ``ids`` of the replica for ``key``, given each one's load.

    ``home`` (the key's replica from :class:`Placement`) first, if it is in
    ``ids`` and within the load bound; else the first replica clockwise from
    the key within it. ``load_factor`` >= 1 always finds one within the
    bound (the least loaded replica is); below 1 (refused by the catalog) it
    falls back to the least loaded.
    """
    limit = bound(loads, load_factor)
    where = {rid: i for i, rid in enumerate(ids)}
    if home is not None and home in where and loads[where[home]] + 1 <= limit:
        return where[home]
    for rid in _ring(ids).walk(key):
        i = where[rid]
        if loads[i] + 1 <= limit:
            return i
    return min(range(len(ids)), key=lambda i: loads[i])


def _texts(value: Any, out: list[str], budget: int) -> int:
    """Append the strings in ``value`` depth first, until ``budget`` characters."""
    if budget <= 0:
        return budget
    if isinstance(value, str):
        out.append(value[:budget])
        return budget - min(len(value), budget) - 1
    if isinstance(value, dict):
        for v in value.values():
            budget = _texts(v, out, budget)
            if budget <= 0:
                break
    elif isinstance(value, list):
        for v in value:
            budget = _texts(v, out, budget)
            if budget <= 0:
                break
    elif isinstance(value, int | float) and not isinstance(value, bool):
        # Token ids (a prompt given as a list of ints).
        out.append(str(value))
        budget -= len(out[-1]) + 1
    return budget


# The fields that carry the prompt, in the order an engine reads them into it.
_PROMPT_FIELDS = ("instructions", "messages", "prompt", "input", "query", "text_1")


def prefix_key(body: dict[str, Any], prefix_chars: int) -> str | None:
    """The first ``prefix_chars`` characters of the request's prompt; None without one."""
    out: list[str] = []
    budget = prefix_chars
    for name in _PROMPT_FIELDS:
        if name in body:
            budget = _texts(body[name], out, budget)
            if budget <= 0:
                break
    if not out:
        return None
    return "\x00".join(out)[:prefix_chars]
