"""Failures the daemon lives through: logged with their traceback, counted, survived.

No exception in a reconcile pass, a background task or a report handler
ends the daemon: the pass loop, the usage writer and the report routes
catch what they did not foresee here, and the next pass, flush or report
runs. ``/metrics`` shows how often (``llmgw_daemon_faults_total{where}``),
so that a fault that repeats is seen rather than lived with quietly.
"""

from __future__ import annotations

import collections
import contextlib
import logging
from collections.abc import Iterator

__all__ = ["Faults"]

log = logging.getLogger(__name__)


class Faults:
    """Unexpected failures by where they happened ("pass", "report", "usage", ...)."""

    def __init__(self) -> None:
        self.counts: collections.Counter[str] = collections.Counter()

    def record(self, where: str, err: BaseException) -> None:
        """Log ``err`` with its traceback and count it; the caller carries on."""
        self.counts[where] += 1
        log.error(
            "unexpected failure in %s (%d so far); the daemon carries on",
            where,
            self.counts[where],
            exc_info=err,
        )

    @contextlib.contextmanager
    def caught(self, where: str) -> Iterator[None]:
        """Run the block; an Exception in it is recorded, not raised (cancellation is)."""
        try:
            yield
        except Exception as err:  # the point: nothing escapes
            self.record(where, err)
