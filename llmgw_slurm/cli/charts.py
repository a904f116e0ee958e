"""Charts in the terminal: Unicode block bars, as wide as the terminal, colour optional.

Used by ``llmgw-admin trace`` (a start's waterfall), ``llmgw-admin audit
--chart`` and ``llmgw usage --chart``. Colour is ANSI, only on a terminal, and
never with ``--no-color`` or ``NO_COLOR`` set (https://no-color.org): the bars
themselves carry the data, colour only tells the rows apart.
"""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from llmgw_slurm.base.durations import format_duration

__all__ = [
    "audit_chart",
    "bar",
    "bar_chart",
    "usage_chart",
    "use_color",
    "waterfall_lines",
    "width",
]

# Eighths of a cell: a bar's length is exact to an eighth of a character.
_EIGHTHS = " ▏▎▍▌▋▊▉"
_FULL = "█"
_COLORS = ("36", "33", "32", "35", "34", "31")


def width() -> int:
    """The terminal's width (COLUMNS wins; 80 when not a terminal), at least 40."""
    return max(40, shutil.get_terminal_size((80, 24)).columns)


def use_color(no_color: bool) -> bool:
    return not no_color and not os.environ.get("NO_COLOR") and sys.stdout.isatty()


def _paint(text: str, code: str, color: bool) -> str:
    return f"\x1b[{code}m{text}\x1b[0m" if color and text.strip() else text


def bar(value: float, vmax: float, cells: int) -> str:
    """A bar of ``value``/``vmax`` of ``cells`` characters, to an eighth of one."""
    if vmax <= 0 or value <= 0 or cells <= 0:
        return ""
    eighths = round(min(value, vmax) / vmax * cells * 8)
    full, part = divmod(eighths, 8)
    return _FULL * full + (_EIGHTHS[part] if part else "")


def bar_chart(
    rows: Sequence[tuple[str, float, str]], *, cols: int, color: bool, title: str = ""
) -> list[str]:
    """``(label, value, shown value)`` rows as horizontal bars scaled to the largest."""
    if not rows:
        return [title, "(nothing to chart)"] if title else ["(nothing to chart)"]
    lw = min(max(len(r[0]) for r in rows), cols // 3)
    vw = max(len(r[2]) for r in rows)
    cells = max(10, cols - lw - vw - 3)
    vmax = max(r[1] for r in rows)
    out = [title] if title else []
    for i, (label, value, shown) in enumerate(rows):
        b = _paint(bar(value, vmax, cells), _COLORS[i % len(_COLORS)], color)
        out.append(f"{label[:lw]:<{lw}} {shown:>{vw}} {b}")
    return out


def _offset_bar(start: float, dur: float, span: float, cells: int) -> str:
    """Spaces up to ``start``, then the bar for ``dur`` (at least a sliver, so it shows)."""
    lead = int(start / span * cells) if span > 0 else 0
    body = bar(dur, span, cells) or "▏"
    return " " * min(lead, cells - 1) + body[: max(1, cells - lead)]


def waterfall_lines(wf: Mapping[str, Any], *, cols: int, color: bool) -> list[str]:
    """A start's waterfall (:meth:`llmgw_slurm.tracing.waterfall.Waterfall.to_json`) as text."""
    rows = wf["rows"]
    tts = wf.get("time_to_serve_s")
    head = (
        f"{wf.get('model') or '?'} replica {wf.get('replica') or '?'}  trace {wf['trace_id']}  "
        f"{wf.get('outcome') or ''}"
    ).rstrip()
    out = [head]
    if tts is not None:
        out.append(f"time to serve: {tts:.3f}s (the rows at the left margin add up to it)")
    if not rows:
        return [*out, "(no spans)"]
    span = max([r["offset_s"] + r["duration_s"] for r in rows if r.get("counted", True)] or [1.0])
    labels = [
        "  " * r["depth"] + r["label"] + (f" [{r['detail']}]" if 0 < len(r["detail"]) <= 24 else "")
        for r in rows
    ]
    lw = min(max(len(lb) for lb in labels), cols // 3)
    cells = max(10, cols - lw - 22)
    for r, lb in zip(rows, labels, strict=True):
        dur = (
            f"{r['duration_s']:.3f}s" if r["duration_s"] < 60 else format_duration(r["duration_s"])
        )
        start = f"+{r['offset_s']:.3f}"
        if r.get("counted", True):
            b = _offset_bar(r["offset_s"], r["duration_s"], span, cells)
            b = _paint(b, _COLORS[min(r["depth"], len(_COLORS) - 1)], color)
        else:
            b = "→ (not part of the time to serve)"
        out.append(f"{lb[:lw]:<{lw}} {start:>9} {dur:>9} {b}")
    return out


def audit_chart(rows: Sequence[Any], *, by: str, cols: int, color: bool) -> list[str]:
    """``llmgw-admin audit --chart``: GPU hours by model, then by period (AuditRow rows)."""
    models: dict[str, float] = {}
    periods: dict[str, float] = {}
    for r in rows:
        models[r.model] = models.get(r.model, 0.0) + r.gpu_hours
        periods[r.period] = periods.get(r.period, 0.0) + r.gpu_hours
    by_model = sorted(models.items(), key=lambda kv: -kv[1])
    return [
        *bar_chart(
            [(m, h, f"{h:.2f} h") for m, h in by_model],
            cols=cols,
            color=color,
            title="GPU hours by model",
        ),
        "",
        *bar_chart(
            [(p, h, f"{h:.2f} h") for p, h in sorted(periods.items())],
            cols=cols,
            color=color,
            title=f"GPU hours by {by}",
        ),
    ]


def _count(n: float) -> str:
    for unit, size in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= size:
            return f"{n / size:.1f}{unit}"
    return f"{n:.0f}"


def usage_chart(rows: Sequence[Mapping[str, Any]], *, cols: int, color: bool) -> list[str]:
    """``llmgw usage --chart``: tokens, then requests, by model (the usage API's rows)."""

    def num(r: Mapping[str, Any], k: str) -> float:
        v = r.get(k)
        return float(v) if isinstance(v, int | float) else 0.0

    ordered = sorted(rows, key=lambda r: -num(r, "total_tokens"))
    return [
        *bar_chart(
            [
                (str(r.get("model")), num(r, "total_tokens"), _count(num(r, "total_tokens")))
                for r in ordered
            ],
            cols=cols,
            color=color,
            title="tokens by model (prompt + completion)",
        ),
        "",
        *bar_chart(
            [
                (str(r.get("model")), num(r, "requests"), _count(num(r, "requests")))
                for r in ordered
            ],
            cols=cols,
            color=color,
            title="requests by model",
        ),
    ]
