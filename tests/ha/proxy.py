"""A TCP proxy a test can cut: one daemon's way to the database, on loopback.

``cut()`` closes every connection through it and refuses new ones (the
daemon's packets go nowhere: as a link lost between one login node and the
database, while the other still reaches it); ``mend()`` lets them through again.
"""

from __future__ import annotations

import asyncio
import contextlib

from tests.ports import free_port


class Proxy:
    def __init__(self, target_port: int, host: str = "127.0.0.1") -> None:
        self.host = host
        self.target_port = target_port
        self.port = free_port()
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, self.host, self.port)

    async def _serve(self, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        try:
            ur, uw = await asyncio.open_connection(self.host, self.target_port)
        except OSError:
            w.close()
            return
        self._writers |= {w, uw}

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            with contextlib.suppress(OSError, asyncio.IncompleteReadError):
                while data := await src.read(65536):
                    dst.write(data)
                    await dst.drain()
            dst.close()

        await asyncio.gather(pipe(r, uw), pipe(ur, w))
        self._writers -= {w, uw}

    async def cut(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None
        for w in list(self._writers):
            w.transport.abort()
        self._writers.clear()

    async def mend(self) -> None:
        if self._server is None:
            await self.start()
