"""The status page the daemon serves at ``/``: one HTML document, no script, no framework.

It is rendered on the server from the same JSON as ``GET /api/v1/status`` and
refreshes itself with a meta refresh, so it works in any browser, a text one
included. Every value comes from outside this code (model names from the
catalog, pending reasons and node states from Slurm, decision reasons that
quote both), so every value is escaped; the daemon also sends a
Content-Security-Policy that forbids scripts, in case one were ever missed.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable, Mapping, Sequence
from html import escape
from typing import Any

__all__ = ["REFRESH_SECONDS", "render_page"]

REFRESH_SECONDS = 5

_STYLE = """
body { font-family: system-ui, sans-serif; margin: 1.5em; color: #222; }
h1 { font-size: 1.4em; } h2 { font-size: 1.15em; margin-top: 1.6em; }
table { border-collapse: collapse; margin: .4em 0; }
th, td { text-align: left; padding: .25em .8em .25em 0; vertical-align: top; }
th { border-bottom: 1px solid #999; }
tr.replica td { color: #555; font-size: .92em; }
.ready { color: #11661a; font-weight: 600; } .failing, .error { color: #a01010; font-weight: 600; }
.queued, .starting, .backoff { color: #8a5a00; font-weight: 600; } .cold { color: #666; }
code { background: #f2f2f2; padding: 0 .2em; } .muted { color: #666; }
"""


def _e(value: object) -> str:
    return escape("" if value is None else str(value), quote=True)


def _state_class(state: str) -> str:
    word = state.split(" ", 1)[0].split("(", 1)[0]
    return word if word in ("ready", "failing", "queued", "starting", "backoff", "cold") else ""


def _time(ts: object) -> str:
    if not isinstance(ts, int | float):
        return ""
    return dt.datetime.fromtimestamp(ts).strftime("%Y-%m-%d %H:%M:%S")


def _row(cells: Iterable[str], cls: str = "") -> str:
    attr = f' class="{_e(cls)}"' if cls else ""
    return f"<tr{attr}>" + "".join(f"<td>{c}</td>" for c in cells) + "</tr>"


def _head(names: Sequence[str]) -> str:
    return "<tr>" + "".join(f"<th>{_e(n)}</th>" for n in names) + "</tr>"


def _models(models: Sequence[Mapping[str, Any]]) -> str:
    if not models:
        return '<p class="muted">The catalog has no models.</p>'
    rows = [_head(("Model", "Aliases", "State", "GPUs", "Replicas", "Note"))]
    for m in models:
        state = str(m.get("state", ""))
        reps = m.get("replicas") or []
        rows.append(
            _row(
                (
                    f"<strong>{_e(m.get('name'))}</strong>",
                    _e(", ".join(m.get("aliases") or [])),
                    f'<span class="{_state_class(state)}">{_e(state)}</span>',
                    _e(m.get("gpus")),
                    _e(f"{len(reps)} (min {m.get('min')}, max {m.get('max')})"),
                    _e(m.get("note")),
                ),
                "model",
            )
        )
        for r in reps:
            what = f"replica {r.get('id')} · job {r.get('job_id')} · {r.get('state')}"
            detail = []
            if r.get("reason"):
                detail.append(f"pending reason: {r['reason']}")
            if r.get("nodes"):
                detail.append("nodes: " + ", ".join(str(n) for n in r["nodes"]))
            if r.get("step"):
                detail.append(f"step: {r['step']}")
            if r.get("in_flight"):
                detail.append(f"{r['in_flight']} in flight")
            if r.get("idle_s") is not None:
                detail.append(f"idle {r['idle_s']}s")
            rows.append(_row(("", "", _e(what), "", "", _e("; ".join(detail))), "replica"))
    return "<table>" + "".join(rows) + "</table>"


def _decisions(decisions: Sequence[Mapping[str, Any]]) -> str:
    if not decisions:
        return '<p class="muted">No decisions yet.</p>'
    rows = [_head(("Time", "Action", "Model", "Replica", "Reason"))]
    for d in reversed(decisions[-30:]):
        rows.append(
            _row(
                (
                    _e(_time(d.get("at"))),
                    _e(d.get("action")),
                    _e(d.get("model")),
                    _e(d.get("replica")),
                    _e(d.get("reason")),
                ),
                "error" if d.get("action") == "error" else "",
            )
        )
    return "<table>" + "".join(rows) + "</table>"


def _listed(status: Mapping[str, Any]) -> str:
    at, now = status.get("nodes_listed_at"), status.get("now")
    if not isinstance(at, int | float) or not isinstance(now, int | float):
        return ""
    ago = max(0, round(now - at))
    return f'<p class="muted">As Slurm listed them {ago}s ago, at {_e(_time(at))}.</p>'


def _nodes(nodes: Sequence[Mapping[str, Any]]) -> str:
    if not nodes:
        return '<p class="muted">No nodes seen yet.</p>'
    rows = [_head(("Node", "State", "Partitions", "GPUs free/total"))]
    for n in nodes:
        state = str(n.get("state", "")) + (f" ({n['reason']})" if n.get("reason") else "")
        rows.append(
            _row(
                (
                    _e(n.get("name")),
                    _e(state),
                    _e(", ".join(n.get("partitions") or [])),
                    _e(f"{n.get('gpus_free')}/{n.get('gpus_total')}"),
                )
            )
        )
    return "<table>" + "".join(rows) + "</table>"


def render_page(status: Mapping[str, Any], endpoint: str) -> str:
    """The whole page for one status snapshot; ``endpoint`` is the OpenAI base URL to show."""
    problem = ""
    if status.get("last_pass_error"):
        problem = (
            '<p class="error">Slurm did not answer the last pass; what is shown may be stale: '
            f"{_e(status['last_pass_error'])}</p>"
        )
    return (
        "<!DOCTYPE html>\n"
        '<html lang="en"><head><meta charset="utf-8">'
        f'<meta http-equiv="refresh" content="{REFRESH_SECONDS}">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>llmgw-slurm status</title><style>{_STYLE}</style></head><body>"
        "<h1>llmgw-slurm</h1>"
        f"<p>OpenAI-compatible endpoint: <code>{_e(endpoint)}</code> · "
        f"updated {_e(_time(status.get('now')))} · pass {_e(status.get('passes'))} · "
        f"version {_e(status.get('version'))} · refreshes every {REFRESH_SECONDS}s</p>"
        f"{problem}"
        f"<h2>Models</h2>{_models(status.get('models') or [])}"
        f"<h2>Recent decisions</h2>{_decisions(status.get('decisions') or [])}"
        f"<h2>Nodes</h2>{_listed(status)}{_nodes(status.get('nodes') or [])}"
        "</body></html>\n"
    )
