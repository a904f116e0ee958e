"""The reconciler's traces: one per pass that acts, and one start span per replica.

Kept apart from the reconciler's logic so that ``core.py`` only says what
happened (a few calls) and this module decides what that looks like as spans.

A pass that does something is a trace::

    reconcile.pass                  llmgw.pass_id, llmgw.actions
      reconcile.observe             the squeue (+ sinfo when the last node
                                    listing is old) (timed before the pass
                                    knew it would be a trace)
      reconcile.plan                planned on the last node listing, and
        reconcile.list_nodes        when that wanted to place or evict, on
                                    nodes listed afresh
      replica.adopt / .requeue / .reap / .gone, model.backoff   what the
                                    listing showed
      replica.place                 where it went, or every node turned down
        replica.start               open until the replica serves or fails;
                                    its context goes to the job (TRACEPARENT)
          llmgw.agent ...           the agent's steps, inside the Slurm job
      replica.drain / .stop / .evict

A pass that does nothing makes no trace: the decision is taken after the
plan, so the observe step is recorded as timestamps and turned into a child
span only when the pass turns out to be worth a trace.

A replica's start span outlives the pass that opened it, and may outlive the
daemon: its traceparent is in the job's comment (trace ids are not secret),
so that after a restart an adopted replica's start is continued in the same
trace ("replica.start (adopted)"), or, when the comment holds none, started
afresh with ``llmgw.start.recovered = false``. A daemon that stops ends its
open start spans with ``llmgw.start.outcome = "daemon stopped"``; none is
left open silently.
"""

from __future__ import annotations

import contextlib
import re
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from opentelemetry import trace
from opentelemetry.trace import Link, Span, SpanContext, Status, StatusCode

from llmgw_slurm.reconciler.plan import Action, ActionKind, Failures
from llmgw_slurm.slurm.types import Job, JobState
from llmgw_slurm.tracing.otel import context_from_traceparent, inject_env, traceparent_of

__all__ = ["ReconcileTracing", "decision_of", "traceparent_from_comment"]

_COMMENT_TRACE = re.compile(r"(?:^|\s)trace=(00-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2})(?:\s|$)")

# Reason prefixes (plan.py's wording) -> a stable, filterable decision name.
_DECISIONS: tuple[tuple[str, str], ...] = (
    ("scale up", "scale_up"),
    ("renewal", "renewal"),
    ("renewed by", "renewal_handover"),
    ("scale down", "scale_down"),
    ("start failed", "failed_start"),
    ("not ready", "start_timeout"),
    ("pending for", "pending_timeout"),
    ("drained", "drained"),
    ("drain timed out", "drain_timeout"),
    ("model removed", "removed"),
    ("evicted", "evict"),
    ("fair share", "fair_share"),
)


def decision_of(reason: str) -> str:
    for prefix, name in _DECISIONS:
        if reason.startswith(prefix):
            return name
    return "other"


def traceparent_from_comment(comment: str) -> str:
    m = _COMMENT_TRACE.search(comment)
    return m.group(1) if m else ""


def _placement_attrs(placement: str) -> dict[str, Any]:
    """plan.fits' text as attributes: the nodes chosen, or each refusal."""
    if not placement:
        return {}
    if not placement.startswith("no room now: "):
        return {
            "llmgw.placement.fits": True,
            "llmgw.placement.nodes": [n for n in placement.split(",") if n],
        }
    detail = placement[len("no room now: ") :]
    parts = [p.strip() for p in detail.split("; ") if p.strip()]
    return {
        "llmgw.placement.fits": False,
        "llmgw.placement.detail": detail,
        # "node: why" entries; the first part says what was needed, the last
        # what eviction could do (its "MODEL ID: why" entries are not nodes).
        "llmgw.placement.refused": [
            p for p in parts if ": " in p and " " not in p.split(": ", 1)[0]
        ],
    }


@dataclass
class _Start:
    span: Span
    model: str
    job_state: JobState | None = None
    reason: str = ""
    note: str = ""
    adopted: bool = False


@dataclass
class _Pending:
    name: str
    attrs: dict[str, Any]
    at_ns: int
    error: str = ""
    links: list[Link] = field(default_factory=list)


