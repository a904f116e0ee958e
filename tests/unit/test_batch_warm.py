"""Batches on warm replicas (issue 37 item 2): the gateway's batch seam, a ride, and the
service's choice between riding and a job, without Slurm.

The replicas are the test engine (llmgw_slurm/testing/engine.py) served on
localhost, listed by a StaticDirectory; the service runs over test_batch.py's
recording backend and fake clock.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import replace
from pathlib import Path

import aiohttp
import pytest
from test_batch import (  # type: ignore[import-not-found]
    CHAT,
    KNOWN,
    Backend,
    Clock,
    answer,
    create,
    line,
    record,
    report,
    upload,
)
from test_batch import svc as svc  # the fixture

from llmgw_slurm.agent import batch as agent_batch
from llmgw_slurm.auth.tls import PinnedContexts, make_identity
from llmgw_slurm.base.errors import ConfigErrors
from llmgw_slurm.batch import results
from llmgw_slurm.batch import setup as batch_setup
from llmgw_slurm.batch.model import BatchStatus
from llmgw_slurm.batch.seam import (
    UNREACHABLE_S,
    BatchSeam,
    BatchUnreached,
    BatchYielded,
    SeamAnswer,
    SlotShares,
)
from llmgw_slurm.batch.service import BatchService
from llmgw_slurm.batch.warm import PACE_WINDOW_S, WarmRide
from llmgw_slurm.catalog import Catalog
from llmgw_slurm.config import load_server_config
from llmgw_slurm.reconciler.directory import ReplicaDirectory
from llmgw_slurm.reconciler.replicas import Replica, ReplicaTable
from llmgw_slurm.reconciler.spans import ReconcileTracing
from llmgw_slurm.router import GATEWAY_KEY, create_app
from llmgw_slurm.router.directory import Endpoint, ModelInfo, StaticDirectory
from llmgw_slurm.router.engine import EnginePool
from llmgw_slurm.testing.engine import EngineOptions, create_engine_app
from tests.ports import free_port
from tests.unit._router_support import serve

KEY = "engine-key"


class Ticks:
    """A clock a test moves by hand."""

    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


@asynccontextmanager
async def engines(n: int = 1, token_delay: float = 0.0) -> AsyncIterator[list[str]]:
    """``n`` test engines serving model ``tiny``; their base URLs."""
    opts = EngineOptions(api_key=KEY, served_name="tiny", token_delay=token_delay)
    async with _serving(n, opts) as urls:
        yield urls


@asynccontextmanager
async def _serving(n: int, opts: EngineOptions) -> AsyncIterator[list[str]]:
    if n == 0:
        yield []
        return
    async with serve(create_engine_app(opts)) as url, _serving(n - 1, opts) as rest:
        yield [url, *rest]


def directory(*urls: str) -> StaticDirectory:
    d = StaticDirectory([ModelInfo("tiny")])
    for i, url in enumerate(urls):
        d.add_endpoint("tiny", Endpoint(f"r{i}", url, KEY))
    return d


_OPEN: list[BatchSeam] = []


@pytest.fixture(autouse=True)
async def _close_seams() -> AsyncIterator[None]:
    """Every seam a test made has its client closed after it."""
    yield
    while _OPEN:
        await _OPEN.pop().close()


def seam_over(
    d: StaticDirectory,
    online: dict[tuple[str, str], int] | None = None,
    capacity: int = 16,
    share: float = 0.5,
    clock: Callable[[], float] | None = None,
    idle: tuple[float, float] | None = None,
) -> BatchSeam:
    """A seam over ``d``; ``idle``: the idle share and the wait before it (without:
    one share, idle or not)."""
    counts = online if online is not None else {}
    idle_share, idle_after = idle if idle is not None else (share, 0.0)
    seam = BatchSeam(
        d,
        lambda m, r: counts.get((m, r), 0),
        lambda m: capacity,
        SlotShares(busy=share, idle=idle_share, idle_after=idle_after),
        EnginePool(5.0, 30.0),
        clock=clock if clock is not None else time.monotonic,
    )
    _OPEN.append(seam)
    return seam


def chat_body(max_tokens: int = 3) -> bytes:
    return json.dumps(
        {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": max_tokens}
    ).encode()


async def engine_in_flight(s: aiohttp.ClientSession, url: str) -> int:
    """Requests the test engine is answering now (a client gone cancels its handler)."""
    async with s.get(url + "/debug/stats", headers={"Authorization": f"Bearer {KEY}"}) as r:
        n: int = (await r.json())["in_flight"]
        return n


async def until_engine_has(url: str, n: int) -> None:
    async with aiohttp.ClientSession() as s:
        async with asyncio.timeout(30):  # stops a hung test; not a threshold
            while await engine_in_flight(s, url) != n:
                await asyncio.sleep(0.01)


# ---------------------------------------------------------------- the seam


def test_batch_slots_are_a_share_of_each_replica_and_yield_to_online_requests() -> None:
    d = directory("http://127.0.0.1:1", "http://127.0.0.1:2")
    online: dict[tuple[str, str], int] = {}
    seam = seam_over(d, online, capacity=16, share=0.5)
    r0, r1 = d.endpoints("tiny")
    assert (seam.slots("tiny", r0), seam.free("tiny")) == (8, 16)
    # As online requests rise past the other half, batch slots shrink, down to none.
    for busy, slots in ((8, 8), (10, 6), (15, 1), (16, 0), (40, 0)):
        online[("tiny", "r0")] = busy
        assert seam.slots("tiny", r0) == slots, busy
    # A slot taken goes to the replica with the most room, and counts against it.
    online[("tiny", "r0")] = 12
    t = seam.admit("tiny")
    assert t is not None and t.endpoint.replica_id == "r1"
    assert (seam.slots("tiny", r1), seam.in_flight("tiny")) == (7, 1)
    # A draining replica takes none; a model with no ready replica has no room.
    d.set_draining("tiny", "r1")
    assert seam.free("tiny") == 4 and seam.ready("tiny")
    online[("tiny", "r0")] = 16
    assert seam.admit("tiny") is None
    assert seam.free("other") == 0 and not seam.ready("other")


def test_an_idle_replica_lends_the_batch_its_idle_share_until_online_requests_come() -> None:
    d = directory("http://127.0.0.1:1")
    online: dict[tuple[str, str], int] = {}
    seam = seam_over(d, online, capacity=16, share=0.125, idle=(1.0, 60.0))
    (r0,) = d.endpoints("tiny")
    # Never used online since the gateway started: idle, the whole of it.
    assert seam.slots("tiny", r0) == 16
    # Online requests in flight: the busy share, less what they take past it.
    online[("tiny", "r0")] = 3
    assert seam.slots("tiny", r0) == 2
    online[("tiny", "r0")] = 15
    assert seam.slots("tiny", r0) == 1
    # The last one just ended: still busy (its client's next one is on its way) ...
    del online[("tiny", "r0")]
    d.last_used["tiny"] = time.time()
    assert seam.slots("tiny", r0) == 2
    # ... until none has come for idle_after (the directory's last use, wall time).
    d.last_used["tiny"] = time.time() - 60.0
    assert seam.slots("tiny", r0) == 16
    # Batch requests taken then count against the busy share once online ones return:
    # no new one is admitted until those in flight are below it.
    taken = [seam.admit("tiny") for _ in range(16)]
    assert all(t is not None for t in taken) and seam.admit("tiny") is None
    online[("tiny", "r0")] = 1
    assert seam.slots("tiny", r0) == 0 and seam.admit("tiny") is None


def test_a_replicas_idle_time_is_its_last_use_by_any_gateway(tmp_path: Path) -> None:
    # The daemon's directory: this gateway's requests, and another daemon's on the
    # shared database (their requests are not in this gateway's count).
    now = [100.0]
    table = ReplicaTable(Catalog(models=()), lambda: now[0], ReconcileTracing(None, False))
    d = ReplicaDirectory(table, b"p" * 64, PinnedContexts(make_identity(tmp_path, "gw", "gw", 1)))
    table.replicas["r0"] = Replica("r0", "tiny", "1", submitted_at=0.0)
    assert d.idle_for("tiny", "r0") is None and d.idle_for("tiny", "gone") is None
    d.request_started("tiny", "r0")
    now[0] = 101.0
    d.request_finished("tiny", "r0")
    now[0] = 104.0
    assert d.idle_for("tiny", "r0") == 3.0
    table.replicas["r0"].remote_last_used = 103.5
    assert d.idle_for("tiny", "r0") == 0.5
    # The gateway's own directory (no reconciler): its model's last use.
    s = directory("http://127.0.0.1:1")
    assert s.idle_for("tiny", "r0") is None
    s.request_started("tiny", "r0")
    s.request_finished("tiny", "r0")
    idle = s.idle_for("tiny", "r0")
    assert idle is not None and 0.0 <= idle < 60.0


async def test_forward_sends_the_replicas_own_key_and_frees_its_slot() -> None:
    async with engines(1) as (url,):
        d = directory(url)
        seam = seam_over(d, capacity=2, share=1.0)
        t = seam.admit("tiny")
        assert t is not None and seam.free("tiny") == 1
        got = await seam.forward(t, CHAT, chat_body())
        assert got.status == 200 and got.replica_id == "r0"
        assert json.loads(got.body)["usage"]["completion_tokens"] == 3
        assert seam.free("tiny") == 2 and seam.in_flight("tiny") == 0
        # A request the engine refuses is its answer, not an error of the seam's.
        bad = seam.admit("tiny")
        assert bad is not None
        got = await seam.forward(bad, CHAT, b"{not json")
        assert got.status == 400
        await seam.close()


async def test_an_unreachable_replica_is_passed_over_for_a_while() -> None:
    clock = Ticks()
    d = directory(f"http://127.0.0.1:{free_port()}")  # nothing listens there
    seam = seam_over(d, clock=clock)
    t = seam.admit("tiny")
    assert t is not None
    with pytest.raises(BatchUnreached):
        await seam.forward(t, CHAT, chat_body())
    assert seam.in_flight("tiny") == 0
    assert not seam.ready("tiny") and seam.admit("tiny") is None
    clock.t += UNREACHABLE_S
    assert seam.ready("tiny")


async def test_an_online_request_calls_back_batch_requests_past_the_busy_share() -> None:
    # The replica was idle: the batch has all 8 of its slots. An online request
    # begins: the newest 6 are called back (the busy share is 2), their connections
    # closed, so the engine stops making their tokens; the 2 oldest finish.
    async with engines(1, token_delay=0.02) as (url,):
        d = directory(url)
        online: dict[tuple[str, str], int] = {}
        seam = seam_over(d, online, capacity=8, share=0.25, idle=(1.0, 0.0))
        tickets = [seam.admit("tiny") for _ in range(8)]
        sends = []
        for t in tickets:
            assert t is not None
            sends.append(asyncio.create_task(seam.forward(t, CHAT, chat_body(100))))
            await asyncio.sleep(0.01)  # in order, oldest first
        await until_engine_has(url, 8)
        online[("tiny", "r0")] = 1
        seam.online_started("tiny", "r0")
        got = await asyncio.gather(*sends, return_exceptions=True)
        assert [type(g) for g in got] == [SeamAnswer] * 2 + [BatchYielded] * 6
        await until_engine_has(url, 0)
        assert seam.in_flight("tiny") == 0 and seam.ready("tiny")  # no fault of the replica's
        # Within the busy share, an online request calls nothing back.
        t = seam.admit("tiny")
        assert t is not None and seam.slots("tiny", d.endpoints("tiny")[0]) == 1
        send = asyncio.create_task(seam.forward(t, CHAT, chat_body(5)))
        await until_engine_has(url, 1)
        online[("tiny", "r0")] = 2
        seam.online_started("tiny", "r0")
        assert (await send).status == 200


async def test_a_cancel_that_is_not_a_call_back_stays_a_cancel() -> None:
    async with engines(1, token_delay=0.02) as (url,):
        online: dict[tuple[str, str], int] = {}
        seam = seam_over(directory(url), online, capacity=4, share=0.0, idle=(1.0, 0.0))
        t = seam.admit("tiny")
        assert t is not None
        send = asyncio.create_task(seam.forward(t, CHAT, chat_body(100)))
        await until_engine_has(url, 1)
        send.cancel()  # the daemon stopping, say
        with pytest.raises(asyncio.CancelledError):
            await send
        # Called back and cancelled at once: the cancel wins.
        t = seam.admit("tiny")
        assert t is not None
        send = asyncio.create_task(seam.forward(t, CHAT, chat_body(100)))
        await until_engine_has(url, 1)
        online[("tiny", "r0")] = 1
        seam.online_started("tiny", "r0")
        send.cancel()
        with pytest.raises(asyncio.CancelledError):
            await send
        assert seam.in_flight("tiny") == 0


async def test_the_gateways_online_requests_call_back_a_rides_requests(tmp_path: Path) -> None:
    # The seam as the daemon makes it, over a gateway: a ride that took the whole
    # of an idle replica (busy share 0) gives it up to one online request, and
    # sends what was called back again once the replica is idle again: each once.
    p = tmp_path / "server.yaml"
    p.write_text("state_dir: /tmp/x\nbatch: {warm_share: 0, warm_idle_after: 0.2s}\n")
    server = load_server_config(p)
    work = tmp_path / "work"
    work.mkdir()
    async with engines(1, token_delay=0.05) as (url,):
        d = directory(url)
        app = create_app(d)
        gw = app[GATEWAY_KEY]
        seam = batch_setup.seam(app, server, d, lambda: Catalog(models=()))
        _OPEN.append(seam)
        ride = WarmRide(record(model="tiny", total=12), batch_input(tmp_path, 12), work, seam)
        riding = asyncio.create_task(ride.run())
        await until_engine_has(url, 1)  # capacity 1: the catalog does not list the model
        async with serve(app) as gw_url, aiohttp.ClientSession() as s:
            # One online request nearly always finds a batch request in flight; one
            # that came between two of them finds none to call back, so a few go.
            for _ in range(10):
                await until_engine_has(url, 1)
                async with s.post(gw_url + CHAT, data=chat_body(2)) as r:
                    assert r.status == 200
                if ride.yielded:
                    break
            await asyncio.wait_for(riding, 60)
        assert gw.in_flight == {}
    assert ride.yielded >= 1 and ride.completed == 12
    assert sorted(ids_in(work / results.OUTPUT)) == sorted(f"q{i}" for i in range(12))


# ---------------------------------------------------------------- a ride


def batch_input(tmp_path: Path, n: int) -> Path:
    p = tmp_path / "input.jsonl"
    p.write_bytes(b"".join(line(f"q{i}", "tiny-alias") for i in range(n)))
    return p


def ids_in(path: Path) -> list[str]:
    return [json.loads(x)["custom_id"] for x in path.read_text().splitlines()]


async def test_a_ride_answers_what_is_left_once_each_in_the_jobs_format(tmp_path: Path) -> None:
    work = tmp_path / "work"
    work.mkdir()
    answer(work, results.OUTPUT, "q0", "q1")
    answer(work, results.ERRORS, "q2")
    b = record(model="tiny", total=20, completed=2, failed=1)
    async with engines(2) as urls:
        seam = seam_over(directory(*urls), capacity=4, share=0.5)
        ride = WarmRide(b, batch_input(tmp_path, 20), work, seam)
        await ride.run()
    out = ids_in(work / results.OUTPUT)
    assert sorted(out) == sorted(f"q{i}" for i in range(20) if i != 2)
    assert ids_in(work / results.ERRORS) == ["q2"]
    assert (ride.completed, ride.failed, ride.left) == (17, 0, 0)
    assert (ride.completed_before, ride.failed_before) == (2, 1)
    assert (ride.prompt_tokens > 0, ride.completion_tokens) == (True, 17 * 8)
    last = json.loads((work / results.OUTPUT).read_text().splitlines()[-1])
    assert last["id"].startswith("batch_req_") and last["error"] is None
    assert last["response"]["status_code"] == 200
    assert last["response"]["body"]["model"] == "tiny"  # the alias became the model's name


async def test_a_stopped_ride_finishes_what_it_sent_and_the_next_one_does_the_rest(
    tmp_path: Path,
) -> None:
    work = tmp_path / "work"
    work.mkdir()
    b = record(model="tiny", total=30)
    inp = batch_input(tmp_path, 30)
    async with engines(1, token_delay=0.01) as urls:
        seam = seam_over(directory(*urls), capacity=4, share=0.5)
        ride = WarmRide(b, inp, work, seam)
        task = asyncio.create_task(ride.run())
        while ride.completed < 5:
            await asyncio.sleep(0.01)
        ride.stop()
        await task
        first = ids_in(work / results.OUTPUT)
        assert ride.left == 30 - len(first) > 0
        assert seam.in_flight("tiny") == 0
        # A job would skip exactly these (as the agent reads the files).
        job = agent_batch.BatchJob(inp, work / results.OUTPUT, work / results.ERRORS, CHAT, 4)
        todo = [cid for cid, _ in agent_batch.todo(job, agent_batch.skipped(job))]
        assert sorted(todo + first) == sorted(f"q{i}" for i in range(30))
        again = WarmRide(b, inp, work, seam)
        await again.run()
    every = ids_in(work / results.OUTPUT)
    assert sorted(every) == sorted(f"q{i}" for i in range(30))  # each once
    assert again.completed_before == len(first)


async def test_a_request_no_replica_answers_is_tried_again_then_left(tmp_path: Path) -> None:
    work = tmp_path / "work"
    work.mkdir()
    clock = Ticks()
    seam = seam_over(directory(f"http://127.0.0.1:{free_port()}"), clock=clock)
    ride = WarmRide(record(model="tiny", total=3), batch_input(tmp_path, 3), work, seam)

    async def time_passes() -> None:
        while True:
            clock.t += UNREACHABLE_S  # the dead replica is tried again after a while
            await asyncio.sleep(0.01)

    ticking = asyncio.create_task(time_passes())
    await asyncio.wait_for(ride.run(), 30)
    ticking.cancel()
    assert (ride.completed, ride.unreached, ride.left) == (0, 9, 0)
    assert not (work / results.OUTPUT).read_bytes() and not (work / results.ERRORS).read_bytes()
    # Nothing written: a job sends them all.
    assert WarmRide(record(model="tiny"), batch_input(tmp_path, 3), work, seam)._done() == set()


# ---------------------------------------------------------------- the service


Svc = tuple[BatchService, Backend, Clock]


async def poll_until(s: BatchService, done: Callable[[], bool]) -> None:
    for _ in range(2000):
        await s.poll()
        if done():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the batch did not get there")


def status_of(s: BatchService, bid: str) -> BatchStatus:
    b = s.store.get(bid)
    assert b is not None
    return b.status


async def test_a_batch_rides_a_warm_replica_with_room_and_no_job_is_submitted(svc: Svc) -> None:
    s, backend, _ = svc
    async with engines(1) as urls:
        s.seam = seam_over(directory(*urls))
        fid = upload(s, "alice", b"".join(line(f"q{i}") for i in range(12)))
        b = await s.create("alice", fid, CHAT, "1h", {}, KNOWN.get, ("0a0b0c0d", "proj"))
        assert b.status is BatchStatus.IN_PROGRESS and b.note == "riding warm replicas of tiny"
        await poll_until(s, lambda: status_of(s, b.id) is BatchStatus.COMPLETED)
    done = s.store.get(b.id)
    assert done is not None and backend.submitted == [] and done.job_id == ""
    assert (done.completed, done.failed, done.warm_completed) == (12, 0, 12)
    assert done.completion_tokens == done.warm_completion_tokens == 12 * 8
    assert done.output_file_id is not None
    assert sorted(ids_in(s.store.data_path(done.output_file_id))) == sorted(
        f"q{i}" for i in range(12)
    )


async def test_a_batch_whose_ride_ends_finishes_at_once_not_a_poll_later(svc: Svc) -> None:
    s, _, _ = svc
    # A poll a minute: the batch completes long before the next one would come.
    s.server = replace(s.server, batch=replace(s.server.batch, poll_interval=60.0))
    stop = asyncio.Event()
    loop = asyncio.create_task(s.run(stop))
    try:
        async with engines(1) as urls:
            s.seam = seam_over(directory(*urls))
            await asyncio.sleep(0)  # the loop's first poll: nothing to do, then its pause
            b = await create(s, upload(s, "alice", b"".join(line(f"q{i}") for i in range(5))))
            await asyncio.wait_for(_completed(s, b.id), 30)
    finally:
        stop.set()
        await loop


async def _completed(s: BatchService, bid: str) -> None:
    while status_of(s, bid) is not BatchStatus.COMPLETED:
        await asyncio.sleep(0.05)


async def test_without_a_replica_with_room_or_with_warm_off_a_batch_is_a_job(svc: Svc) -> None:
    s, backend, _ = svc
    online = {("tiny", "r0"): 16}  # the one replica full of online requests
    s.seam = seam_over(directory("http://127.0.0.1:1"), online)
    b = await create(s, upload(s, "alice", line("a")))
    assert b.job_id == "101" and len(backend.submitted) == 1
    online.clear()
    s.server = replace(s.server, batch=replace(s.server.batch, warm=False))
    b = await create(s, upload(s, "alice", line("a")))
    assert b.job_id == "102" and len(backend.submitted) == 2


async def test_a_ride_too_slow_for_the_deadline_hands_the_rest_to_a_job(svc: Svc) -> None:
    s, backend, _ = svc
    ticks = Ticks()
    async with engines(1, token_delay=0.05) as urls:
        s.seam = seam_over(directory(*urls), capacity=2, share=0.5)
        fid = upload(s, "alice", b"".join(line(f"q{i}") for i in range(40)))
        b = await create(s, fid, window="90m")
        riding = s._rides[b.id]
        riding.ride.clock = ticks  # the pace is judged on a clock the test moves
        riding.ride.started = ticks.t
        while riding.ride.completed < 2:
            await asyncio.sleep(0.01)
        await s.poll()
        assert backend.submitted == []  # a minute has not passed: too early to judge
        # A minute on, one answer in it: at that pace, the 30-odd left take longer
        # than the 90 minutes' window less the hour's margin.
        ticks.t += PACE_WINDOW_S
        riding.ride._answered_at.clear()
        riding.ride._answered_at.append(ticks.t)
        await s.poll()
        note = s.store.get(b.id).note  # type: ignore[union-attr]
        assert "would end" in note and note.endswith("handing the rest to a job"), note
        await poll_until(s, lambda: bool(backend.submitted))
    assert len(backend.submitted) == 1
    now = s.store.get(b.id)
    assert now is not None and now.job_id == "101" and now.status is BatchStatus.IN_PROGRESS
    # The job does exactly what the ride left (the agent's own skip), nothing twice.
    work = s.store.work_dir(b.id)
    ridden = ids_in(work / results.OUTPUT)
    job = agent_batch.BatchJob(
        s.store.data_path(fid), work / results.OUTPUT, work / results.ERRORS, CHAT, 4
    )
    left = [cid for cid, _ in agent_batch.todo(job, agent_batch.skipped(job))]
    assert len(left) == 40 - len(ridden) > 0 and not set(left) & set(ridden)
    assert now.warm_completed == len(ridden)
    # The job's reports count its own run's tokens: the ride's are added.
    report(s, b.id, {"completed": 40, "prompt_tokens": 5, "completion_tokens": 7})
    now = s.store.get(b.id)
    assert now is not None and now.completion_tokens == 7 + now.warm_completion_tokens
    assert now.completed == 40  # one job counts the batch's files, the ride's answers in them


async def test_a_cancel_stops_the_ride_and_keeps_its_answers(svc: Svc) -> None:
    s, backend, _ = svc
    async with engines(1, token_delay=0.02) as urls:
        s.seam = seam_over(directory(*urls), capacity=2, share=0.5)
        b = await create(s, upload(s, "alice", b"".join(line(f"q{i}") for i in range(40))))
        while s._rides[b.id].ride.completed < 3:
            await asyncio.sleep(0.01)
        await s.cancel("alice", b.id)
        await poll_until(s, lambda: status_of(s, b.id) is BatchStatus.CANCELLED)
    done = s.store.get(b.id)
    assert done is not None and backend.submitted == [] and 3 <= done.completed < 40
    assert done.output_file_id is not None
    assert len(ids_in(s.store.data_path(done.output_file_id))) == done.completed


def test_a_sharded_batchs_counts_add_the_rides_answers_and_one_jobs_do_not(svc: Svc) -> None:
    s, _, _ = svc
    b = record(status=BatchStatus.IN_PROGRESS, model="tiny", total=10, shards=2)
    b = replace(b, warm_completed=4, warm_failed=1, warm_prompt_tokens=40, warm_completion_tokens=8)
    s.store.save(b)
    report(s, b.id, {"completed": 2, "prompt_tokens": 5, "shard": 0})
    report(s, b.id, {"completed": 1, "failed": 1, "prompt_tokens": 3, "shard": 1})
    now = s.store.get(b.id)
    assert now is not None and (now.completed, now.failed, now.prompt_tokens) == (7, 2, 48)
    one = replace(b, id="batch_" + "1" * 24, shards=1)
    s.store.save(one)
    report(s, one.id, {"completed": 9, "failed": 0, "prompt_tokens": 2, "completion_tokens": 1})
    now = s.store.get(one.id)
    assert now is not None and (now.completed, now.prompt_tokens, now.completion_tokens) == (
        9,
        42,
        9,
    )


def test_a_shard_skips_what_a_ride_answered_and_the_merge_keeps_it(tmp_path: Path) -> None:
    work = tmp_path / "work"
    work.mkdir()
    inp = tmp_path / "input.jsonl"
    inp.write_bytes(b"".join(line(f"q{i}") for i in range(4)))
    answer(work, results.OUTPUT, "q0", "q3")  # the ride's
    env = {
        "LLMGW_BATCH_SHARDS": "2",
        "LLMGW_BATCH_SHARD_SIZE": "2",
        "SLURM_ARRAY_TASK_ID": "0",
    }
    whole = agent_batch.BatchJob(inp, work / results.OUTPUT, work / results.ERRORS, CHAT, 4)
    shard = agent_batch._shard(whole, env)
    assert [cid for cid, _ in agent_batch.todo(shard, agent_batch.skipped(shard))] == ["q1"]
    # Counted: its own files only (the daemon adds the ride's).
    assert agent_batch.done_before(shard) == (set(), set())
    answer(shard.output.parent, shard.output.name, "q1")
    results.merge_shards(work, 2)
    assert sorted(ids_in(work / results.OUTPUT)) == ["q0", "q1", "q3"]
    results.merge_shards(work, 2)  # again: the same, each once
    assert sorted(ids_in(work / results.OUTPUT)) == ["q0", "q1", "q3"]


def test_warm_settings_are_on_by_default_and_checked(tmp_path: Path) -> None:
    p = tmp_path / "server.yaml"
    p.write_text("state_dir: /tmp/x\n")
    b = load_server_config(p).batch
    assert (b.warm, b.warm_share, b.warm_margin) == (True, 0.0, 3600.0)
    assert (b.warm_idle_share, b.warm_idle_after) == (1.0, 2.0)
    p.write_text(
        "batch: {warm: false, warm_share: 0.25, warm_margin: 10m, warm_idle_share: 0.5,"
        " warm_idle_after: 1m}\n"
    )
    b = load_server_config(p).batch
    assert (b.warm, b.warm_share, b.warm_margin) == (False, 0.25, 600.0)
    assert (b.warm_idle_share, b.warm_idle_after) == (0.5, 60.0)
    p.write_text("batch: {warm_share: 0}\n")
    assert load_server_config(p).batch.warm_share == 0  # online requests have it all
    p.write_text("batch: {warm_share: -0.1, warm_idle_share: 1.5}\n")
    with pytest.raises(ConfigErrors) as info:
        load_server_config(p)
    assert [str(e).replace(str(p), "F") for e in info.value.errors] == [
        "F:1: batch.warm_share: must be at least 0; got -0.1",
        "F:1: batch.warm_idle_share: must be at most 1; got 1.5",
    ]
