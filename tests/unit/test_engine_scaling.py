"""Scaling on the engines' own queues (scaling.scale_on: engine_waiting)."""

from __future__ import annotations

import asyncio
from pathlib import Path

from _router_support import serve_engine  # type: ignore[import-not-found]
from aiohttp import web
from test_plan import R, entry, models_of, run, rv  # type: ignore[import-not-found]
from test_reconciler_core import KEY, job, make  # type: ignore[import-not-found]

from llmgw_slurm.auth.secrets import replica_secret
from llmgw_slurm.reconciler.plan import ActionKind
from llmgw_slurm.reconciler.probes import waiting_from_metrics
from llmgw_slurm.slurm.types import JobState

SCALING = "{max: 4, scale_on: engine_waiting, target_waiting: 2}"


def test_the_engines_queue_calls_for_replicas_not_the_gateways_count(tmp_path: Path) -> None:
    ms = models_of(tmp_path, entry("m", SCALING))
    reps = [rv("aaaaaaaa", "m", R, in_flight=3, engine_waiting=5)]
    subs = run(ms, reps).of(ActionKind.SUBMIT)
    # The replica in use, and ceil(5 / 2) more: 4, three to submit.
    assert len(subs) == 3
    assert subs[0].reason == "scale up to 4: 5 waiting in the engines, target 2 per replica"


def test_many_in_flight_but_nothing_queued_by_the_engine_is_no_scale_up(tmp_path: Path) -> None:
    ms = models_of(tmp_path, entry("m", SCALING))
    reps = [rv("aaaaaaaa", "m", R, in_flight=500, engine_waiting=0)]
    assert run(ms, reps).actions == []
    # The same load on in_flight scaling (the default) calls for more.
    ms = models_of(tmp_path, entry("m", "{max: 4}"))
    assert run(ms, reps).of(ActionKind.SUBMIT)


def test_waiting_is_read_from_vllm_and_sglang_metrics() -> None:
    text = (
        "# HELP vllm:num_requests_waiting Number of requests waiting.\n"
        "# TYPE vllm:num_requests_waiting gauge\n"
        'vllm:num_requests_waiting{engine="0",model_name="m"} 3.0\n'
        'vllm:num_requests_waiting{engine="1",model_name="m"} 2.0\n'
        'vllm:num_requests_running{engine="0",model_name="m"} 9.0\n'
    )
    assert waiting_from_metrics(text) == 5
    assert waiting_from_metrics('sglang:num_queue_reqs{model_name="m"} 7\n') == 7
    assert waiting_from_metrics("other_metric 1\n") is None
    assert waiting_from_metrics("") is None


async def test_a_pass_reads_the_engines_queue_and_the_next_scales_on_it(tmp_path: Path) -> None:
    rec, fake = make(tmp_path, {"max": 3, "scale_on": "engine_waiting", "target_waiting": 2})
    rid = "0a1b2c3d"
    fake.jobs = [job("7", "m", rid, JobState.RUNNING)]
    await rec.pass_once()
    waiting = {"n": 5}

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "m"}]})

    async def metrics(request: web.Request) -> web.Response:
        return web.Response(text=f'vllm:num_requests_waiting{{model_name="m"}} {waiting["n"]}\n')

    app = web.Application()
    app.router.add_get("/v1/models", models)
    app.router.add_get("/metrics", metrics)
    async with serve_engine(app, rec.engine_tls.identity) as (url, cert):
        rec.report(rid, replica_secret(KEY, rid), {"event": "ready", "url": url, "cert": cert})
        await asyncio.wait_for(asyncio.gather(*rec.probe.tasks), 10)
        assert rec.endpoints("m")
        await rec.pass_once()  # reads the queue (the plan uses the last reading)
        await asyncio.wait_for(asyncio.gather(*rec.probe.tasks), 10)
        assert rec.replicas[rid].engine_waiting == 5
        actions = await rec.pass_once()
        submitted = [a for a in actions if a.kind is ActionKind.SUBMIT]
        # None in use through the gateway, so 0 + ceil(5 / 2) = 3 replicas: 2 more.
        assert len(submitted) == 2
        assert "5 waiting in the engines" in submitted[0].reason
    await rec.close()
