"""The status page's charts: the hour sampled from the gateway's metrics, drawn as inline SVG
whose numbers are the API's."""

from __future__ import annotations

from html.parser import HTMLParser
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from llmgw_slurm.api import svgcharts
from llmgw_slurm.api.history import History, quantile
from llmgw_slurm.api.status_page import render_page
from llmgw_slurm.router.directory import ModelInfo
from llmgw_slurm.router.metrics import GatewayMetrics


class _Dir:
    def models(self) -> list[ModelInfo]:
        return []


class Clock:
    def __init__(self) -> None:
        self.t = 1_000_000.0

    def __call__(self) -> float:
        return self.t


def test_quantiles_from_cumulative_buckets() -> None:
    # 10 answers under 0.1 s, 10 between 0.1 and 1 s.
    b = [(0.1, 10.0), (1.0, 20.0), (float("inf"), 20.0)]
    assert quantile(b, 0.5) == pytest.approx(0.1)
    assert quantile(b, 0.95) == pytest.approx(0.1 + 0.9 * 0.9)
    assert quantile([(0.1, 0.0), (float("inf"), 0.0)], 0.5) is None
    # Beyond the last finite bucket all that is known is that bound.
    assert quantile([(0.1, 0.0), (float("inf"), 4.0)], 0.5) == 0.1


def test_history_is_the_change_per_minute_and_forgets_models_that_left() -> None:
    m = GatewayMetrics(_Dir(), CollectorRegistry())  # type: ignore[arg-type]
    clock = Clock()
    reps = {"alpha": 2, "beta": 0}
    h = History(m, lambda: dict(reps), step=60, points=3, clock=clock)
    h.sample()
    for _ in range(30):
        m.answered("alpha", 200, 0.5, 0.2)
    m.counted("alpha", 0, 600)
    m.held.labels("beta").set(4)
    clock.t += 60
    h.sample()
    alpha = h.series()["alpha"]
    assert alpha[1].rps == pytest.approx(0.5) and alpha[1].tokens_per_s == pytest.approx(10)
    assert 0.1 < (alpha[1].ttfb_p50 or 0) <= 0.25 and alpha[1].replicas == 2
    beta = h.series()["beta"][1]
    assert beta.held == 4 and beta.rps == 0 and beta.ttfb_p50 is None
    for _ in range(5):
        clock.t += 60
        h.sample()
    assert len(h.series()["alpha"]) == 3  # bounded
    assert h.to_json() is h.to_json()  # built once per sample
    del reps["beta"]
    h.sample()
    assert set(h.series()) == {"alpha"}


class _Svg(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.found: list[tuple[str, dict[str, str]]] = []
        self.tags: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append(tag)
        self.found.append((tag, {k: v or "" for k, v in attrs}))


def _status() -> dict[str, Any]:
    return {"models": [], "decisions": [], "nodes": [], "now": 1_000_000.0}


def test_the_svgs_carry_the_apis_numbers_and_escape_names() -> None:
    now = 1_000_000.0
    evil = "<script>x</script>"
    history = {
        "series": ("rps", "tokens_per_s", "ttfb_p50", "ttfb_p95", "held", "replicas"),
        "models": {
            evil: [[now - 120, 1.0, 10.0, 0.1, 0.3, 0, 1], [now - 60, 2.0, 20.0, None, None, 1, 1]]
        },
    }
    wf = {
        "model": evil,
        "replica": "abcd1234",
        "trace_id": "a" * 32,
        "time_to_serve_s": 3.0,
        "rows": [
            {
                "label": "queued in Slurm",
                "depth": 0,
                "counted": True,
                "offset_s": 0,
                "duration_s": 1.0,
            },
            {"label": "weights", "depth": 2, "counted": True, "offset_s": 1, "duration_s": 0.5},
            {"label": "serving", "depth": 0, "counted": False, "offset_s": 3, "duration_s": 9},
        ],
    }
    charts = {
        "models": svgcharts.model_charts(history, now),
        "gpu_at": now,
        "gpu_by_model": svgcharts.bars({evil: 3.0, "b": 1.5}, "GPU h"),
        "gpu_by_account": svgcharts.bars({"acct": 4.5}, "GPU h"),
        "cold_starts": [svgcharts.waterfall_chart(wf)],
    }
    page = render_page(_status(), "http://x/v1", charts)
    assert "<script>" not in page and "&lt;script&gt;" in page
    p = _Svg()
    p.feed(page)
    lines = {a["data-series"]: a["data-values"] for t, a in p.found if t == "polyline"}
    assert lines == {
        "rps": "1 2",
        "tokens_per_s": "10 20",
        "ttfb_p50": "0.1 -",
        "ttfb_p95": "0.3 -",
        "held": "0 1",
        "replicas": "1 1",
    }
    bars = [(a["data-label"], a["data-value"]) for t, a in p.found if t == "g"]
    assert (evil, "3") in bars and ("acct", "4.5") in bars
    assert ("queued in Slurm", "1") in bars and ("   weights", "0.5") in bars
    assert not any(lb == "serving" for lb, _ in bars)  # after the time to serve
    # The tables-only page has no SVG at all.
    assert "<svg" not in render_page(_status(), "http://x/v1")


def test_only_the_busiest_models_are_drawn_and_the_rest_is_said() -> None:
    now = 1_000_000.0
    models = {
        f"m{i:03d}": [[now - 60, float(i), 0.0, None, None, 0, 1]]
        for i in range(svgcharts.MAX_MODEL_CHARTS + 5)
    }
    history = {
        "series": ("rps", "tokens_per_s", "ttfb_p50", "ttfb_p95", "held", "replicas"),
        "models": models,
    }
    got = svgcharts.model_charts(history, now)
    assert got["left_out"] == 5
    assert got["models"][0]["model"] == f"m{svgcharts.MAX_MODEL_CHARTS + 4:03d}"


def test_a_model_hidden_from_the_caller_is_in_none_of_its_charts() -> None:
    from llmgw_slurm.api.charts import Charts, _page

    m = GatewayMetrics(_Dir(), CollectorRegistry())  # type: ignore[arg-type]
    clock = Clock()
    h = History(m, lambda: {"alpha": 1, "beta": 1}, step=60, points=3, clock=clock)
    h.sample()
    clock.t += 60
    h.sample()
    charts = Charts(h, None)  # no clusters, no decisions, no store
    charts.gpu_hours = {"at": clock.t, "since": 0.0, "by_model": {"alpha": 2.0, "beta": 3.0},
                        "by_account": {"p1": 5.0}}  # fmt: skip

    def drawn(page: dict[str, Any]) -> set[str]:
        return {c["model"] for c in page["models"]["models"]}

    def no_beta(model: str) -> bool:
        return model != "beta"

    assert drawn(_page(charts, lambda _: True)) == {"alpha", "beta"}
    page = _page(charts, no_beta)
    assert drawn(page) == {"alpha"}
    assert [b["label"] for b in page["gpu_by_model"]["bars"]] == ["alpha"]
    data = charts.to_json(no_beta)
    assert set(data["history"]["models"]) == {"alpha"} and "beta" not in data["gpu_hours"]["by_model"]
    # Drawn once per sample for each audience, not per page view.
    assert _page(charts, no_beta)["models"] is page["models"]
    assert drawn(_page(charts, lambda _: True)) == {"alpha", "beta"}
