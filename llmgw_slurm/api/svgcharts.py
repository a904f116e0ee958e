"""The status page's charts as numbers for the template to draw as inline SVG.

Only geometry is computed here (coordinates, scales, labels as plain
strings); the template (``templates/status.html.j2``) writes the SVG
elements, with autoescape, so a model name or a Slurm account can never
become markup. No script, no external asset: a browser draws it as it is,
and the page's Content-Security-Policy forbids anything else.

Each drawn series carries its numbers in ``data-values`` (and the chart its
model in ``data-model``), so that a test, or a curious admin, can check the
picture against ``GET /api/v1/charts``.

The page stays fast with many models by drawing the busiest ones only
(:data:`MAX_MODEL_CHARTS`, by requests then replicas over the hour) and the
latest :data:`MAX_WATERFALLS` cold starts; the counts left out are said.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

__all__ = [
    "MAX_BARS",
    "MAX_MODEL_CHARTS",
    "MAX_WATERFALLS",
    "PANELS",
    "bars",
    "model_charts",
    "waterfall_chart",
]

MAX_MODEL_CHARTS = 40
MAX_WATERFALLS = 12
MAX_BARS = 25
W, H = 160.0, 44.0
# (title, series names in History.SERIES order, unit)
PANELS: tuple[tuple[str, tuple[str, ...], str], ...] = (
    ("requests/s", ("rps",), "/s"),
    ("tokens/s", ("tokens_per_s",), "/s"),
    ("time to first byte p50, p95", ("ttfb_p50", "ttfb_p95"), "s"),
    ("held requests", ("held",), ""),
    ("replicas", ("replicas",), ""),
)


def _num(v: float) -> str:
    return f"{v:.4g}"


def _panel(
    rows: Sequence[Sequence[Any]],
    names: Sequence[str],
    idx: Mapping[str, int],
    t0: float,
    t1: float,
) -> dict[str, Any]:
    vals = [[r[idx[n]] for r in rows] for n in names]
    vmax = max([v for vs in vals for v in vs if isinstance(v, int | float)] or [0.0])
    scale = vmax if vmax > 0 else 1.0
    span = max(t1 - t0, 1e-9)
    series = []
    for n, vs in zip(names, vals, strict=True):
        pts = [
            f"{(r[0] - t0) / span * W:.1f},{H - float(v) / scale * H:.1f}"
            for r, v in zip(rows, vs, strict=True)
            if isinstance(v, int | float)
        ]
        series.append(
            {
                "name": n,
                "points": " ".join(pts),
                "data": " ".join("-" if v is None else _num(float(v)) for v in vs),
            }
        )
    return {"series": series, "max": _num(vmax)}


def model_charts(history: Mapping[str, Any], now: float) -> dict[str, Any]:
    """The per-model small multiples over the last hour, busiest models first."""
    names = ["t", *history["series"]]
    idx = {n: i for i, n in enumerate(names)}
    t0, t1 = now - 3600.0, now

    def busy(item: tuple[str, list[list[Any]]]) -> tuple[float, float]:
        rows = item[1]
        return (
            -sum(r[idx["rps"]] for r in rows),
            -max((r[idx["replicas"]] for r in rows), default=0),
        )

    models = sorted(history["models"].items(), key=lambda kv: (busy(kv), kv[0]))
    shown = []
    for model, rows in models[:MAX_MODEL_CHARTS]:
        rows = [r for r in rows if r[0] >= t0]
        panels = [
            {"title": title, "unit": unit, **_panel(rows, series, idx, t0, t1)}
            for title, series, unit in PANELS
        ]
        shown.append({"model": model, "panels": panels})
    return {"w": W, "h": H, "models": shown, "left_out": max(0, len(models) - len(shown))}


def bars(values: Mapping[str, float], unit: str) -> dict[str, Any]:
    """A horizontal bar chart (largest first) of e.g. GPU hours by model; past
    :data:`MAX_BARS`, the rest as one bar ("N others")."""
    items = sorted(values.items(), key=lambda kv: (-kv[1], kv[0]))
    if len(items) > MAX_BARS:
        rest = items[MAX_BARS - 1 :]
        items = [*items[: MAX_BARS - 1], (f"({len(rest)} others)", sum(v for _, v in rest))]
    vmax = max([v for _, v in items] or [0.0]) or 1.0
    width = 300.0
    return {
        "h": 18 * len(items) + 4,
        "bars": [
            {
                "label": k,
                "y": 18 * i + 2,
                "w": f"{v / vmax * width:.1f}",
                "value": _num(v),
                "text": f"{v:.3g} {unit}",
            }
            for i, (k, v) in enumerate(items)
        ],
    }


def waterfall_chart(wf: Mapping[str, Any], width: float = 600.0) -> dict[str, Any]:
    """A start's waterfall (:meth:`llmgw_slurm.tracing.waterfall.Waterfall.to_json`) as bars."""
    rows = [r for r in wf["rows"] if r["counted"] and r["depth"] in (0, 2)]
    span = max([r["offset_s"] + r["duration_s"] for r in rows] or [1.0]) or 1.0
    out = []
    for i, r in enumerate(rows):
        out.append(
            {
                "label": ("   " if r["depth"] else "") + r["label"],
                "y": 16 * i + 2,
                "x": f"{r['offset_s'] / span * width:.1f}",
                "w": f"{max(r['duration_s'] / span * width, 1.0):.1f}",
                "depth": r["depth"],
                "value": _num(r["duration_s"]),
                "text": f"{r['duration_s']:.2f}s",
            }
        )
    tts = wf.get("time_to_serve_s")
    return {
        "model": wf.get("model", ""),
        "replica": wf.get("replica", ""),
        "trace_id": wf.get("trace_id", ""),
        "time_to_serve": f"{tts:.1f}s" if isinstance(tts, int | float) else wf.get("outcome", ""),
        "h": 16 * len(out) + 4,
        "w": width,
        "rows": out,
    }
