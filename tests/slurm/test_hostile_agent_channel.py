"""Another user forges the daemon's answers to a replica's agent (issue 33, finding 2).

Reports to the internal port were signed, but the agent believed any answer:
while the daemon was down, a process of another user that bound the internal
port answered heartbeats with ``{"ok": true, "drain": true}`` and every replica
drained and ended within 20 s; anyone on the network path could do the same by
rewriting an answer. Here a second, unprivileged Unix user does both, against a
real replica on the dev cluster: the replica keeps serving, its job keeps running.
"""

from __future__ import annotations

import asyncio
import textwrap
from pathlib import Path

import openai
import pytest
import yaml

from tests.hostile_user import INTRUDER
from tests.ports import free_port
from tests.slurm.conftest import eventually
from tests.slurm.harness import Harness, running, tiny_model

pytestmark = pytest.mark.slurm

# argv: port to listen on, then "squat" or "mitm UPSTREAM_PORT". Answers (or passes on)
# HTTP/1.1 requests one per connection; prints one line per request: its first line
# and, for a report, its event; "rewrote" when it turned an answer into a drain.
_FORGER = textwrap.dedent(
    r"""
    import http.client, json, re, socket, sys, threading
    port, mode = int(sys.argv[1]), sys.argv[2]
    upstream = int(sys.argv[3]) if mode == "mitm" else 0
    seen = {"heartbeat": 0}
    lock = threading.Lock()

    def read_request(c):
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = c.recv(65536)
            if not chunk:
                return None
            data += chunk
        head, _, body = data.partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        headers = dict(line.split(": ", 1) for line in lines[1:] if ": " in line)
        n = int(headers.get("Content-Length", "0"))
        while len(body) < n:
            body += c.recv(65536)
        return lines[0], headers, body

    def answer(c, status, body, headers):
        head = f"HTTP/1.1 {status} OK\r\nContent-Length: {len(body)}\r\nConnection: close\r\n"
        head += "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        c.sendall(head.encode() + b"\r\n" + body)

    def serve(c):
        try:
            got = read_request(c)
            if got is None:
                return
            line, headers, body = got
            try:
                event = json.loads(body).get("event", "")
            except ValueError:
                event = ""
            with lock:
                if event == "heartbeat":
                    seen["heartbeat"] += 1
                n = seen["heartbeat"]
            if mode == "squat":
                print(line, event, flush=True)
                answer(c, 200, b'{"ok": true, "drain": true}', {"Content-Type": "application/json"})
                return
            up = http.client.HTTPConnection("127.0.0.1", upstream, timeout=30)
            keep = {k: v for k, v in headers.items() if k in ("Authorization", "Content-Type")}
            up.request("POST", line.split()[1], body=body, headers=keep)
            r = up.getresponse()
            out = r.read()
            back = {k: v for k, v in r.getheaders() if k.lower() in ("content-type", "x-llmgw-reply-sig")}
            rewrote = n > 3 and re.search(rb'"drain": ?false', out) is not None
            if rewrote:
                # After a few heartbeats passed on, every answer says drain.
                out = re.sub(rb'"drain": ?false', b'"drain": true', out)
            print(line, event, "rewrote" if rewrote else "", flush=True)
            answer(c, r.status, out, back)
        except OSError:
            pass
        finally:
            c.close()

    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("127.0.0.1", port))
    s.listen(64)
    print("up", flush=True)
    while True:
        c, _ = s.accept()
        threading.Thread(target=serve, args=(c,), daemon=True).start()
    """
)


async def _ready(h: Harness) -> list[tuple[str, str]]:
    return [
        (r.replica_id, r.job_id) for r in h.rec.replicas.values() if r.state().value == "ready"
    ]


async def _chat(h: Harness) -> str:
    async with openai.AsyncOpenAI(
        base_url=h.url + "/v1", api_key="x", max_retries=0, timeout=120
    ) as c:
        r = await c.chat.completions.create(
            model="kept", messages=[{"role": "user", "content": "still serving"}]
        )
        return r.choices[0].message.content or ""


def _job_state(h: Harness, job_id: str) -> str:
    return {j[0]: j[2] for j in h.jobs()}.get(job_id, "gone")


async def test_a_squatter_on_the_internal_port_cannot_drain_a_replica(
    tmp_path: Path, prefix: str
) -> None:
    INTRUDER.ensure()
    async with running(tmp_path, prefix, [tiny_model("kept", scaling={"min": 1, "max": 1})]) as h:
        ((rid, job_id),) = await eventually(lambda: _ready(h), "ready", timeout=180)
        # The daemon goes away (a crash, or finding 1); another user takes its port.
        await h.stop()
        with INTRUDER.spawn_python(_FORGER, str(h.internal_port), "squat") as forger:
            assert forger.stdout is not None and forger.stdout.readline() == "up\n"
            heartbeats = 0
            # The harness's agents beat every second: ten forged drains at least.
            while heartbeats < 10:
                line = await asyncio.wait_for(asyncio.to_thread(forger.stdout.readline), 120)
                assert line, "the squatter stopped hearing the agent"
                heartbeats += line.split()[-1:] == ["heartbeat"]
            # Before: the agent drained at the first and its job ended within 20 s.
            assert _job_state(h, job_id) == "RUNNING"
        await h.start()
        # Adopted, not replaced: the same replica and job, ready on its next heartbeat.
        assert await eventually(lambda: _ready(h), "ready again", timeout=120) == [(rid, job_id)]
        assert (await _chat(h)).startswith("still serving")
        assert not h.decisions(action="agent-drain")


async def test_a_man_in_the_middle_cannot_drain_a_replica(tmp_path: Path, prefix: str) -> None:
    INTRUDER.ensure()
    proxy = free_port()

    def through_the_intruder(h: Harness) -> None:
        # The agents reach the daemon through the intruder's relay, as they would
        # through someone on the cluster network between them.
        cfg = yaml.safe_load(h.server_yaml.read_text())
        cfg["listen"]["daemon_url"] = f"http://127.0.0.1:{proxy}"
        h.server_yaml.write_text(yaml.safe_dump(cfg, sort_keys=False))

    async with running(
        tmp_path,
        prefix,
        [tiny_model("kept", scaling={"min": 1, "max": 1})],
        configure=through_the_intruder,
    ) as h:
        with INTRUDER.spawn_python(_FORGER, str(proxy), "mitm", str(h.internal_port)) as mitm:
            assert mitm.stdout is not None and mitm.stdout.readline() == "up\n"
            ((rid, job_id),) = await eventually(lambda: _ready(h), "ready", timeout=180)
            rewritten = 0
            while rewritten < 10:
                line = await asyncio.wait_for(asyncio.to_thread(mitm.stdout.readline), 120)
                assert line, "the relay stopped hearing the agent"
                rewritten += line.rstrip().endswith("rewrote")
            # Ten answers said drain; the agent checked each and obeyed none.
            assert await _ready(h) == [(rid, job_id)]
            assert _job_state(h, job_id) == "RUNNING"
            assert (await _chat(h)).startswith("still serving")
            assert not h.decisions(action="agent-drain")
