"""The one duration parser and formatter (llmgw_slurm.base.durations) and the CLIs' --since."""

from __future__ import annotations

from datetime import datetime

import click
import pytest

from llmgw_slurm.base.durations import format_duration, parse_duration, parse_since, slurm_time
from llmgw_slurm.cli.common import parse_when


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("30s", 30.0),
        ("15m", 900.0),
        ("4h", 14400.0),
        ("1d", 86400.0),
        ("2w", 1209600.0),
        ("1h30m", 5400.0),
        ("500ms", 0.5),
        ("90", 90.0),
        ("2.5", 2.5),
        ("4:00:00", 14400.0),
        ("1-00:00:00", 86400.0),
        ("10:30", 630.0),
    ],
)
def test_our_durations(text: str, seconds: float) -> None:
    assert parse_duration(text) == seconds


@pytest.mark.parametrize(
    "text", ["", "soon", "5 parsecs", "-5s", "1h x", "4:75:00", "\u0661\u0662s"]
)
def test_bad_durations_say_what_is_valid(text: str) -> None:
    with pytest.raises(ValueError, match="expected a duration like 30s"):
        parse_duration(text)


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("30", 1800),
        ("1:30", 90),
        ("01:00:00", 3600),
        ("2-0", 172800),
        ("1-12", 129600),
        ("1-02:03:04", 93784),
        ("1-2:30", 95400),
    ],
)
def test_slurm_times_read_a_bare_number_as_minutes(text: str, seconds: int) -> None:
    assert slurm_time(text) == seconds


def test_a_bare_number_can_be_refused_as_a_slurm_time() -> None:
    with pytest.raises(ValueError, match="not a Slurm time"):
        slurm_time("30", bare_minutes=False)
    with pytest.raises(ValueError, match="under 60"):
        slurm_time("1:61:00")


def test_since_takes_now_durations_and_dates() -> None:
    now = 1_000_000.0
    assert parse_since("now", now) == now
    assert parse_since("30m", now) == now - 1800
    assert parse_since("12h", now) == now - 43200
    assert parse_since("2w", now) == now - 14 * 86400
    assert parse_since("2024-05-01", now) == datetime(2024, 5, 1).timestamp()
    assert parse_since("2024-05-01T08:00", now) == datetime(2024, 5, 1, 8).timestamp()


def test_since_in_both_clis_is_one_parser_with_a_usage_error() -> None:
    # `llmgw usage --since 30m` and `llmgw-admin audit --since 30m` both go through
    # parse_when; 30m was refused by audit before.
    assert parse_when("30m", 7200.0) == 5400.0
    with pytest.raises(click.BadParameter, match="'yesterday': use now, a duration ago"):
        parse_when("yesterday", 0.0)


@pytest.mark.parametrize(
    ("seconds", "text"),
    [(-3, "0s"), (45.9, "45s"), (187, "3m07s"), (7500, "2h05m"), (273600, "3d04h")],
)
def test_format_duration(seconds: float, text: str) -> None:
    assert format_duration(seconds) == text
