"""Reports to the daemon: steps, ready, heartbeats, draining, failed, stopped.

``POST {daemon_url}/internal/v1/replicas/{replica_id}/report``, signed with
the replica secret (``Authorization: LLMGW-HMAC ts=,nonce=,sig=``, see
:func:`llmgw_slurm.auth.secrets.sign_report`): the secret itself never travels,
and the daemon refuses a report that is old or seen before. The daemon being
away (restarting, or the login node rebooting) is normal: a report is
retried with backoff, and a report that never gets through is logged, never
raised. The engine keeps serving either way; the daemon adopts the replica
when it comes back.

The daemon's answer is signed back with the same secret, bound to the
report's nonce (``X-Llmgw-Reply-Sig``): an answer that does not check (a
squatter on the daemon's port while it is away, a rewrite on the network
path) is logged and ignored, its ``drain`` never obeyed.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import secrets
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp

from llmgw_slurm.auth.secrets import REPLY_HEADER, constant_time_equal, reply_signature, sign_report

__all__ = ["EVENTS", "DaemonClient", "ReportAnswer", "daemon_urls"]

log = logging.getLogger(__name__)

EVENTS = ("step", "ready", "heartbeat", "draining", "failed", "stopped", "progress")
STATUSES = ("started", "done", "failed")


def daemon_urls(text: str) -> list[str]:
    """``LLMGW_DAEMON_URL``'s URLs: one, or several separated by commas (several daemons
    sharing a database: any of them takes a report, so an agent whose daemon has gone
    reports to the next)."""
    return [u.strip().rstrip("/") for u in text.split(",") if u.strip()]


@dataclass(frozen=True)
class ReportAnswer:
    ok: bool
    drain: bool


class DaemonClient:
    def __init__(
        self,
        session: aiohttp.ClientSession,
        daemon_url: str,
        replica_id: str,
        secret: str,
        node: str,
        job_id: str,
        timeout_s: float = 10.0,
        kind: str = "replicas",
    ) -> None:
        self._session = session
        # kind: "replicas", or "batches" for a Batch API job (its id in replica_id).
        self.urls = [f"{u}/internal/v1/{kind}/{replica_id}/report" for u in daemon_urls(daemon_url)]
        # The one that took the last report: tried first.
        self._at = 0
        self.replica_id = replica_id
        self._secret = secret
        self.node = node
        self.job_id = job_id
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)

    def body(
        self,
        event: str,
        *,
        step: str | None = None,
        status: str | None = None,
        url: str | None = None,
        message: str | None = None,
        elapsed_s: float | None = None,
        cert: str | None = None,
        counts: dict[str, int] | None = None,
    ) -> dict[str, Any]:
        if event not in EVENTS:
            raise ValueError(f"unknown report event {event!r}")
        if status is not None and status not in STATUSES:
            raise ValueError(f"unknown report status {status!r}")
        body: dict[str, Any] = {
            "event": event,
            "step": step,
            "status": status,
            "url": url,
            "node": self.node,
            "job_id": self.job_id,
            "message": message[-4000:] if message else message,
            "elapsed_s": round(elapsed_s, 3) if elapsed_s is not None else None,
            # The engine's certificate (public), which the daemon pins: it comes
            # in a signed report, so only this replica's agent can name it.
            "cert": cert,
        }
        if counts is not None:
            # A batch job's progress: completed, failed, tokens.
            body["counts"] = counts
        return body

    @property
    def url(self) -> str:
        return self.urls[self._at % len(self.urls)]

    async def send_once(self, body: dict[str, Any]) -> ReportAnswer | None:
        """One attempt at each daemon in turn, from the last that answered, until one
        answers; None when none took it, or when no answer proves it comes from the
        daemon (then it is logged and ignored)."""
        for _ in self.urls:
            answered, answer = await self._send_to(self.url, body)
            if answered:
                return answer
            self._at = (self._at + 1) % len(self.urls)
        return None

    async def _send_to(self, url: str, body: dict[str, Any]) -> tuple[bool, ReportAnswer | None]:
        """(whether the daemon at ``url`` answered at all, the answer when it took it).
        An answer that is not the daemon's counts as none: the next daemon is tried
        (a squatter on one login node's port must not cut the replica off)."""
        # Signed per attempt: a retry is a new report to the daemon, which refuses
        # one it has seen (a replay), and the time in it must be recent. The nonce
        # is kept: the daemon's answer must be signed for this very attempt.
        raw = json.dumps(body, separators=(",", ":")).encode()
        nonce = secrets.token_hex(8)
        headers = {
            "Authorization": sign_report(
                self._secret, self.replica_id, int(time.time()), raw, nonce=nonce
            ),
            "Content-Type": "application/json",
        }
        try:
            async with self._session.post(
                url, data=raw, headers=headers, timeout=self._timeout
            ) as resp:
                answer = await resp.read()
                if resp.status == 200:
                    got = self._answer(body["event"], nonce, resp.headers, answer, url)
                    return got is not None, got
                self._refused(body["event"], resp.status, answer)
                return True, None
        except (aiohttp.ClientError, TimeoutError, ValueError) as err:
            log.warning(
                "report %s: daemon unreachable (%s at %s)", body["event"], type(err).__name__, url
            )
        return False, None

    def _answer(
        self, event: str, nonce: str, headers: Mapping[str, str], raw: bytes, url: str
    ) -> ReportAnswer | None:
        """The daemon's answer, if signed with this replica's secret for this report."""
        expected = reply_signature(self._secret, self.replica_id, nonce, 200, raw)
        if not constant_time_equal(headers.get(REPLY_HEADER, ""), expected):
            # Whoever answered does not hold the secret: a listener on the daemon's
            # port while it is down, or someone on the network path. Nothing it
            # says is acted on; the report counts as not delivered.
            log.error(
                "report %s: the answer is not signed by the daemon (%s missing or wrong); "
                "ignored: something else answers at %s",
                event,
                REPLY_HEADER,
                url,
            )
            return None
        data = json.loads(raw)
        if not isinstance(data, dict):
            raise ValueError("the answer is not a JSON object")
        return ReportAnswer(ok=bool(data.get("ok", True)), drain=bool(data.get("drain", False)))

    def _refused(self, event: str, status: int, raw: bytes) -> None:
        text = raw[:200].decode("utf-8", "replace")
        if status == 401:
            log.error("report %s: daemon refused the report's signature (401): %s", event, text)
        elif status == 404:
            log.error("report %s: daemon does not know this replica (404)", event)
        else:
            log.warning("report %s: HTTP %s %s", event, status, text)

    async def report(
        self,
        event: str,
        *,
        attempts: int = 5,
        backoff_s: float = 1.0,
        max_backoff_s: float = 30.0,
        **fields: Any,
    ) -> ReportAnswer | None:
        """Send with retries and jittered exponential backoff; None if it never got through."""
        body = self.body(event, **fields)
        delay = backoff_s
        for attempt in range(attempts):
            answer = await self.send_once(body)
            if answer is not None:
                return answer
            if attempt + 1 < attempts:
                await asyncio.sleep(delay * (0.5 + random.random() / 2))  # noqa: S311
                delay = min(delay * 2, max_backoff_s)
        log.warning("report %s: gave up after %d attempts", event, attempts)
        return None
