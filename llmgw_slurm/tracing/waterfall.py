"""A replica's start as a waterfall: where the seconds between the pass and serving went.

Built from one trace's spans (:mod:`llmgw_slurm.tracing.store`'s dicts). The
rows at depth 0 follow each other without gaps or overlaps, from the start
of the reconcile pass that placed the replica to the moment the daemon took
it as serving, so that their durations add up to the time to serve::

    placed by pass P        the pass: observe, plan, place (children)
    queued in Slurm         submit to the job running; a child per pending
                            reason, as the daemon saw them change
    job launch              the job running to the agent's first span
                            (the batch script, srun, the agent starting)
    agent on NODES          the agent's steps on each node (children)
    daemon: ready           the agent done to the daemon serving from it
                            (its own probe of the engine)
    serving                 since then (not part of the time to serve)

A boundary the trace cannot place exactly (the daemon sees a job running at
its next pass, not when Slurm started it) is clamped between its neighbours:
the rows stay contiguous, and each row's error is at most the daemon's pass
interval. Spans still open show as "(still open)" up to ``now``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from llmgw_slurm.tracing.store import START_NAMES

__all__ = ["Row", "Waterfall", "find_start", "generic", "waterfall"]

# The start outcomes (reconciler/intake.py) after which the replica serves.
_SERVED = ("ready", "serving (adopted)")


@dataclass(frozen=True)
class Row:
    label: str
    depth: int
    start: float
    end: float
    detail: str = ""
    # False for "serving", which is after the time to serve.
    counted: bool = True

    @property
    def duration(self) -> float:
        return max(0.0, self.end - self.start)


@dataclass(frozen=True)
class Waterfall:
    trace_id: str
    model: str
    replica: str
    outcome: str
    t0: float
    # None while the replica is not serving yet.
    ready_at: float | None
    rows: tuple[Row, ...]

    @property
    def time_to_serve(self) -> float | None:
        return None if self.ready_at is None else self.ready_at - self.t0

    def to_json(self) -> dict[str, Any]:
        return {
            "trace_id": self.trace_id,
            "model": self.model,
            "replica": self.replica,
            "outcome": self.outcome,
            "start": self.t0,
            "ready_at": self.ready_at,
            "time_to_serve_s": self.time_to_serve,
            "rows": [
                asdict(r) | {"duration_s": r.duration, "offset_s": r.start - self.t0}
                for r in self.rows
            ],
        }


def find_start(
    starts: Sequence[dict[str, Any]], target: str, model: str | None
) -> dict[str, Any] | None:
    """The newest start span for a model (canonical name given), a replica id or a trace id."""
    for sp in sorted(starts, key=lambda s: s["start"], reverse=True):
        a = sp["attrs"]
        if model is not None and a.get("llmgw.model") == model:
            return sp
        if target in (a.get("llmgw.replica"), sp["trace_id"]):
            return sp
    return None


def _by_id(spans: Sequence[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {s["span_id"]: s for s in spans}


def _end(s: dict[str, Any], now: float) -> float:
    return float(s["end"]) if s["end"] is not None else now


def _queue_rows(start: dict[str, Any], q_end: float) -> list[Row]:
    """A child row per Slurm state the daemon saw while the job waited."""
    marks: list[tuple[float, str]] = [(start["start"], "submitted, not yet seen in squeue")]
    for e in start["events"]:
        if not e["name"].startswith("slurm."):
            continue
        state = e["attrs"].get("llmgw.slurm.state", e["name"][6:].upper())
        reason = e["attrs"].get("llmgw.slurm.pending_reason", "")
        marks.append((e["t"], f"{state} ({reason})" if reason else str(state)))
        if state != "PENDING":
            break
    rows: list[Row] = []
    for i, (t, label) in enumerate(marks):
        if label.startswith("RUNNING") or t >= q_end:
            break
        nxt = marks[i + 1][0] if i + 1 < len(marks) else q_end
        rows.append(Row(label, 1, max(t, start["start"]), min(max(nxt, t), q_end)))
    return rows


def _agent_rows(
    groups: list[dict[str, Any]], spans: Sequence[dict[str, Any]], now: float
) -> list[Row]:
    rows: list[Row] = []
    for g in sorted(groups, key=lambda s: s["start"]):
        node = g["attrs"].get("llmgw.node", "?")
        rows.append(Row(f"{node}", 1, g["start"], _end(g, now), _status(g)))
        for s in sorted(
            (s for s in spans if s["parent_id"] == g["span_id"]), key=lambda s: s["start"]
        ):
            name = s["name"].removeprefix("llmgw.agent.")
            rows.append(Row(name, 2, s["start"], _end(s, now), _status(s)))
    return rows


def _status(s: dict[str, Any]) -> str:
    if s["end"] is None:
        return "still open"
    return "error" if s.get("status") == "error" else ""


def waterfall(spans: Sequence[dict[str, Any]], start: dict[str, Any], now: float) -> Waterfall:
    """The waterfall of the start span ``start`` among its trace's ``spans``."""
    ids = _by_id(spans)
    rid = start["attrs"].get("llmgw.replica", "")
    # A requeued or adopted start hangs under the first start, or under nothing.
    place = ids.get(start["parent_id"])
    if place is not None and place["name"] != "replica.place":
        place = None
    pass_ = ids.get(place["parent_id"]) if place is not None else None
    if pass_ is not None and pass_["name"] != "reconcile.pass":
        pass_ = None
    groups = [
        s for s in spans if s["name"] == "llmgw.agent" and s["attrs"].get("llmgw.replica_id") == rid
    ]
    ready_at = float(start["end"]) if start["end"] is not None else None
    last = ready_at if ready_at is not None else now
    t0 = pass_["start"] if pass_ is not None else start["start"]
    agent_start = min((g["start"] for g in groups), default=None)
    agent_end = max((_end(g, now) for g in groups), default=None)
    procs = [g["attrs"].get("llmgw.process_start") for g in groups]
    proc_start = min((p for p in procs if isinstance(p, int | float)), default=agent_start)
    # Contiguous boundaries, each clamped between its neighbours (see the module).
    b = [t0, start["start"]]
    q_end = _job_started(start)
    if q_end is None:
        q_end = proc_start if proc_start is not None else last
    elif proc_start is not None:
        q_end = min(q_end, proc_start)
    b += [q_end, proc_start if proc_start is not None else q_end]
    b += [agent_start if agent_start is not None else b[-1]]
    b += [agent_end if agent_end is not None else b[-1], last]
    for i in range(1, len(b)):
        b[i] = min(max(b[i], b[i - 1]), last)
    rows: list[Row] = []
    if pass_ is not None:
        pid = pass_["attrs"].get("llmgw.pass_id", "")
        rows.append(Row(f"placed by pass {pid}".strip(), 0, b[0], b[1], _place_detail(place)))
        for s in spans:
            if s["parent_id"] == pass_["span_id"] and s["name"] in (
                "reconcile.observe",
                "reconcile.plan",
            ):
                rows.append(Row(s["name"].removeprefix("reconcile."), 1, s["start"], _end(s, now)))
    rows.append(Row("queued in Slurm", 0, b[1], b[2], str(start["attrs"].get("llmgw.job_id", ""))))
    rows += _queue_rows(start, b[2])
    if groups:
        rows.append(Row("job launch", 0, b[2], b[3]))
        rows.append(Row("agent start-up", 0, b[3], b[4]))
        nodes = ",".join(str(g["attrs"].get("llmgw.node", "?")) for g in groups)
        rows.append(Row(f"agent on {nodes}", 0, b[4], b[5]))
        rows += _agent_rows(groups, spans, now)
    if ready_at is not None and start["attrs"].get("llmgw.start.outcome") in _SERVED:
        rows.append(Row("daemon: ready", 0, b[5], b[6], "the daemon's probe of the engine"))
        rows.append(Row("serving", 0, ready_at, now, counted=False))
    return Waterfall(
        trace_id=start["trace_id"],
        model=str(start["attrs"].get("llmgw.model", "")),
        replica=str(rid),
        outcome=str(start["attrs"].get("llmgw.start.outcome", "starting")),
        t0=t0,
        ready_at=ready_at if start["attrs"].get("llmgw.start.outcome") in _SERVED else None,
        rows=tuple(rows),
    )


