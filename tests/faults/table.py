"""Print the latest figures of each fault as the Markdown table in docs/reliability.md.

python -m tests.faults.table
"""

from __future__ import annotations

from typing import Any

from tests.faults.support import latest_results

_MAIN = [
    "requests_sent",
    "requests_failed",
    "failed_after_one_retry",
    "replicas_lost",
    "duplicate_jobs",
]
_SKIP = {"fault", "at", "failures", "notes", *_MAIN}


def _cell(v: Any) -> str:
    return "-" if v is None else str(v).replace("|", "/")


def main() -> None:
    rows = latest_results()
    print(
        "| Fault | Requests sent | Failed | Failed after one retry | Replicas lost "
        "| Duplicate jobs | Failures | Other figures | Run (UTC) |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for fault in sorted(rows):
        r = rows[fault]
        other = "; ".join(f"{k} {_cell(v)}" for k, v in sorted(r.items()) if k not in _SKIP)
        fails = ", ".join(f"{k}: {v}" for k, v in sorted((r.get("failures") or {}).items()))
        print(
            f"| {fault} | "
            + " | ".join(_cell(r.get(k)) for k in _MAIN)
            + f" | {fails or '-'} | {other or '-'} | {r['at']} |"
        )
    for fault in sorted(rows):
        if rows[fault].get("notes"):
            print(f"\n- {fault}: {rows[fault]['notes']}")


if __name__ == "__main__":
    main()
