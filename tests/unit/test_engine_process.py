"""The engine's process: its end is seen even while a child it spawned lives on."""

from __future__ import annotations

import asyncio
import io
import os
import sys
from pathlib import Path

from llmgw_slurm.agent.engine import EngineProcess

# The engine spawns a worker that inherits its stdout and stderr (as vLLM's
# headless process spawns its tensor-parallel worker), writes the worker's pid,
# and exits with 3 while the worker sleeps on.
ENGINE = """
import subprocess, sys
worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
open(sys.argv[1], "w").write(str(worker.pid))
print("engine: worker started", flush=True)
sys.exit(3)
"""


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is dead; its parent (the engine) is gone, so init reaps it soon.
    state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    return state != "Z"


async def test_engine_exit_is_seen_while_its_worker_holds_the_pipes(tmp_path: Path) -> None:
    pid_file = tmp_path / "worker.pid"
    out = io.BytesIO()
    engine = EngineProcess(
        [sys.executable, "-c", ENGINE, str(pid_file)], dict(os.environ), stdout=out, stderr=out
    )
    await engine.start()
    # Before the fix this waited as long as the worker lived (two minutes).
    assert await asyncio.wait_for(engine.wait(), 30) == 3
    worker = int(pid_file.read_text())
    # The engine is over: what it spawned is killed with it.
    for _ in range(100):
        if not alive(worker):
            break
        await asyncio.sleep(0.05)
    assert not alive(worker)
    assert "engine: worker started" in engine.tail()
