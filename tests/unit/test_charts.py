"""Terminal charts: bars to an eighth of a cell, as wide as the terminal, colour only on request."""

from __future__ import annotations

import pytest

from llmgw_slurm.accounting.audit import AuditRow
from llmgw_slurm.cli import charts


def test_a_bar_is_exact_to_an_eighth_of_a_cell() -> None:
    assert charts.bar(1, 1, 10) == "█" * 10
    assert charts.bar(0.5, 1, 10) == "█" * 5
    assert charts.bar(0.0625, 1, 10) == "▋"  # 5/8 of a cell
    assert charts.bar(3, 1, 4) == "█" * 4  # over the top: capped
    assert charts.bar(0, 1, 10) == charts.bar(1, 0, 10) == ""


@pytest.mark.parametrize("cols", [40, 80, 132])
def test_bar_charts_fit_the_width_and_scale_to_the_largest(cols: int) -> None:
    rows = [("alpha", 10.0, "10.00 h"), ("a-very-long-model-name-" * 3, 2.5, "2.50 h")]
    lines = charts.bar_chart(rows, cols=cols, color=False, title="GPU hours")
    assert lines[0] == "GPU hours"
    assert all(len(line) <= cols for line in lines)
    longest = lines[1].count("█")
    assert longest > 0 and lines[2].count("█") == longest // 4


def test_colour_is_ansi_only_when_asked_and_the_bars_are_the_same() -> None:
    rows = [("alpha", 1.0, "1"), ("beta", 0.5, "0.5")]
    plain = charts.bar_chart(rows, cols=60, color=False)
    painted = charts.bar_chart(rows, cols=60, color=True)
    assert "\x1b[" not in "".join(plain) and "\x1b[" in "".join(painted)
    strip = [ln.replace("\x1b[0m", "").split("\x1b[")[0] for ln in painted]
    assert [ln.split(" ")[0] for ln in strip] == ["alpha", "beta"]


def test_no_color_env_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NO_COLOR", "1")
    assert charts.use_color(False) is False
    assert charts.use_color(True) is False


def test_audit_chart_sums_by_model_and_by_period() -> None:
    rows = [
        AuditRow("2026-12-01", "alpha", jobs=1, gpu_hours=4.0),
        AuditRow("2026-12-01", "beta", jobs=1, gpu_hours=1.0),
        AuditRow("2026-12-02", "alpha", jobs=2, gpu_hours=2.0),
    ]
    lines = charts.audit_chart(rows, by="day", cols=60, color=False)
    i = lines.index("GPU hours by day")
    by_model, by_day = lines[1:i - 1], lines[i + 1 :]
    assert [ln.split()[:3] for ln in by_model] == [["alpha", "6.00", "h"], ["beta", "1.00", "h"]]
    assert [ln.split()[:2] for ln in by_day] == [["2026-12-01", "5.00"], ["2026-12-02", "2.00"]]
    assert all(len(ln) <= 60 for ln in lines)


def test_usage_chart_orders_by_tokens_and_shortens_counts() -> None:
    rows = [
        {"model": "tiny", "requests": 2, "total_tokens": 17},
        {"model": "big", "requests": 1500, "total_tokens": 2_500_000},
    ]
    lines = charts.usage_chart(rows, cols=50, color=False)
    assert lines[0] == "tokens by model (prompt + completion)"
    assert lines[1].split()[:2] == ["big", "2.5M"] and lines[2].split()[:2] == ["tiny", "17"]
    assert lines[5].split()[:2] == ["big", "1.5k"]
