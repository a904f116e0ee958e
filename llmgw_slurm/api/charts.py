"""What the status page's charts show, and ``GET /api/v1/charts`` with the same numbers.

Three sources, each kept bounded in memory:

- the last hour per model (:class:`llmgw_slurm.api.history.History`, a point a
  minute, sampled from the gateway's metrics);
- GPU hours per model and per Slurm account over the last 7 days, from
  accounting (``sacct``, the service's own jobs, every run of a requeued
  one), asked again every :data:`GPU_HOURS_EVERY` seconds, or a minute after
  the daemon decided something (a replica started or ended), never per page:
  slurmdbd is shared by the whole cluster;
- the latest cold start of each model, from the trace store
  (:mod:`llmgw_slurm.tracing.store`), as a waterfall.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from datetime import datetime, timedelta
from typing import Any

from aiohttp import web

from llmgw_slurm.accounting.audit import aggregate
from llmgw_slurm.api import svgcharts
from llmgw_slurm.api.history import History
from llmgw_slurm.reconciler.clusters import ClusterSet
from llmgw_slurm.reconciler.replicas import Decision
from llmgw_slurm.router.directory import ModelDirectory
from llmgw_slurm.router.gateway import GATEWAY_KEY
from llmgw_slurm.slurm import accounting_of
from llmgw_slurm.tracing.store import TraceStore
from llmgw_slurm.tracing.waterfall import waterfall

__all__ = ["CHARTS_KEY", "GPU_HOURS_EVERY", "Charts", "add_chart_routes", "page_data"]

log = logging.getLogger(__name__)


def _everyone(model: str) -> bool:
    return True


GPU_HOURS_EVERY = 600.0
# How often the daemon looks for a reason to ask accounting sooner.
GPU_HOURS_CHECK = 60.0
# An open start's waterfall grows with the clock: built again this often.
COLD_STARTS_EVERY = 5.0
GPU_HOURS_DAYS = 7


class Charts:
    """The charts' three sources. ``clusters``: whose accounting has the GPU hours of
    the jobs named ``prefix``; ``decisions``: the daemon's decision log (a decision
    asks accounting again sooner)."""

    def __init__(
        self,
        history: History,
        store: TraceStore | None,
        *,
        clusters: ClusterSet | None = None,
        prefix: str = "",
        decisions: Sequence[Decision] = (),
    ) -> None:
        self.history = history
        self.store = store
        self.clusters = clusters
        self.prefix = prefix
        self.decisions = decisions
        self.gpu_hours: dict[str, Any] = {"at": None, "by_model": {}, "by_account": {}}
        # Per set of models left out (see _only_visible; most pages leave out
        # none), for the history's latest sample only.
        self._model_charts: dict[frozenset[str], tuple[int, dict[str, Any]]] = {}
        self._cold: tuple[tuple[int, int], list[dict[str, Any]]] | None = None

    async def refresh_gpu_hours(self) -> None:
        """GPU hours of the service's jobs over the last 7 days, from accounting."""
        if self.clusters is None:
            return
        now = datetime.now()
        since = now - timedelta(days=GPU_HOURS_DAYS)
        prefix, backends = self.prefix, self.clusters.backends()
        recs = await accounting_of(backends, since, now, name_prefix=prefix, duplicates=True)
        by_model: dict[str, float] = {}
        for row in aggregate(recs, prefix, since, now, "month", now):
            by_model[row.model] = by_model.get(row.model, 0.0) + row.gpu_hours
        by_account: dict[str, float] = {}
        for r in recs:
            start = max(r.start, since) if r.start is not None else None
            if start is None or not r.gpus:
                continue
            end = r.end or now
            hours = r.gpus * max(0.0, (end - start).total_seconds()) / 3600.0
            by_account[r.account or "(none)"] = by_account.get(r.account or "(none)", 0.0) + hours
        self.gpu_hours = {
            "at": time.time(),
            "since": since.timestamp(),
            "by_model": by_model,
            "by_account": by_account,
        }

    def cold_starts(self, now: float) -> list[dict[str, Any]]:
        """The latest start of each model as a waterfall, newest first; built again
        when the store changed, or every few seconds while a start is open."""
        if self.store is None:
            return []
        key = (self.store.version, int(now // COLD_STARTS_EVERY))
        if self._cold is None or self._cold[0] != key:
            self._cold = (key, self._cold_starts(self.store, now))
        return self._cold[1]

    @staticmethod
    def _cold_starts(store: TraceStore, now: float) -> list[dict[str, Any]]:
        latest: dict[str, dict[str, Any]] = {}
        for sp in store.starts():
            model = str(sp["attrs"].get("llmgw.model", ""))
            if model not in latest or sp["start"] > latest[model]["start"]:
                latest[model] = sp
        ordered = sorted(latest.values(), key=lambda s: -s["start"])
        return [
            waterfall(store.spans(sp["trace_id"]), sp, now).to_json()
            for sp in ordered[: svgcharts.MAX_WATERFALLS]
        ]

    def model_charts(
        self, history: dict[str, Any], hidden: frozenset[str] = frozenset()
    ) -> dict[str, Any]:
        """The hour's small multiples of ``history`` (which leaves out ``hidden``),
        computed once per sample of the history and set of models left out: with 500
        models a drawing costs about half a second."""
        sample = self.history.samples
        cached = self._model_charts.get(hidden)
        if cached is None or cached[0] != sample:
            if cached is None and len(self._model_charts) >= 8:
                # Bounded: a site has a handful of audiences (no key, a few groups).
                self._model_charts.clear()
            at = history.get("sampled_at") or time.time()
            cached = (sample, svgcharts.model_charts(history, at))
            self._model_charts[hidden] = cached
        return cached[1]

    def page(self, visible: Callable[[str], bool] = _everyone) -> dict[str, Any]:
        return _page(self, visible)

    def to_json(self, visible: Callable[[str], bool] = _everyone) -> dict[str, Any]:
        """The charts' numbers; ``visible``: the models the caller may see (the
        catalog's access rules), the others left out as if they did not exist."""
        now = time.time()
        data = {
            "now": now,
            "history": self.history.to_json(),
            "gpu_hours": self.gpu_hours,
            "cold_starts": self.cold_starts(now),
        }
        return _only_visible(data, visible)

    def _last_decision(self) -> float:
        ds = self.decisions
        return ds[-1].at if ds else 0.0

    async def run(self, stop: asyncio.Event) -> None:
        """Ask accounting every GPU_HOURS_EVERY seconds, or sooner (at most once a
        minute) when the daemon decided something since: a replica started or ended."""
        asked_at, seen = -float("inf"), -1.0
        while not stop.is_set():
            last = self._last_decision()
            if last != seen or time.monotonic() - asked_at >= GPU_HOURS_EVERY:
                asked_at, seen = time.monotonic(), last
                try:
                    await self.refresh_gpu_hours()
                except Exception as exc:  # shown as "not known yet"; the daemon goes on
                    log.warning("charts: GPU hours from accounting failed: %s", exc)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), GPU_HOURS_CHECK)


