"""Another user of the cluster against a replica's engine: its port, its paths.

The attacks of issue 13, item 1 and 3, played by a second, unprivileged Unix
user this test creates, on the same nodes and ports as the replica:

- a listener on the engine's port before the engine binds it (what a watcher
  of ``ps`` did when the port was derived from the job id and on the command
  line) gets no engine key, no prompt, no request, and the gateway never
  routes to it;
- every path of a serving engine refuses that user: the TLS handshake needs
  the gateway's client certificate, whatever the path.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import textwrap
from pathlib import Path

import openai
import pytest

from tests.hostile_user import INTRUDER
from tests.ports import free_port
from tests.slurm.conftest import eventually
from tests.slurm.harness import TINY_ENGINE, Harness, running, tiny_model

pytestmark = pytest.mark.slurm

PROMPT = "the squatter must never read this prompt"

# Listens on every address of the node at port argv[1], answers whatever comes
# with a 200 (a "ready" engine to a naive poll) and prints repr() of what it got.
_SQUATTER = r"""
import socket, sys
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", int(sys.argv[1]))); s.listen(16); print("up", flush=True)
while True:
    c, _ = s.accept(); c.settimeout(2); data = b""
    try:
        while True:
            chunk = c.recv(65536)
            data += chunk
            if not chunk or b"\r\n\r\n" in data or len(data) > 4096:
                break
        c.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 17\r\nConnection: close\r\n\r\n"
                  b'{"choices": []} \n')
    except OSError:
        pass
    print(repr(data), flush=True); c.close()
"""


def _one_port(port: int) -> object:
    """``configure`` for the harness: the agent may use only ``port`` (the squatter's
    guess comes true: a stand-in for a watcher that won the race)."""

    def configure(h: Harness) -> None:
        path = h.folder / "agent.yaml"
        text = path.read_text().replace("port_range: 22000-29999", f"port_range: {port}-{port}")
        path.write_text(text)

    return configure


def _engine_pids(served_name: str) -> list[int]:
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            with contextlib.suppress(OSError):
                argv = (d / "cmdline").read_bytes().split(b"\0")
                if b"llmgw_slurm.testing.engine" in argv and served_name.encode() in argv:
                    out.append(int(d.name))
    return out


async def test_a_squatter_on_a_starting_engines_port_gets_no_key_no_prompt_no_traffic(
    tmp_path: Path, prefix: str
) -> None:
    intruder = INTRUDER.ensure()
    port = free_port("0.0.0.0")
    # The engine binds 6 s after it starts, as vLLM does after its imports.
    model = tiny_model(
        "squat",
        engine={"kind": "command", "command": [*TINY_ENGINE, "--bind-after", "6"]},
    )
    async with running(
        tmp_path, prefix, [model], configure=_one_port(port), router={"hold_timeout": "3m"}
    ) as h:
        client = openai.AsyncOpenAI(base_url=h.url + "/v1", api_key="x", max_retries=0, timeout=300)
        chat = asyncio.create_task(
            client.chat.completions.create(
                model="squat", messages=[{"role": "user", "content": PROMPT}]
            )
        )
        await eventually(lambda: asyncio.sleep(0, _engine_pids("squat")), "the engine to start")
        with INTRUDER.spawn_python(_SQUATTER, str(port)) as squatter:
            assert squatter.stdout is not None and squatter.stdout.readline().strip() == "up"
            # The agent finds the port held by another user and fails the start at once:
            # it sends nothing there, and nothing is ever routed there.
            held = f"held by uid {intruder.pw_uid}"

            async def refused() -> list[str]:
                return [d.reason for d in h.decisions(model="squat") if held in d.reason]

            await eventually(refused, "the start to fail, naming the squatter's uid")
            assert not chat.done()
            squatter.kill()
            heard, _ = squatter.communicate(timeout=10)
        assert "Bearer" not in heard and PROMPT not in heard, heard
        assert "chat/completions" not in heard and "/health" not in heard, heard
        # The squatter gone, the next start (after the backoff) serves the held request.
        answer = await chat
        assert answer.choices[0].message.content.startswith(PROMPT)
        await client.close()


def _range(lo: int, hi: int) -> object:
    """``configure``: the agent picks the engine's port in ``lo``-``hi``."""

    def configure(h: Harness) -> None:
        path = h.folder / "agent.yaml"
        path.write_text(path.read_text().replace("port_range: 22000-29999", f"port_range: {lo}-{hi}"))

    return configure