def _job_started(start: dict[str, Any]) -> float | None:
    """When Slurm started the job: its own start time (to the second) if the daemon
    saw it, else when the daemon first saw it running."""
    for e in start["events"]:
        if e["name"] == "slurm.running":
            at = e["attrs"].get("llmgw.slurm.start_time")
            return float(at) if isinstance(at, int | float) else float(e["t"])
    return None


def _place_detail(place: dict[str, Any] | None) -> str:
    if place is None:
        return ""
    a = place["attrs"]
    bits = [str(a.get("llmgw.decision", "")), str(a.get("llmgw.reason", ""))]
    return "; ".join(b for b in bits if b)


def generic(spans: Sequence[dict[str, Any]], now: float) -> Waterfall:
    """Any trace (a pass that started nothing, say): its spans as a tree, by start time."""
    ids = _by_id(spans)

    def depth(s: dict[str, Any]) -> int:
        d, p = 0, s["parent_id"]
        while p in ids and d < 20:
            d, p = d + 1, ids[p]["parent_id"]
        return d

    t0 = min((s["start"] for s in spans), default=now)
    rows = tuple(
        Row(s["name"], depth(s), s["start"], _end(s, now), _status(s))
        for s in sorted(spans, key=lambda s: s["start"])
    )
    starts = [s for s in spans if s["name"] in START_NAMES]
    return Waterfall(
        trace_id=spans[0]["trace_id"] if spans else "",
        model=str(starts[0]["attrs"].get("llmgw.model", "")) if starts else "",
        replica="",
        outcome="",
        t0=t0,
        ready_at=None,
        rows=rows,
    )
