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

from llmgw_slurm.secrets import engine_api_key
from llmgw_slurm.tls import PinnedContexts

__all__ = ["EngineProbe"]


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

    async def close(self) -> None:
        for t in list(self.tasks):
            t.cancel()
        if self._http is not None:
            await self._http.close()
