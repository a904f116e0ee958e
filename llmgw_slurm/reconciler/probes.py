"""HTTP probes of engines: the daemon routes only to what it has reached itself.

An agent's word that its engine is up is not proof that the login node can
reach it (firewalls, a wrong advertised name): before a replica gets traffic,
the daemon asks the engine for ``/v1/models`` with the replica's engine key,
from the process that will send the requests.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import aiohttp

from llmgw_slurm.auth.secrets import engine_api_key
from llmgw_slurm.auth.tls import PinnedContexts

__all__ = ["EngineProbe", "waiting_from_metrics"]

_WAITING = ("vllm:num_requests_waiting", "sglang:num_queue_reqs")


def waiting_from_metrics(text: str) -> int | None:
    """Requests the engine queues, from its Prometheus text; None when it does not say."""
    total, seen = 0.0, False
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name not in _WAITING:
            continue
        try:
            total += float(line.rsplit(" ", 1)[1])
            seen = True
        except (ValueError, IndexError):
            continue
    return round(total) if seen else None


class EngineProbe:
    """Probes engines in the background, one probe per URL at a time."""

    def __init__(self, server_key: bytes, engine_tls: PinnedContexts) -> None:
        self.server_key = server_key
        self.engine_tls = engine_tls
        self._http: aiohttp.ClientSession | None = None
        self._probing: set[str] = set()
        # Probes under way (tests wait for them; close() cancels them).
        self.tasks: set[asyncio.Task[None]] = set()

    def start(
        self, replica_id: str, url: str, cert: str, done: Callable[[bool, str], None]
    ) -> None:
        """Probe ``url`` (pinning ``cert``, "" for plain HTTP) unless a probe of it is
        under way; then ``done(ok, why)``.

        Called on the event loop; returns at once.
        """
        if url in self._probing:
            return
        self._probing.add(url)
        task = asyncio.get_running_loop().create_task(self._run(replica_id, url, cert, done))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _run(
        self, replica_id: str, url: str, cert: str, done: Callable[[bool, str], None]
    ) -> None:
        ok, why = await self.check(replica_id, url, cert)
        done(ok, why)

    async def check(self, replica_id: str, url: str, cert: str = "") -> tuple[bool, str]:
        """Does the engine at ``url`` answer with replica ``replica_id``'s key? (ok, why not)."""
        try:
            if self._http is None or self._http.closed:
                self._http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5))
            key = engine_api_key(self.server_key, replica_id)
            # The key goes only through a handshake with the pinned certificate: a
            # listener that took the engine's port fails it and hears nothing.
            ctx = self.engine_tls.get(cert) if cert else None
            async with self._http.get(
                url.rstrip("/") + "/v1/models",
                headers={"Authorization": f"Bearer {key}"},
                ssl=ctx if ctx is not None else True,
            ) as resp:
                ok = resp.status == 200
                why = f"HTTP {resp.status}"
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            ok, why = False, f"{type(exc).__name__}: {exc}"
        finally:
            self._probing.discard(url)
        return ok, why

    def scrape_waiting(
        self, replica_id: str, url: str, cert: str, done: Callable[[int], None]
    ) -> None:
        """Read the requests the engine queues from its /metrics, in the background;
        then ``done(count)``. Nothing is called when it cannot be read (the last
        reading stands): a replica whose metrics fail is judged by its health
        elsewhere, not scaled on a guess. One reading per URL at a time."""
        key = "metrics " + url
        if key in self._probing:
            return
        self._probing.add(key)
        task = asyncio.get_running_loop().create_task(
            self._scrape(key, replica_id, url, cert, done)
        )
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _scrape(
        self, key: str, replica_id: str, url: str, cert: str, done: Callable[[int], None]
    ) -> None:
        try:
            if self._http is None or self._http.closed:
                self._http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5))
            ctx = self.engine_tls.get(cert) if cert else None
            async with self._http.get(
                url.rstrip("/") + "/metrics",
                headers={"Authorization": f"Bearer {engine_api_key(self.server_key, replica_id)}"},
                ssl=ctx if ctx is not None else True,
            ) as resp:
                text = await resp.text() if resp.status == 200 else ""
        except (aiohttp.ClientError, TimeoutError, OSError, UnicodeDecodeError):
            text = ""
        finally:
            self._probing.discard(key)
        count = waiting_from_metrics(text)
        if count is not None:
            done(count)

    async def close(self) -> None:
        for t in list(self.tasks):
            t.cancel()
        if self._http is not None:
            await self._http.close()
