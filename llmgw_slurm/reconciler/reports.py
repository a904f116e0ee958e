"""Agents' reports: who may send one, and that none is accepted twice.

An agent signs each report with its replica's secret (an HMAC of the
daemon's key and the replica id, so it never travels): the signature covers
the replica id, a time, a nonce and the body's exact bytes. A report copied
off the network is refused once its nonce has been seen, or once its time is
too far from the daemon's clock. What a report accepted here means for its
replica is :mod:`llmgw_slurm.reconciler.intake`'s business.
"""

from __future__ import annotations

import collections
import time

from llmgw_slurm.secrets import (
    REPORT_SCHEME,
    constant_time_equal,
    parse_report_auth,
    replica_secret,
    report_signature,
)

__all__ = ["REPORT_MAX_AGE_S", "ReportVerifier"]

# How far a signed report's time may be from the daemon's clock (NTP keeps a
# cluster's clocks within a second; five minutes allows a slow one).
REPORT_MAX_AGE_S = 300.0


class ReportVerifier:
    """Checks a report's secret or signature; keeps the nonces of reports accepted lately."""

    def __init__(self, server_key: bytes) -> None:
        self.server_key = server_key
        # Nonces of signed reports accepted lately: a replayed report is refused.
        self._nonces: set[str] = set()
        self._nonces_order: collections.deque[tuple[float, str]] = collections.deque()

    def check_secret(self, replica_id: str, secret: str) -> None:
        """For in-process callers. Raises PermissionError on a bad secret."""
        if not constant_time_equal(secret, replica_secret(self.server_key, replica_id)):
            raise PermissionError("bad replica secret")

    def verify(self, replica_id: str, authorization: str, raw: bytes) -> None:
        """Accept a signed report (``raw``: the body's exact bytes) once.

        Raises PermissionError, saying why, on a malformed, wrong, old or replayed
        signature: a report copied off the network is refused, and the secret that
        signs it was never on the network.
        """
        parsed = parse_report_auth(authorization)
        if parsed is None:
            raise PermissionError(
                f"malformed signature; expected '{REPORT_SCHEME} ts=,nonce=,sig='"
            )
        ts, nonce, sig = parsed
        now = time.time()
        if abs(now - ts) > REPORT_MAX_AGE_S:
            raise PermissionError(
                f"report signed at {ts}, {now - ts:+.0f} s from the daemon's clock "
                f"(limit {REPORT_MAX_AGE_S:g} s): are the login and compute nodes' clocks set?"
            )
        secret = replica_secret(self.server_key, replica_id)
        if not constant_time_equal(sig, report_signature(secret, replica_id, ts, nonce, raw)):
            raise PermissionError("bad signature")
        key = f"{replica_id}:{nonce}"
        # Forget nonces older than any report still accepted (in order of arrival,
        # which follows their times to within the allowed skew).
        while self._nonces_order and self._nonces_order[0][0] < now - 2 * REPORT_MAX_AGE_S:
            self._nonces.discard(self._nonces_order.popleft()[1])
        if key in self._nonces:
            raise PermissionError("replayed report")
        self._nonces.add(key)
        self._nonces_order.append((now, key))

    @property
    def nonces_kept(self) -> int:
        """How many nonces are remembered (they are forgotten once too old to matter)."""
        return len(self._nonces)
