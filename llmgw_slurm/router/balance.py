"""Prefix-aware replica choice: consistent hashing with bounded loads.

A model whose catalog entry says ``routing: {policy: prefix}`` sends requests
whose prompts begin alike to the same replica, so that the engine's prefix
cache answers the shared part (a long system prompt is prefilled once per
replica instead of once per request). Least-outstanding balancing, the
default, spreads such requests over every replica and each recomputes it.

The key is the first ``prefix_chars`` characters of the prompt's text (the
messages in order, or the prompt, or the input). It is hashed onto a ring on
which each replica has ``VNODES`` points; the request goes to the first
replica clockwise whose load, counting this request, stays within
``ceil(load_factor * (total load + 1) / replicas)`` (Mirrokni, Thorup and
Zadimoghaddam, "Consistent Hashing with Bounded Loads", 2018). So no replica
is ever above the bound, a hot prefix spills over to the same next replica
(whose cache then warms for it too), and a replica joining or leaving moves
only the keys of the ring's arcs it takes or gives up: about 1/(n+1) of them.

The key is set per request in :data:`REQUEST_KEY` (a context variable: the
gateway's handler runs in a task of its own), so that the gateway's replica
choice, called from several places, reads it without passing it along.
"""

from __future__ import annotations

import bisect
import hashlib
import math
from collections.abc import Iterator, Sequence
from contextvars import ContextVar
from typing import Any

__all__ = ["REQUEST_KEY", "VNODES", "Ring", "choose", "prefix_key"]

# Points per replica: with 100 the arcs of n replicas differ by some 10-20%,
# and a ring of 8 replicas is 800 points (a few microseconds to search).
VNODES = 100

REQUEST_KEY: ContextVar[str | None] = ContextVar("llmgw_prefix_key", default=None)


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
        if not self._ids:
            return
        start = bisect.bisect(self._hashes, _hash(key))
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


def choose(ids: Sequence[str], loads: Sequence[int], key: str, load_factor: float) -> int:
    """The index in ``ids`` of the replica for ``key``, given each one's load.

    ``load_factor`` >= 1 always finds one within the bound (the least loaded
    replica is); below 1 (refused by the catalog) it falls back to the least
    loaded.
    """
    limit = bound(loads, load_factor)
    where = {rid: i for i, rid in enumerate(ids)}
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