class ReconcileTracing:
    """What the reconciler tells its traces; every method is cheap with tracing off."""

    def __init__(self, tracer: trace.Tracer | None, enabled: bool) -> None:
        self.tracer = tracer or trace.get_tracer("llmgw_slurm")
        self.enabled = enabled
        self._starts: dict[str, _Start] = {}
        # The start span's context per replica, kept after it ends: a requeue
        # opens a new start beneath the first (the job's TRACEPARENT is the first).
        self._start_ctx: dict[str, SpanContext] = {}
        self._pending: list[_Pending] = []
        self._pass: Span | None = None
        self._t0 = self._t1 = 0
        self._nodes_with_jobs = False
        # A re-listing of the nodes during the plan: start, end (ns) and node count.
        self._t_nodes = (0, 0, 0)

    # ---- the pass --------------------------------------------------------------

    def begin_pass(self) -> None:
        self._t0 = time.time_ns()
        self._pending.clear()

    def observed(self, *, nodes_listed: bool) -> None:
        self._t1 = time.time_ns()
        self._nodes_with_jobs = nodes_listed
        self._t_nodes = (0, 0, 0)

    def listing_nodes(self) -> None:
        """The pass lists the nodes again, after planning on an earlier listing."""
        self._t_nodes = (time.time_ns(), 0, 0)

    def nodes_listed(self, count: int) -> None:
        self._t_nodes = (self._t_nodes[0], time.time_ns(), count)

    @contextlib.contextmanager
    def pass_span(
        self,
        pass_id: str,
        actions: Sequence[Action],
        *,
        jobs: int,
        nodes: int,
        nodes_listed: str = "",
    ) -> Iterator[None]:
        """The pass's trace around execution; nothing when the pass did nothing."""
        if not self.enabled or (not actions and not self._pending):
            self._pending.clear()
            yield
            return
        t2 = time.time_ns()
        span = self.tracer.start_span(
            "reconcile.pass",
            context=trace.set_span_in_context(trace.INVALID_SPAN),
            start_time=self._t0,
            attributes={
                "llmgw.pass_id": pass_id,
                "llmgw.actions": len(actions),
                "llmgw.observed_changes": len(self._pending),
                # "with the jobs", "before acting", or "" (planned on an earlier listing).
                "llmgw.slurm.nodes_listed": nodes_listed,
            },
        )
        ctx = trace.set_span_in_context(span)
        self.tracer.start_span(
            "reconcile.observe",
            context=ctx,
            start_time=self._t0,
            # The squeue alone when the nodes were not listed with it.
            attributes={"llmgw.slurm.jobs": jobs, "llmgw.slurm.nodes_listed": False}
            if not self._nodes_with_jobs
            else {
                "llmgw.slurm.jobs": jobs,
                "llmgw.slurm.nodes_listed": True,
                "llmgw.slurm.nodes": nodes,
            },
        ).end(end_time=max(self._t1, self._t0))
        plan = self.tracer.start_span("reconcile.plan", context=ctx, start_time=self._t1)
        n0, n1, count = self._t_nodes
        if n1:
            # Planned on an earlier listing, which wanted to place or evict: the
            # nodes listed afresh, then planned again (both plans in this span).
            self.tracer.start_span(
                "reconcile.list_nodes",
                context=trace.set_span_in_context(plan),
                start_time=n0,
                attributes={"llmgw.slurm.nodes": count},
            ).end(end_time=max(n1, n0))
        plan.set_attribute("llmgw.slurm.nodes", nodes)
        plan.end(end_time=max(t2, self._t1))
        for p in self._pending:
            child = self.tracer.start_span(
                p.name, context=ctx, start_time=p.at_ns, attributes=p.attrs, links=p.links
            )
            if p.error:
                child.set_status(Status(StatusCode.ERROR, p.error[:500]))
            child.end(end_time=p.at_ns)
        self._pending.clear()
        self._pass = span
        try:
            with trace.use_span(span, end_on_exit=True):
                yield
        finally:
            self._pass = None

    @contextlib.contextmanager
    def action(self, a: Action, failures: Mapping[str, Failures]) -> Iterator[None]:
        """A span around executing one planned action (a child of the pass)."""
        if not self.enabled:
            yield
            return
        decision = decision_of(a.reason)
        attrs: dict[str, Any] = {
            "llmgw.model": a.model,
            "llmgw.replica": a.replica_id,
            "llmgw.reason": a.reason,
            "llmgw.decision": decision,
        }
        if a.job_id:
            attrs["llmgw.job_id"] = a.job_id
        for k, v in a.attrs.items():
            if isinstance(v, (str, bool, int, float)):
                attrs[f"llmgw.{k}"] = v
            elif isinstance(v, tuple) and all(isinstance(x, str) for x in v):
                attrs[f"llmgw.{k}"] = list(v)
        if a.kind is ActionKind.SUBMIT:
            name = "replica.place"
            attrs.update(_placement_attrs(a.placement))
            if a.replaces:
                attrs["llmgw.replaces"] = a.replaces
            f = failures.get(a.model)
            if f is not None and f.count:
                attrs["llmgw.decision"] = "restart"
                attrs["llmgw.restart.attempt"] = f.count + 1
                attrs["llmgw.restart.last_cause"] = f.cause[:500]
        elif a.kind is ActionKind.DRAIN:
            name = "replica.drain"
        elif a.kind is ActionKind.EVICT:
            name = "replica.evict"
        else:
            name = "replica.stop"
            if a.failure:
                attrs["llmgw.failure"] = True
        with self.tracer.start_as_current_span(name, attributes=attrs):
            yield
        if a.kind in (ActionKind.CANCEL, ActionKind.EVICT):
            self.end_start(
                a.replica_id,
                f"cancelled: {a.reason}",
                error=a.reason if a.failure else "",
            )

    def record(self, what: str, model: str, rid: str, reason: str, pass_id: str) -> None:
        """A decision the reconciler logged (core's ``_record``)."""
        if not self.enabled or not pass_id:
            return
        if what == "error":
            span = trace.get_current_span()
            span.set_status(Status(StatusCode.ERROR, reason[:500]))
            span.set_attribute("llmgw.error", reason[:500])
            self.end_start(rid, "failed", error=reason)
            return
        if what not in ("adopt", "requeued", "reap", "gone"):
            return  # executed actions: already their own span
        name = {"requeued": "replica.requeue"}.get(what, f"replica.{what}")
        p = _Pending(
            name,
            {"llmgw.model": model, "llmgw.replica": rid, "llmgw.reason": reason},
            time.time_ns(),
        )
        if what == "reap":
            # A job that left without being asked to: preemption, a node
            # failure, a crash, or its time limit.
            p.error = reason
            self.end_start(rid, "failed", error=f"reaped: {reason}")
        elif what == "gone":
            self.end_start(rid, f"gone: {reason}")
        elif what == "adopt":
            st = self._starts.get(rid)
            if st is not None:
                p.links.append(Link(st.span.get_span_context(), {"llmgw.link": "replica.start"}))
        elif what == "requeued":
            self._requeued(rid, model, reason)
        self._pending.append(p)
        if what == "reap":
            self._start_ctx.pop(rid, None)

    def failure(self, model: str, f: Failures, backoff_s: float, give_up_after: int) -> None:
        """A failed start counted toward the model's restart backoff."""
        if not self.enabled:
            return
        attrs: dict[str, Any] = {
            "llmgw.model": model,
            "llmgw.restart.failures": f.count,
            "llmgw.restart.backoff_seconds": backoff_s,
            "llmgw.restart.cause": f.cause[:500],
            "llmgw.restart.gave_up": f.count >= give_up_after,
        }
        if self._pass is not None:
            trace.get_current_span().add_event("model.backoff", attrs)
        else:
            self._pending.append(_Pending("model.backoff", attrs, time.time_ns()))

    # ---- the start span ----------------------------------------------------------

    def open_start(self, rid: str, model: str) -> tuple[dict[str, str], str]:
        """Open a replica's start span (child of the current span).

        Returns the job environment's additions (TRACEPARENT/TRACESTATE) and
        the traceparent for the job comment; both empty with tracing off.
        """
        if not self.enabled:
            return {}, ""
        span = self.tracer.start_span(
            "replica.start", attributes={"llmgw.model": model, "llmgw.replica": rid}
        )
        self._starts[rid] = _Start(span, model)
        self._start_ctx[rid] = span.get_span_context()
        ctx = trace.set_span_in_context(span)
        return inject_env(ctx), traceparent_of(span.get_span_context())

    def submitted(self, rid: str, job_id: str, cluster: str = "") -> None:
        """The job of a replica's start: its id and the cluster it went to ("": the
        one cluster of a server.yaml without clusters:)."""
        if not self.enabled:
            return
        attrs = {"llmgw.job_id": job_id, **({"llmgw.cluster": cluster} if cluster else {})}
        trace.get_current_span().set_attributes(attrs)
        st = self._starts.get(rid)
        if st is not None:
            st.span.set_attributes(attrs)

    def adopt(self, rid: str, model: str, job: Job) -> None:
        """Continue (or honestly restart) the start of a replica found at adoption."""
        if not self.enabled:
            return
        tp = traceparent_from_comment(job.comment)
        parent_sc = context_from_traceparent(tp) if tp else None
        attrs: dict[str, Any] = {
            "llmgw.model": model,
            "llmgw.replica": rid,
            "llmgw.job_id": job.job_id,
            "llmgw.adopted": True,
            "llmgw.start.recovered": parent_sc is not None,
        }
        if parent_sc is None:
            attrs["llmgw.start.unrecovered_reason"] = (
                "the job comment holds no trace context (submitted with tracing off, "
                "or by an older daemon)"
                if not tp
                else "the job comment's trace context does not parse"
            )
            parent = trace.set_span_in_context(trace.INVALID_SPAN)
        else:
            parent = trace.set_span_in_context(trace.NonRecordingSpan(parent_sc))
            self._start_ctx[rid] = parent_sc
        span = self.tracer.start_span("replica.start (adopted)", context=parent, attributes=attrs)
        self._starts[rid] = _Start(span, model, adopted=True)

    def _requeued(self, rid: str, model: str, reason: str) -> None:
        st = self._starts.get(rid)
        if st is not None:
            st.span.add_event("slurm.requeued", {"llmgw.reason": reason})
            return
        # The agent's spans of the next attempt hang under the first start (its
        # TRACEPARENT is in the job's environment); this one says a new start
        # began, in the same trace.
        first = self._start_ctx.get(rid)
        parent = (
            trace.set_span_in_context(trace.NonRecordingSpan(first))
            if first is not None
            else trace.set_span_in_context(trace.INVALID_SPAN)
        )
        span = self.tracer.start_span(
            "replica.start (requeued)",
            context=parent,
            attributes={"llmgw.model": model, "llmgw.replica": rid, "llmgw.reason": reason},
        )
        self._starts[rid] = _Start(span, model)

    def job_seen(self, rid: str, job: Job) -> None:
        """Slurm's view of a starting replica: each change is an event on its start span."""
        st = self._starts.get(rid)
        if st is None:
            return
        if job.state is st.job_state and job.reason == st.reason:
            return
        attrs: dict[str, Any] = {"llmgw.slurm.state": job.state.value}
        if job.state is JobState.PENDING:
            attrs["llmgw.slurm.pending_reason"] = job.reason or "(none)"
        if job.nodes:
            attrs["llmgw.nodes"] = list(job.nodes)
        if job.start_time is not None and job.state is not JobState.PENDING:
            # Slurm's own start (to the second): the daemon sees the job running
            # only at its next pass, which may be after the agent began.
            attrs["llmgw.slurm.start_time"] = job.start_time.timestamp()
        st.span.add_event(f"slurm.{job.state.value.lower()}", attrs)
        if job.state is JobState.PENDING and job.reason:
            st.span.set_attribute("llmgw.slurm.pending_reason", job.reason)
        if job.nodes:
            st.span.set_attribute("llmgw.nodes", list(job.nodes))
        st.job_state, st.reason = job.state, job.reason

    def notes(self, notes: Mapping[str, str]) -> None:
        """The plan's per-model notes (why a queued replica cannot start) on open starts."""
        if not self._starts:
            return
        for st in self._starts.values():
            note = notes.get(st.model, "")
            if note and note != st.note:
                st.span.add_event("placement.waiting", {"llmgw.note": note[:1000]})
                st.note = note

    def agent_report(self, rid: str, body: Mapping[str, Any]) -> None:
        """An agent's step report, as an event on the start span (shows even when the
        agent's own tracing is off)."""
        st = self._starts.get(rid)
        if st is None:
            return
        step, status = body.get("step"), body.get("status")
        if step and status:
            attrs: dict[str, Any] = {"llmgw.step": str(step), "llmgw.status": str(status)}
            if isinstance(body.get("elapsed_s"), (int, float)):
                attrs["llmgw.elapsed_s"] = float(body["elapsed_s"])
            st.span.add_event("agent.step", attrs)
            # The agent found weights a model job fetched, or an engine an install
            # job put in place, and names that job's trace ("...; trace=00-..."):
            # the start links to it.
            message = body.get("message")
            what = {"weights": "model_job", "engine_launch": "engine_install"}.get(str(step))
            if what and status == "done" and isinstance(message, str):
                tp = traceparent_from_comment(message)
                sc = context_from_traceparent(tp) if tp else None
                if sc is not None:
                    self.link_start(rid, sc, what)

    def end_start(self, rid: str, outcome: str, *, error: str = "", url: str = "") -> None:
        """End a replica's start span: it serves (``outcome`` "ready"), or it does not."""
        st = self._starts.pop(rid, None)
        if st is None:
            return
        st.span.set_attribute("llmgw.start.outcome", outcome[:500])
        if url:
            st.span.set_attribute("url.full", url)
        if error:
            st.span.set_status(Status(StatusCode.ERROR, error[:500]))
        elif outcome in ("ready", "serving (adopted)"):
            st.span.set_status(Status(StatusCode.OK))
        st.span.end()

    def start_context(self, model: str) -> SpanContext | None:
        """The start span of one of ``model``'s starting replicas (newest), if any."""
        for st in reversed(self._starts.values()):
            if st.model == model:
                sc = st.span.get_span_context()
                return sc if sc.is_valid else None
        return None

    def link_start(self, rid: str, sc: SpanContext, what: str) -> bool:
        """Link a replica's start span to a trace it used (a model job, an engine install)."""
        st = self._starts.get(rid)
        if st is None or not sc.is_valid:
            return False
        st.span.add_link(sc, {"llmgw.link": what})
        return True

    def close(self, outcome: str = "daemon stopped") -> None:
        """End every open start span (the daemon is stopping; adoption continues them)."""
        for rid in list(self._starts):
            self.end_start(rid, outcome)