def _only_visible(data: dict[str, Any], visible: Callable[[str], bool]) -> dict[str, Any]:
    """``data`` without the models ``visible`` hides; ``data`` itself when it hides none
    (the common case: the cached small multiples stay valid)."""
    hist, gh = data["history"], data["gpu_hours"]
    models = set(hist["models"]) | set(gh.get("by_model") or {})
    models |= {str(w.get("model")) for w in data["cold_starts"]}
    hidden = frozenset(m for m in models if not visible(m))
    if not hidden:
        return data
    return {
        **data,
        "history": {**hist, "models": {m: v for m, v in hist["models"].items() if m not in hidden}},
        "gpu_hours": {
            **gh,
            "by_model": {m: v for m, v in (gh.get("by_model") or {}).items() if m not in hidden},
        },
        "cold_starts": [w for w in data["cold_starts"] if str(w.get("model")) not in hidden],
        "hidden": hidden,
    }


CHARTS_KEY = web.AppKey("llmgw.charts", Charts)


def add_chart_routes(
    app: web.Application,
    models: ModelDirectory,
    clusters: ClusterSet,
    decisions: Sequence[Decision],
    prefix: str,
    store: TraceStore | None,
) -> Charts:
    """``GET /api/v1/charts`` on the gateway app, and the samplers for its lifetime;
    ``models``: whose replicas the history counts (the reconciler's directory)."""

    def replicas() -> dict[str, int]:
        return {m.name: sum(m.replicas.values()) for m in models.models()}

    history = History(app[GATEWAY_KEY].metrics, replicas)
    charts = Charts(history, store, clusters=clusters, prefix=prefix, decisions=decisions)
    app[CHARTS_KEY] = charts

    async def get(request: web.Request) -> web.Response:
        data = charts.to_json(app[GATEWAY_KEY].visible_to(request))
        data.pop("hidden", None)
        return web.json_response(data)

    async def samplers(_: web.Application) -> Any:
        stop = asyncio.Event()
        tasks = [
            asyncio.create_task(charts.history.run(stop)),
            asyncio.create_task(charts.run(stop)),
        ]
        yield
        stop.set()
        await asyncio.gather(*tasks, return_exceptions=True)

    app.router.add_get("/api/v1/charts", get)
    app.cleanup_ctx.append(samplers)
    return charts


def page_data(
    app: web.Application, visible: Callable[[str], bool] = _everyone
) -> dict[str, Any] | None:
    """The charts' values for the status page template; None on an app without charts."""
    charts = app.get(CHARTS_KEY)
    if charts is None:
        return None
    return charts.page(visible)


def _page(charts: Charts, visible: Callable[[str], bool]) -> dict[str, Any]:
    data = charts.to_json(visible)
    gh = data["gpu_hours"]
    hist = data["history"]
    small = charts.model_charts(hist, data.get("hidden", frozenset()))
    return {
        "models": small,
        "gpu_at": gh["at"],
        "gpu_by_model": svgcharts.bars(gh["by_model"], "GPU h"),
        "gpu_by_account": svgcharts.bars(gh["by_account"], "GPU h"),
        "cold_starts": [svgcharts.waterfall_chart(w) for w in data["cold_starts"]],
    }
