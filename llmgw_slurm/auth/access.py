"""Who may use which model: the catalog's ``access`` rules against a gateway key.

A key names a user and a Slurm account (:class:`~llmgw_slurm.auth.keys.KeyRecord`,
its ``project``); a model's :class:`~llmgw_slurm.catalog.Access` lists users,
Unix groups and accounts. Groups are the user's on the daemon's host
(``getgrouplist``: primary and supplementary), which on a cluster are the
site's directory's.

Why groups are looked up per user and cached, not carried in the key: a
user added to a group gets the models of that group without a new key, and
one removed loses them within :data:`GROUPS_TTL`. The lookup is a name
service call (files, sssd, LDAP): cached so that a request costs a dict
lookup, not a directory round trip.

A model the key may not use is answered exactly as an unknown model (404
``model_not_found``, and absent from ``/v1/models``), so that nobody learns
what exists; the refusal is logged and counted for the admin.
"""

from __future__ import annotations

import grp
import logging
import os
import pwd
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter

from llmgw_slurm.catalog import Access

if TYPE_CHECKING:
    # Only for annotations: the router imports this module.
    from llmgw_slurm.auth.keys import KeyRecord

__all__ = ["GROUPS_TTL", "AccessGuard", "unix_groups"]

_log = logging.getLogger(__name__)

# Seconds a user's groups are trusted before they are looked up again.
GROUPS_TTL = 300.0


def unix_groups(user: str) -> frozenset[str]:
    """The names of ``user``'s Unix groups; empty for a name that is no Unix user
    (an admin's key may name anyone)."""
    try:
        pw = pwd.getpwnam(user)
    except KeyError:
        return frozenset()
    names = set()
    for gid in os.getgrouplist(user, pw.pw_gid):
        try:
            names.add(grp.getgrgid(gid).gr_name)
        except KeyError:
            continue
    return frozenset(names)


class AccessGuard:
    """Answers "may this key use this model", with the user's groups cached."""

    def __init__(
        self,
        registry: CollectorRegistry,
        groups_of: Callable[[str], frozenset[str]] = unix_groups,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._groups_of = groups_of
        self._clock = clock
        self._groups: dict[str, tuple[float, frozenset[str]]] = {}
        self.denied = Counter(
            "llmgw_access_denied",
            "Requests refused because the key may not use the model (answered as unknown).",
            ["model"],
            registry=registry,
        )

    def groups(self, user: str) -> frozenset[str]:
        now = self._clock()
        hit = self._groups.get(user)
        if hit is not None and now - hit[0] < GROUPS_TTL:
            return hit[1]
        found = self._groups_of(user)
        self._groups[user] = (now, found)
        return found

    def allows(self, access: Access | None, key: KeyRecord | None) -> bool:
        """Whether ``key`` may use a model with ``access`` rules (None: everyone).

        Without a key (a gateway with keys off) nobody is known, so a model
        with rules is nobody's.
        """
        if access is None:
            return True
        if key is None:
            return False
        if key.user in access.users or (key.project and key.project in access.accounts):
            return True
        return bool(access.groups) and not self.groups(key.user).isdisjoint(access.groups)

    def refused(self, model: str, key: KeyRecord | None) -> None:
        """Log and count a request for ``model`` that ``key`` may not use."""
        self.denied.labels(model).inc()
        who = (
            f"key {key.key_id} (user {key.user}, account {key.project or '-'})" if key else "no key"
        )
        _log.warning("access: %s may not use model %s; answered as unknown", who, model)
