"""Agents' reports: who may send one, and that none is accepted twice.

An agent signs each report with its replica's secret (an HMAC of the
daemon's key and the replica id, so it never travels): the signature covers
the replica id, a time, a nonce and the body's exact bytes. A report copied
off the network is refused once its nonce has been seen, or once its time is
too far from the daemon's clock. The nonces outlive the daemon: each one
accepted is appended to a journal in the state directory, read back at start,
so that a report captured in the minutes before a restart is refused by the
restarted daemon too. What a report accepted here means for its replica is
:mod:`llmgw_slurm.reconciler.intake`'s business.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import time
from pathlib import Path
from typing import TextIO

from llmgw_slurm.auth.secrets import (
    REPORT_SCHEME,
    constant_time_equal,
    parse_report_auth,
    replica_secret,
    report_signature,
)
from llmgw_slurm.base.errors import ReportNotRecorded
from llmgw_slurm.base.fsutil import atomic_write

__all__ = ["REPORT_MAX_AGE_S", "ReportVerifier"]

log = logging.getLogger(__name__)

# How far a signed report's time may be from the daemon's clock (NTP keeps a
# cluster's clocks within a second; five minutes allows a slow one).
REPORT_MAX_AGE_S = 300.0


class ReportVerifier:
    """Checks a report's secret or signature; keeps the nonces of reports accepted lately."""

    def __init__(self, server_key: bytes, journal: Path | None = None) -> None:
        self.server_key = server_key
        # Nonces of signed reports accepted lately: a replayed report is refused.
        self._nonces: set[str] = set()
        self._nonces_order: collections.deque[tuple[float, str]] = collections.deque()
        self._journal = journal
        self._file: TextIO | None = None
        self._appended = 0
        if journal is not None:
            self._load(journal)

    def check_secret(self, replica_id: str, secret: str) -> None:
        """For in-process callers. Raises PermissionError on a bad secret."""
        if not constant_time_equal(secret, replica_secret(self.server_key, replica_id)):
            raise PermissionError("bad replica secret")

    def verify(
        self, replica_id: str, authorization: str, raw: bytes, *, secret: str | None = None
    ) -> None:
        """Accept a signed report (``raw``: the body's exact bytes) once.

        ``secret``: the signer's secret when it is not a replica's (a batch job's,
        :func:`llmgw_slurm.auth.secrets.batch_secret`); the nonces are shared either way.

        Raises PermissionError, saying why, on a malformed, wrong, old or replayed
        signature: a report copied off the network is refused, and the secret that
        signs it was never on the network. Raises ReportNotRecorded when its nonce
        cannot be journalled (the report is refused; the agent retries).
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
        if secret is None:
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
        # Journalled before it counts: a report accepted but not journalled could
        # be replayed after a restart. ReportNotRecorded: the agent sends it again.
        self._remember(now, key)
        self._nonces.add(key)
        self._nonces_order.append((now, key))

    # A line per accepted report ("TIME REPLICA:NONCE"), appended unsynced: a
    # daemon that crashes leaves its writes in the page cache; only a crash of
    # the machine loses the last ones, and its reboot outlasts the reports' age.
    # The file stays open between reports: appending needs no new descriptor,
    # so a daemon short of them still takes reports.
    def _load(self, journal: Path) -> None:
        horizon = time.time() - 2 * REPORT_MAX_AGE_S
        try:
            lines = journal.read_text().splitlines()
        except FileNotFoundError:
            lines = []
        except (OSError, UnicodeDecodeError) as err:
            log.warning("report nonces: cannot read %s (%s): starting without them", journal, err)
            lines = []
        for line in lines:
            at, _, key = line.partition(" ")
            with contextlib.suppress(ValueError):
                if float(at) >= horizon and key:
                    self._nonces.add(key)
                    self._nonces_order.append((float(at), key))
        self._compact()

    def _compact(self) -> None:
        """Rewrite the journal with the nonces still kept (at start and as it grows)."""
        assert self._journal is not None
        text = "".join(f"{at:.3f} {key}\n" for at, key in self._nonces_order)
        try:
            # Rare (at start, then once per thousands of reports): its fsyncs are cheap.
            atomic_write(self._journal, text, mode=0o600)
        except OSError as err:
            # The old file still holds every nonce kept: appending to it goes on,
            # and the rewrite is tried again after as many more reports.
            log.warning("report nonces: cannot rewrite %s: %s", self._journal, err)
        else:
            self._close_journal()
        self._appended = 0

    def _remember(self, at: float, key: str) -> None:
        if self._journal is None:
            return
        if self._appended > 4 * max(1000, len(self._nonces_order)):
            self._compact()
        try:
            if self._file is None:
                fd = os.open(self._journal, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
                self._file = os.fdopen(fd, "a", buffering=1)
            self._file.write(f"{at:.3f} {key}\n")
        except OSError as err:
            self._close_journal()
            raise ReportNotRecorded(
                f"the daemon cannot journal the report's nonce ({err.strerror or err}); "
                "send it again"
            ) from err
        self._appended += 1

    def close(self) -> None:
        """Close the journal (the daemon's end; reports after it reopen it)."""
        self._close_journal()

    def _close_journal(self) -> None:
        if self._file is not None:
            with contextlib.suppress(OSError):
                self._file.close()
            self._file = None

    @property
    def nonces_kept(self) -> int:
        """How many nonces are remembered (they are forgotten once too old to matter)."""
        return len(self._nonces)
