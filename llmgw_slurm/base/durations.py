"""Durations: the one parser and the one formatter.

Two syntaxes, both read here and nowhere else:

- ours, in server.yaml, agent.yaml, models.yaml and on the command line
  (``--since 30m``): ``30s``, ``15m``, ``4h``, ``1d``, ``2w``, ``1h30m``,
  ``500ms``, a number of seconds, or a Slurm time with ``:`` or ``-``;
- Slurm's own (``#SBATCH --time``, squeue's limits): ``MM``, ``MM:SS``,
  ``HH:MM:SS``, ``D-HH``, ``D-HH:MM``, ``D-HH:MM:SS``, where a bare number is
  *minutes*. Ours never reads a bare number as minutes; where both meet (a
  model's ``time_limit``) the catalog refuses a bare number as ambiguous.

Everything is ASCII only: Python's ``\\d`` takes any script's digits, which
would load here and then fail in sbatch.
"""

from __future__ import annotations

import math
import re
from datetime import datetime

__all__ = [
    "DURATION_HELP",
    "SINCE_HELP",
    "format_duration",
    "parse_duration",
    "parse_since",
    "slurm_time",
]

DURATION_HELP = "a duration like 30s, 15m, 4h, 1d, 2w, 1h30m, 4:00:00, or a number of seconds"
SINCE_HELP = "now, a duration ago (30m, 12h, 7d, 2w) or a date (2024-05-01, 2024-05-01T08:00)"

_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, "w": 7 * 86400.0}
_UNIT_RE = re.compile(r"(\d+(?:\.\d+)?)\s*(ms|s|m|h|d|w)", re.ASCII)
_NUM_RE = re.compile(r"\d+(?:\.\d+)?", re.ASCII)
# Slurm's forms; the groups are days, then up to three colon-separated numbers.
_SLURM_DAYS = re.compile(r"(\d+)-(\d+)(?::(\d+))?(?::(\d+))?", re.ASCII)
_SLURM_CLOCK = re.compile(r"(\d+)(?::(\d+))?(?::(\d+))?", re.ASCII)


def slurm_time(text: str, *, bare_minutes: bool = True) -> int:
    """Seconds of a time in Slurm's syntax; ValueError when ``text`` is not one.

    ``bare_minutes`` False refuses a bare number (``30``): callers that also
    read our syntax, where it would mean seconds.
    """
    t = text.strip()
    m = _SLURM_DAYS.fullmatch(t)
    if m:
        d, h, mi, s = (int(g) if g else 0 for g in m.groups())
        if mi >= 60 or s >= 60:
            raise ValueError(f"{text!r}: minutes and seconds must be under 60")
        return ((d * 24 + h) * 60 + mi) * 60 + s
    m = _SLURM_CLOCK.fullmatch(t)
    if not m or (m.group(2) is None and not bare_minutes):
        raise ValueError(f"{text!r} is not a Slurm time (MM, MM:SS, HH:MM:SS or D-HH:MM:SS)")
    nums = [int(g) for g in m.groups() if g is not None]
    if len(nums) == 1:
        return nums[0] * 60
    if len(nums) == 2:
        mi, s = nums
        if s >= 60:
            raise ValueError(f"{text!r}: seconds must be under 60")
        return mi * 60 + s
    h, mi, s = nums
    if mi >= 60 or s >= 60:
        raise ValueError(f"{text!r}: minutes and seconds must be under 60")
    return (h * 60 + mi) * 60 + s


def _unit_seconds(text: str) -> float | None:
    t = text.strip().lower()
    pos, total = 0, 0.0
    for m in _UNIT_RE.finditer(t):
        if t[pos : m.start()].strip():
            return None
        total += float(m.group(1)) * _UNITS[m.group(2)]
        pos = m.end()
    if pos == 0 or t[pos:].strip():
        return None
    return total


def parse_duration(text: str) -> float:
    """Seconds, from our syntax (see the module); ValueError with what is valid."""
    t = text.strip()
    if ":" in t or re.fullmatch(r"\d+-[\d:]+", t, re.ASCII):
        try:
            return float(slurm_time(t, bare_minutes=False))
        except ValueError:
            raise ValueError(f"cannot read {t!r} as a time; expected {DURATION_HELP}") from None
    if _NUM_RE.fullmatch(t):
        value = float(t)
    else:
        unit = _unit_seconds(t)
        if unit is None:
            raise ValueError(f"cannot read {t!r} as a duration; expected {DURATION_HELP}")
        value = unit
    if not math.isfinite(value):
        raise ValueError(f"a duration must be a finite number of seconds; got {t!r}")
    return value


def parse_since(text: str, now: float) -> float:
    """A point in time as a Unix timestamp: ``now``, a duration before ``now``, or a
    local date/time (ISO 8601). ValueError naming the valid forms."""
    t = text.strip()
    if t == "now":
        return now
    try:
        return now - parse_duration(t)
    except ValueError:
        pass
    try:
        return datetime.fromisoformat(t).timestamp()
    except ValueError:
        raise ValueError(f"{text!r}: use {SINCE_HELP}") from None


def format_duration(seconds: float) -> str:
    """Whole seconds, the two largest units: ``45s``, ``3m07s``, ``2h05m``, ``3d04h``."""
    s = max(0, int(seconds))
    if s >= 86400:
        return f"{s // 86400}d{(s % 86400) // 3600:02d}h"
    if s >= 3600:
        return f"{s // 3600}h{(s % 3600) // 60:02d}m"
    if s >= 60:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s}s"