def _engine_port(pid: int) -> int:
    """The engine's port, from its environment (root reads any process's)."""
    env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return int(next(v for v in env if v.startswith(b"LLMGW_ENGINE_PORT=")).split(b"=", 1)[1])


async def test_a_squatter_on_a_command_engines_port_moves_the_start_to_another_port(
    tmp_path: Path, prefix: str
) -> None:
    intruder = INTRUDER.ensure()
    lo = 31000 + os.getpid() % 2000
    # The catalog names the port with {port}, as site-config/models.yaml's tiny does;
    # the engine binds 6 s after it starts, as vLLM does after its imports.
    command = [*TINY_ENGINE, "--port", "{port}", "--bind-after", "6"]
    model = tiny_model("moved", engine={"kind": "command", "command": command})
    async with running(
        tmp_path, prefix, [model], configure=_range(lo, lo + 40), router={"hold_timeout": "3m"}
    ) as h:
        client = openai.AsyncOpenAI(base_url=h.url + "/v1", api_key="x", max_retries=0, timeout=300)
        chat = asyncio.create_task(
            client.chat.completions.create(
                model="moved", messages=[{"role": "user", "content": PROMPT}]
            )
        )
        (pid, *_) = await eventually(
            lambda: asyncio.sleep(0, _engine_pids("moved")), "the engine to start"
        )
        # What another user of the node reads of it: "{port}", not the port.
        seen = INTRUDER.python(
            "import sys; print(open(f'/proc/{sys.argv[1]}/cmdline', 'rb').read())", str(pid)
        )
        port = _engine_port(pid)
        assert seen.returncode == 0 and "{port}" in seen.stdout, seen
        assert str(port) not in seen.stdout, seen.stdout
        # A squatter that learned it anyway takes it before the engine binds.
        with INTRUDER.spawn_python(_SQUATTER, str(port)) as squatter:
            assert squatter.stdout is not None and squatter.stdout.readline().strip() == "up"
            # Before: the start failed (4 of 4), the request hung, the model backed off.
            answer = await asyncio.wait_for(chat, 240)
            assert answer.choices[0].message.content.startswith(PROMPT)
            squatter.kill()
            heard, _ = squatter.communicate(timeout=10)
        assert heard == "", heard  # nothing, not even a poll, went to the squatter
        (url,) = [r.base_url for r in h.rec.replicas.values() if r.base_url]
        assert not url.endswith(f":{port}"), url
        failed = [d.reason for d in h.decisions(model="moved") if f"uid {intruder.pw_uid}" in d.reason]
        assert failed == [], failed
        await client.close()


async def test_every_path_of_a_serving_engine_refuses_another_user(
    tmp_path: Path, prefix: str
) -> None:
    INTRUDER.ensure()
    model = tiny_model("open", scaling={"min": 1, "max": 1})
    async with running(tmp_path, prefix, [model]) as h:

        async def ready() -> list[str]:
            return [r.base_url for r in h.rec.replicas.values() if r.base_url]

        (url,) = await eventually(ready, "ready", timeout=120)
        assert url.startswith("https://")
        probe = textwrap.dedent(
            """
            import ssl, sys, urllib.request
            url = sys.argv[1]
            ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
            ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
            for path in ("/v1/models", "/invocations", "/tokenize", "/metrics", "/health"):
                for base, c in ((url, ctx), (url.replace("https:", "http:"), None)):
                    try:
                        r = urllib.request.urlopen(base + path, context=c, timeout=5)
                        print("ANSWERED", path, r.status)
                    except Exception as e:
                        print("refused", path, type(e).__name__)
            """
        )
        out = INTRUDER.python(probe, url)
        assert out.returncode == 0, out.stderr
        assert "ANSWERED" not in out.stdout, out.stdout
        assert out.stdout.count("refused") == 10, out.stdout
        # The same user as the service (root here) without the gateway's key fares no
        # better: the refusal is the certificate's, not the uid's.
        assert os.geteuid() == 0
