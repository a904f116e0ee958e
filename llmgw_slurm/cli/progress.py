"""What ``llmgw`` shows while a model starts: the status API's models, and their phases.

``llmgw up`` and ``llmgw chat`` (on a model that is not ready) both wait for a
start that can take minutes (a Slurm queue, a weights fetch, an engine that
loads): they show each phase on standard error, so that standard output
carries only the answer a script captures.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import click

from llmgw_slurm.base.durations import format_duration
from llmgw_slurm.cli.common import run, unknown_model
from llmgw_slurm.cli.settings import Settings

__all__ = ["Progress", "Watcher", "fetch_status", "find_model", "model_json", "phase"]

_STEP_WORDS = {
    "weights": "fetching weights",
    "rendezvous": "waiting for the other nodes",
    "engine_launch": "launching the engine",
    "readiness": "loading the engine",
    # The engine answers its agent; the gateway now reaches it itself.
    "register": "the engine is up; the gateway checks it",
    "ready": "the engine is up; the gateway checks it",
    "drain": "draining",
    "stop": "stopping",
}


async def fetch_status(s: Settings) -> dict[str, Any]:
    """The gateway's ``/api/v1/status``; a ClickException when it is not the llmgw gateway.

    With a key, the models it may use (the catalog's access rules) are listed
    too; the key goes only to a server that proved it is the daemon, and
    without that proof the listing is everyone's (models open to all).
    """
    token = None
    if s.key:
        try:
            s.guard("your API key")
            token = s.key
        except click.ClickException:
            token = None
    reply = await s.call("GET", "/api/v1/status", token=token)
    if not reply.ok or not isinstance(reply.data, dict) or "models" not in reply.data:
        raise click.ClickException(
            f"{s.url} did not answer the status request ({reply.error_message()}); "
            "is it the llmgw gateway?"
        )
    return reply.data


def find_model(status: dict[str, Any], name: str) -> dict[str, Any]:
    """The status entry of model ``name`` (or an alias); the unknown-model error otherwise."""
    for m in status.get("models", []):
        if m.get("name") == name or name in (m.get("aliases") or []):
            return dict(m)
    names = [str(m.get("name")) for m in status.get("models", [])]
    aliases = [str(a) for m in status.get("models", []) for a in m.get("aliases") or []]
    raise click.ClickException(unknown_model(name, names, also=aliases))


def model_json(m: dict[str, Any], endpoint: str) -> dict[str, Any]:
    """One model as ``llmgw models --json`` and ``llmgw up --json`` print it."""
    reps = m.get("replicas") or []
    return {
        "name": m.get("name"),
        "aliases": m.get("aliases") or [],
        "description": m.get("description") or "",
        "state": m.get("state"),
        "reason": m.get("reason") or "",
        "ready_replicas": int(m.get("ready_replicas") or 0),
        "replicas": len(reps),
        "gpus": m.get("gpus"),
        "note": m.get("note") or "",
        "endpoint": endpoint,
    }


def phase(model: dict[str, Any]) -> str:
    """What a person waiting for ``model`` wants to read now."""
    state = str(model.get("state") or "")
    if state == "ready":
        return "ready"
    reps = model.get("replicas") or []
    running = [r for r in reps if r.get("state") in ("starting", "ready")]
    if running:
        step = str(running[0].get("step") or "")
        word, _, status = step.partition(" ")
        if status == "failed":
            return f"{_STEP_WORDS.get(word, word)} failed"
        return _STEP_WORDS.get(word, "job started") if word else "job started"
    pending = [r for r in reps if r.get("state") == "pending"]
    if pending:
        reason = pending[0].get("reason")
        return f"queued ({reason})" if reason else "queued"
    if state in ("backoff", "failing"):
        return state + (f": {model['note']}" if model.get("note") else "")
    return "requested"


class Progress:
    """A start's phases on standard error: one line per change, or, on a terminal, one
    line redrawn in place with the time since the start."""

    def __init__(self, live: bool) -> None:
        self.live = live
        self.last = ""

    def show(self, elapsed: float, what: str) -> None:
        shown = f"[{format_duration(elapsed):>6}] {what}"
        if self.live:
            if self.last and what != self.last:
                click.echo(err=True)  # keep the finished phase's line
            click.echo(f"\r\x1b[K{shown}", nl=False, err=True)
        elif what != self.last:
            click.echo(shown, err=True)
        self.last = what

    def end(self, clear: bool = False) -> None:
        """Finish the live line: kept (``up``), or wiped before an answer prints (``chat``)."""
        if self.live and self.last:
            click.echo("\r\x1b[K" if clear else "", nl=not clear, err=True)
        self.last = ""


class Watcher:
    """Shows a model's phases on standard error from a thread while the caller waits.

    For ``llmgw chat``: the request itself is held by the gateway, which says
    nothing until the first token; this polls the status API beside it, once a
    second, and stops at the first token (:meth:`stop`). A status call that
    fails ends the watching, never the chat.
    """

    def __init__(self, s: Settings, name: str, live: bool, poll: float = 1.0) -> None:
        self.s, self.name, self.poll = s, name, poll
        self.progress = Progress(live)
        self._done = threading.Event()
        # Held while a line is written: stop() wipes the line only after the last one.
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._t0 = time.monotonic()

    def start(self, first: dict[str, Any]) -> None:
        self.progress.show(0.0, phase(first))
        self._thread.start()

    def stop(self) -> None:
        if self._done.is_set():
            return
        with self._lock:
            self._done.set()
            self.progress.end(clear=True)

    def _run(self) -> None:
        look: Callable[[], dict[str, Any]] = lambda: find_model(  # noqa: E731
            run(fetch_status(self.s)), self.name
        )
        while not self._done.wait(self.poll):
            try:
                m = look()
            except (click.ClickException, OSError):
                return
            with self._lock:
                if self._done.is_set():
                    return
                self.progress.show(time.monotonic() - self._t0, phase(m))
