"""A site's own distributed engine on two nodes: site-config/examples/torch-gloo.

The example server, run as a ``command`` engine by the vLLM venv's python (for
its CPU torch), in a heterogeneous job of two components: every node's
process joins a gloo group from the rendezvous environment the agent gives it,
all-reduces before the head serves, and takes part in every request. The
answers name both nodes and the sums, so the official openai client's answer
proves the group ran across the job's two nodes. It ends with the time
limit's drain, which stops both nodes. One start of two torch processes (a few
seconds), no vLLM.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import aiohttp
import openai

from llmgw_slurm.slurm.cli import CliBackend
from tests.engine.conftest import FIGURES, TOP
from tests.engine.test_vllm_e2e import daemon, gateway_listening, job_logs, tail, write_configs
from tests.engine.test_vllm_multinode import (
    active_jobs,
    drain_stops_both_nodes,
    first_answer,
    streamed_text,
)

MODEL = "tiny-vllm"  # the name the shared helpers ask for
SERVER = TOP / "site-config" / "examples" / "torch-gloo" / "server.py"
PROMPT = "Say hello."


def torch_configs(tmp: Path, prefix: str, torch_python: str, model_dir: Path) -> Path:
    """The engine test's configs, the model swapped for the example's catalog entry."""
    server = write_configs(tmp, prefix, torch_python, model_dir)
    models = json.loads((tmp / "models.yaml").read_text())
    m = models["models"][0]
    m["engine"] = {
        "kind": "command",
        # As site-config/examples/torch-gloo/models.yaml, with this machine's paths.
        "command": [
            torch_python,
            str(SERVER),
            "--host",
            "{host}",
            "--served-name",
            "{served_name}",
        ],
        "ready_timeout": "2m",
    }
    del m["weights"]
    m["resources"]["nodes"] = 2
    (tmp / "models.yaml").write_text(json.dumps(models))
    return server


async def test_torch_gloo_replica_all_reduces_across_two_nodes(
    tmp_path: Path, vllm_python: str, tiny_model: Path
) -> None:
    prefix = f"llmgwTtg{os.getpid() % 100000}."
    server = torch_configs(tmp_path, prefix, vllm_python, tiny_model)
    cfg = json.loads(server.read_text())
    gw = "http://" + cfg["listen"]["gateway"]
    state = Path(cfg["state_dir"])
    dlog = tmp_path / "daemon.log"
    backend = CliBackend(timeout=60)

    def diagnose() -> str:
        return f"daemon log:\n{tail(dlog)}\njob logs:\n{job_logs(state)}"

    try:
        async with daemon(server, dlog) as proc, aiohttp.ClientSession() as s:
            await gateway_listening(proc, s, gw, dlog)
            client = openai.AsyncOpenAI(
                base_url=gw + "/v1", api_key="no-gateway-keys", max_retries=0, timeout=300
            )
            t0 = time.monotonic()
            chat = await first_answer(client, s, gw, diagnose)
            FIGURES["torch-gloo 2-node cold request"] = f"{time.monotonic() - t0:.2f}s"
            (job,) = await active_jobs(backend, prefix)
            nodes = [n for c in job.components for n in c.nodes]
            assert len(job.components) == 2 and len(set(nodes)) == 2, job
            # Each rank added rank + 1 at the start (1 + 2), and (rank + 1) * words
            # for the request; the node names come from an all_gather, head first.
            words = len(PROMPT.split())
            expected = f"world 2 nodes {','.join(nodes)} startup_sum 3 request_sum {3 * words}"
            assert chat.choices[0].message.content == expected, diagnose()
            assert chat.usage is not None and chat.usage.prompt_tokens == words

            text, chunks = await streamed_text(client)
            assert chunks >= 2 and text == " ".join(expected.split()[:8])

            async with s.get(gw + "/api/v1/status") as r:
                body = await r.json()
            (rep,) = next(m for m in body["models"] if m["name"] == MODEL)["replicas"]
            # Served TLS with the agent's key pair, which the daemon pinned.
            assert rep["url"].startswith("https://"), rep
            await drain_stops_both_nodes(backend, prefix, rep, state)
            FIGURES["torch-gloo 2-node drain (USR1) to job gone"] = FIGURES.pop(
                "2-node: drain (USR1) to job gone"
            )
            await client.close()
    finally:
        leftover = await backend.list_jobs(prefix)
        if leftover:
            subprocess.run(["scancel", *[j.job_id for j in leftover]], check=False, timeout=30)
