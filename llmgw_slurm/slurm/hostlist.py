"""Slurm host lists (``gpu[01-03,7],login1``) expanded without a Slurm call.

``scontrol show hostnames`` does the same, but the listing path must not run a
command per job; this covers the forms squeue and sinfo print.
"""

from __future__ import annotations

import re

from llmgw_slurm.base.errors import SlurmParseError

_RANGE = re.compile(r"^(\d+)(?:-(\d+))?$")


def _split_top(text: str) -> list[str]:
    """Split on commas that are not inside brackets."""
    out: list[str] = []
    depth = 0
    cur: list[str] = []
    for ch in text:
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise SlurmParseError(f"unbalanced ']' in host list {text!r}")
        if ch == "," and depth == 0:
            out.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    if depth != 0:
        raise SlurmParseError(f"unbalanced '[' in host list {text!r}")
    out.append("".join(cur))
    return [p for p in out if p]


def _expand_one(item: str) -> list[str]:
    start = item.find("[")
    if start < 0:
        return [item]
    end = item.index("]", start)
    prefix, body, rest = item[:start], item[start + 1 : end], item[end + 1 :]
    tails = _expand_one(rest) if rest else [""]
    names: list[str] = []
    for part in body.split(","):
        m = _RANGE.match(part)
        if not m:
            raise SlurmParseError(f"bad range {part!r} in host list {item!r}")
        lo, hi = m.group(1), m.group(2) or m.group(1)
        width = len(lo)
        if int(hi) < int(lo) or int(hi) - int(lo) > 100_000:
            raise SlurmParseError(f"bad range {part!r} in host list {item!r}")
        for n in range(int(lo), int(hi) + 1):
            names.extend(f"{prefix}{n:0{width}d}{t}" for t in tails)
    return names


def expand(hostlist: str) -> tuple[str, ...]:
    """``"gpu[1-2],cpu3"`` -> ``("gpu1", "gpu2", "cpu3")``; empty, ``(null)``, ``N/A`` -> ``()``."""
    text = hostlist.strip()
    if text in ("", "(null)", "N/A", "None"):
        return ()
    out: list[str] = []
    for item in _split_top(text):
        out.extend(_expand_one(item))
    return tuple(out)
