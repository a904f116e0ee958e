"""Free TCP ports for tests: one helper for every level.

Asking the kernel for port 0 and closing the socket gives a port that is free now,
but two such calls in a row may give the same port (the kernel may hand a just-closed
port out again), and a daemon given the same port for its gateway and its internal
listener refuses to start. So this process never hands out a port twice.
"""

from __future__ import annotations

import socket

_handed_out: set[int] = set()


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on now and this process has not handed out before."""
    while True:
        with socket.socket() as s:
            s.bind((host, 0))
            port = int(s.getsockname()[1])
        if port not in _handed_out:
            _handed_out.add(port)
            return port
