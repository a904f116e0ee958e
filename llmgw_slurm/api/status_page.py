"""The status page the daemon serves at ``/``: one HTML document, no script, no framework.

It is rendered on the server from the same JSON as ``GET /api/v1/status``,
through the Jinja2 template ``templates/status.html.j2``, and refreshes
itself with a meta refresh, so it works in any browser, a text one included.
Every value comes from outside this code (model names from the catalog,
pending reasons and node states from Slurm, decision reasons that quote
both), so the template escapes all of them (autoescape); the daemon also
sends a Content-Security-Policy that forbids scripts, in case markup ever got
through.
"""

from __future__ import annotations

import datetime as dt
import functools
from collections.abc import Mapping, Sequence
from typing import Any

import jinja2

from llmgw_slurm.base.durations import format_duration
from llmgw_slurm.reconciler.status import MODEL_STATES

__all__ = ["REFRESH_SECONDS", "render_page"]

REFRESH_SECONDS = 5
_TEMPLATE = "status.html.j2"


@functools.cache
def _template() -> jinja2.Template:
    env = jinja2.Environment(
        loader=jinja2.PackageLoader("llmgw_slurm.api", "templates"),
        # Escape everything: no value on the page is markup of ours.
        autoescape=True,
        # A name the template uses and the page does not give is a bug here,
        # not an empty cell.
        undefined=jinja2.StrictUndefined,
    )
    return env.get_template(_TEMPLATE)


def _text(value: object) -> str:
    return "" if value is None else str(value)


def _state_class(state: str) -> str:
    return state if state in MODEL_STATES else ""


def _time(ts: object) -> str:
    if not isinstance(ts, int | float):
        return ""
    return dt.datetime.fromtimestamp(ts).strftime("%Y-%m-%d %H:%M:%S")


def _replica(r: Mapping[str, Any]) -> dict[str, str]:
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
    on = f" on {r['cluster']}" if r.get("cluster") else ""
    return {
        "what": f"replica {r.get('id')} · job {r.get('job_id')}{on} · {r.get('state')}",
        "detail": "; ".join(detail),
    }


def _model(m: Mapping[str, Any]) -> dict[str, Any]:
    state = _text(m.get("state"))
    reps = m.get("replicas") or []
    return {
        "name": _text(m.get("name")),
        "aliases": ", ".join(str(a) for a in m.get("aliases") or []),
        "state": _text(m.get("state_text")) or state,
        "state_class": _state_class(state),
        "gpus": _text(m.get("gpus")),
        "replicas": f"{len(reps)} (min {m.get('min')}, max {m.get('max')})",
        "note": _text(m.get("note")),
        "replica_rows": [_replica(r) for r in reps],
    }


def _decision(d: Mapping[str, Any]) -> dict[str, Any]:
    return {
        "at": _time(d.get("at")),
        "action": _text(d.get("action")),
        "model": _text(d.get("model")),
        "replica": _text(d.get("replica")),
        "reason": _text(d.get("reason")),
        "error": d.get("action") == "error",
    }


def _cluster(c: Mapping[str, Any]) -> dict[str, str]:
    reps = c.get("replicas") or {}
    return {
        "name": _text(c.get("name")),
        "health": _text(c.get("health_text") or c.get("health")),
        "health_class": "ready" if c.get("health") == "up" else "error",
        "gpus": f"{c.get('gpus_free')}/{c.get('gpus_total')}",
        "replicas": ", ".join(f"{n} {k}" for k, n in sorted(reps.items())) or "none",
    }


def _node(n: Mapping[str, Any]) -> dict[str, str]:
    return {
        "name": (f"{n['cluster']}:" if n.get("cluster") else "") + _text(n.get("name")),
        "state": _text(n.get("state")) + (f" ({n['reason']})" if n.get("reason") else ""),
        "partitions": ", ".join(str(p) for p in n.get("partitions") or []),
        "gpus": f"{n.get('gpus_free')}/{n.get('gpus_total')}",
    }


def _listed(status: Mapping[str, Any]) -> dict[str, Any] | None:
    at, now = status.get("nodes_listed_at"), status.get("now")
    if not isinstance(at, int | float) or not isinstance(now, int | float):
        return None
    counted = any(n.get("gpus_placed_since_listing") for n in status.get("nodes") or [])
    return {"ago": format_duration(round(now - at)), "at": _time(at), "counted": counted}


def _peers(status: Mapping[str, Any]) -> dict[str, Any] | None:
    """Several daemons on one database: the leader, its epoch and since when, each daemon."""
    c = status.get("peers")
    now = status.get("now")
    if not isinstance(c, Mapping) or not isinstance(now, int | float):
        return None
    leader = _text(c.get("leader")) or "none"
    daemons = []
    for d in c.get("daemons") or []:
        seen = d.get("last_seen")
        daemons.append(
            {
                "name": _text(d.get("name")),
                "host": _text(d.get("host")),
                "gateway": _text(d.get("gateway_url")),
                "contact": (
                    format_duration(round(now - seen)) + " ago"
                    if isinstance(seen, int | float)
                    else "-"
                ),
                "state": "stopped"
                if d.get("stopped_at")
                else "leads"
                if d.get("name") == leader
                else "",
            }
        )
    since = c.get("leader_since")
    return {
        "leader": leader,
        "epoch": _text(c.get("epoch")),
        "since": _time(since) if isinstance(since, int | float) else "",
        "this": _text(c.get("this")),
        "problem": _text(c.get("last_error")),
        "daemons": daemons,
    }


def render_page(
    status: Mapping[str, Any], endpoint: str, charts: Mapping[str, Any] | None = None
) -> str:
    """The whole page for one status snapshot; ``endpoint`` is the OpenAI base URL to show.

    ``charts``: :func:`llmgw_slurm.api.charts.page_data`'s values, drawn as inline
    SVG; None for the tables alone.
    """
    decisions: Sequence[Mapping[str, Any]] = status.get("decisions") or []
    return (
        _template().render(
            refresh=REFRESH_SECONDS,
            endpoint=endpoint,
            updated=_time(status.get("now")),
            passes=_text(status.get("passes")),
            version=_text(status.get("version")),
            problem=_text(status.get("last_pass_error")),
            models=[_model(m) for m in status.get("models") or []],
            # One cluster without a name: its health is the page's warning line.
            clusters=[_cluster(c) for c in status.get("clusters") or [] if c.get("name")],
            decisions=[_decision(d) for d in reversed(decisions[-30:])],
            listed=_listed(status),
            peers=_peers(status),
            nodes=[_node(n) for n in status.get("nodes") or []],
            charts=charts,
            gpu_at=_time(charts.get("gpu_at")) if charts else "",
        )
        + "\n"
    )
