"""Can a researcher read back their own stored response (issue 33, item 8)?

vLLM's CPU build serving the tiny Llama, configured as docs/configuration.md's
and site-config's vLLM models are (no VLLM_ENABLE_RESPONSES_API_STORE), behind
the gateway: the response is made, and its GET says which setting would have
kept it, instead of vLLM's bare "not found". vLLM runs as a plain process
here (the Slurm path is test_vllm_e2e's): what is tested is vLLM's behaviour
and the gateway's answer to it.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import openai
import pytest

from llmgw_slurm.catalog import load_catalog
from llmgw_slurm.router import Endpoint, StaticDirectory, create_app
from llmgw_slurm.router.directory import ModelRouting
from tests.engine.conftest import TOP
from tests.engine.test_vllm_e2e import VLLM_ARGS, VLLM_ENV
from tests.ports import free_port
from tests.slurm.conftest import eventually
from tests.unit._router_support import serve


@pytest.fixture
def vllm(vllm_python: str, tiny_model: Path, tmp_path: Path) -> Iterator[str]:
    """vLLM's OpenAI server on the tiny Llama, with the environment the agent gives it
    and no responses store (the catalog's default); yields its base URL."""
    port = free_port()
    env = {**os.environ, **VLLM_ENV, "VLLM_API_KEY": "engine-key"}
    env["VLLM_CACHE_ROOT"] = str(TOP / ".dev-cluster" / "engines" / "vllm-cache")
    env.pop("VLLM_ENABLE_RESPONSES_API_STORE", None)
    log = (tmp_path / "vllm.log").open("wb")
    argv = [vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(tiny_model)]
    argv += ["--served-model-name", "tiny-vllm", "--host", "127.0.0.1", "--port", str(port)]
    proc = subprocess.Popen([*argv, *VLLM_ARGS], env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


async def test_a_response_vllm_did_not_keep_is_a_404_that_names_the_setting(vllm: str) -> None:
    site = load_catalog(TOP / "site-config" / "models.yaml").resolve("llama-3.1-8b")
    assert site is not None and site.engine.kind == "vllm"
    assert site.stores_responses is False  # as the docs configure a vLLM model
    directory = StaticDirectory()
    directory.add_model("tiny-vllm", routing=ModelRouting(stores_responses=site.stores_responses))

    async def healthy() -> bool:
        try:
            async with aiohttp.ClientSession() as s, s.get(vllm + "/health") as r:
                return r.status == 200
        except aiohttp.ClientError:
            return False

    await eventually(healthy, "vLLM to be healthy", timeout=600)
    directory.add_endpoint("tiny-vllm", Endpoint("r0", vllm, "engine-key"))
    async with serve(create_app(directory)) as url:
        c = openai.AsyncOpenAI(api_key="none", base_url=url + "/v1", max_retries=0, timeout=300)
        made = await c.responses.create(model="tiny-vllm", input="hello", max_output_tokens=4)
        assert made.id.startswith("resp_") and made.usage is not None
        # vLLM itself: the bare 404 a researcher got before.
        async with (
            aiohttp.ClientSession() as s,
            s.get(
                f"{vllm}/v1/responses/{made.id}", headers={"Authorization": "Bearer engine-key"}
            ) as r,
        ):
            assert r.status == 404
            assert (await r.json())["error"][
                "message"
            ] == f"Response with id '{made.id}' not found."
        with pytest.raises(openai.NotFoundError) as err:
            await c.responses.retrieve(made.id)
        assert err.value.code == "response_not_stored"
        assert "VLLM_ENABLE_RESPONSES_API_STORE=1" in err.value.response.json()["error"]["message"]
        await c.close()
