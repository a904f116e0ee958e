"""Evictions on the dev cluster's site (scripts/dev-cluster, harness.SITE): only one that
makes room, the longest idle of those, the longest waiting model first.

One daemon for the module, on a cluster it fills itself so that every test is
deterministic, in a Slurm reservation of its own (harness.reservation: jobs that
already run keep their GPUs, no other job starts on the nodes while it lasts).
The nodes are taken by role, whichever of each role has all its GPUs free (other
jobs, such as scripts/demo's replicas, may hold some): somebody else's jobs hold
every free GPU of one llm-only a100 node and one nvlink a100 node throughout; the
fixture starts ``a-llm`` (4 a100, partition llm) on the other llm-only node and
then ``b-big`` (4 a100, partition llm-big) on the other nvlink node, each used
once, so that ``a-llm`` is the longer idle. The h100 node is left to the tests.
The tests run in file order: each leaves the replicas it started for the next
(the last one's fair order needs two idle replicas that make room, whichever
they are).
"""

from __future__ import annotations

import asyncio
import secrets
import subprocess
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import openai
import pytest
import pytest_asyncio

from llmgw_slurm.slurm.cli import CliBackend
from llmgw_slurm.slurm.types import JobState, NodeInfo
from tests.slurm.conftest import eventually
from tests.slurm.harness import (
    SITE,
    Harness,
    hold_free_gpus,
    reservation,
    running,
    tiny_model,
)

pytestmark = pytest.mark.asyncio(loop_scope="module")

WHOLE_A100 = {"gpus": 4, "gpu_type": "a100"}
# Each token takes a quarter second: a request of many tokens keeps a replica busy
# (serving, so not a candidate) for as long as a test needs; short ones cost 0.5 s.
SLOW = [*tiny_model("x")["engine"]["command"], "--token-delay", "0.25"]


def model(name: str, partition: str = "llm", **resources: Any) -> dict[str, Any]:
    return tiny_model(
        name,
        engine={"kind": "command", "command": SLOW, "ready_timeout": "1m"},
        resources={**WHOLE_A100, "partition": partition, **resources},
    )


MODELS = [
    model("a-llm"),
    model("b-big", partition="llm-big"),
    model("h-h100", gpus=2, gpu_type="h100"),
    model("w-big", partition="llm-big"),
    # "q-late" is listed before "p-early": catalog order would give it the eviction.
    model("q-late"),
    model("p-early"),
]


@dataclass(frozen=True)
class Roles:
    """The site's nodes by what the tests use them for (harness.SITE's kinds)."""

    llm: str  # an a100 node outside llm-big, where a-llm runs
    llm_held: str  # the other one, held by somebody else throughout
    big: str  # an nvlink a100 node (llm-big), where b-big and then w-big run
    big_held: str  # the other one, held throughout
    h100: str  # the h100 node

    @staticmethod
    def pick(nodes: list[NodeInfo]) -> Roles:
        """A node of each role with all its GPUs free for the test; the held ones may
        carry other jobs (their free GPUs are held for the test)."""
        free = {n.name for n in nodes if n.usable and n.gpus_free() == n.gpus_total()}

        def kind(name: str) -> str:
            site = SITE[name]
            return site.gpu_type + ("-big" if "llm-big" in site.partitions else "")

        by_kind = {k: sorted(n for n in SITE if kind(n) == k) for k in ("a100", "a100-big")}
        picked = {}
        for k, names in by_kind.items():
            # The one with all GPUs free is the test's; the other is held.
            use = [n for n in names if n in free]
            assert use, (
                f"no {k} node has all its GPUs free ({names}); squeue shows what holds them: "
                + str([(n.name, n.gpus_free()) for n in nodes])
            )
            picked[k] = (use[0], next(n for n in names if n != use[0]))
        (h100,) = [n for n in SITE if SITE[n].gpu_type == "h100"]
        assert h100 in free, f"{h100} (the h100 node) is not free: {nodes}"
        return Roles(*picked["a100"], *picked["a100-big"], h100)


@dataclass
class Site:
    h: Harness
    prefix: str
    resv: str
    roles: Roles


async def job_running(job: str) -> bool:
    out = await asyncio.to_thread(
        subprocess.run, ["squeue", "-h", "-o", "%T", "-j", job], capture_output=True, text=True
    )
    return out.stdout.strip() == "RUNNING"


async def hold_node(prefix: str, node: str, held: list[str], resv: str) -> list[str]:
    """Somebody else's jobs on every free GPU of ``node``, running (their ids are added to
    ``held``, for the clean-up); returns their ids."""
    (info,) = [n for n in await CliBackend().list_nodes() if n.name == node]
    jobs = await hold_free_gpus(prefix, [info], SITE[node].gpu_type, reservation=resv)
    held.extend(jobs)
    return jobs


async def chat(h: Harness, name: str, tokens: int = 2) -> str:
    async with openai.AsyncOpenAI(
        base_url=h.url + "/v1", api_key="unused", max_retries=0, timeout=120
    ) as c:
        r = await c.chat.completions.create(
            model=name, messages=[{"role": "user", "content": f"hello {name}"}], max_tokens=tokens
        )
    return r.choices[0].message.content or ""


def ready(h: Harness, name: str) -> list[Any]:
    return [r for r in h.rec.replicas.values() if r.model == name and r.state().value == "ready"]


async def on_node(h: Harness, name: str) -> str:
    """The node of ``name``'s ready replica (the listing may name it after the agent's report)."""

    async def probe() -> str:
        reps = ready(h, name)
        return reps[0].nodes[0] if reps and reps[0].nodes else ""

    return await eventually(probe, f"{name} ready with its node listed")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def site(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Site]:
    prefix = f"llmgwtest-{secrets.token_hex(3)}."
    held: list[str] = []
    with reservation(prefix) as resv:
        try:
            roles = Roles.pick(await CliBackend().list_nodes())
            await hold_node(prefix, roles.llm_held, held, resv)
            await hold_node(prefix, roles.big_held, held, resv)
            # The big node too, until a-llm has taken its node (Slurm fills gpunode3-4
            # first by their weight anyway; this makes it certain).
            first = await hold_node(prefix, roles.big, held, resv)
            tmp = tmp_path_factory.mktemp("site")
            async with running(tmp, prefix, MODELS, reservation=resv) as h:
                await chat(h, "a-llm")
                assert await on_node(h, "a-llm") == roles.llm
                subprocess.run(["scancel", *first], check=True)
                await chat(h, "b-big")
                assert await on_node(h, "b-big") == roles.big
                yield Site(h, prefix, resv, roles)
        finally:
            subprocess.run(["scancel", *held], check=False)


async def test_h100_model_waits_without_evicting_a100_replicas(site: Site) -> None:
    h = site.h
    held: list[str] = []
    try:
        await hold_node(site.prefix, site.roles.h100, held, site.resv)
        waiting = asyncio.create_task(chat(h, "h-h100"))

        async def turned_down() -> str | None:
            # Both idle a100 replicas could be stopped (once past the grace); neither
            # frees an h100.
            note = h.rec.notes.get("h-h100", "")
            return note if "2 idle replica(s) could be stopped, none makes room" in note else None

        note = await eventually(turned_down, "a note on why no eviction helps h-h100")
        assert "a-llm" in note and "b-big" in note
        assert note.count("gpu type a100, needs h100") == 2
        (rep,) = [r for r in h.rec.replicas.values() if r.model == "h-h100"]
        assert rep.job_state is JobState.PENDING and rep.reason in ("Resources", "Priority")
        assert not h.decisions("evict")
        assert not waiting.done()
    finally:
        subprocess.run(["scancel", *held], check=False)
    # The node comes free: the held request is served there, without an eviction.
    assert "hello" in await waiting
    assert await on_node(h, "h-h100") == site.roles.h100
    assert not h.decisions("evict")


async def test_a100_model_evicts_the_longest_idle_replica_that_makes_room(site: Site) -> None:
    h = site.h
    (b,) = ready(h, "b-big")
    # a-llm is idle longer, but on an llm-only node, outside llm-big; h-h100's node has no a100.
    assert "hello" in await chat(h, "w-big")
    (evict,) = h.decisions("evict")
    assert (evict.model, evict.replica_id) == ("b-big", b.replica_id)
    assert "to make room for w-big" in evict.reason
    assert await on_node(h, "w-big") == site.roles.big
    assert ready(h, "a-llm") and ready(h, "h-h100")


async def test_the_longest_waiting_model_is_served_first(site: Site) -> None:
    h = site.h
    before = len(h.decisions("evict"))
    # Every a100 replica busy: none is a candidate until both models wait.
    busy = [
        asyncio.create_task(chat(h, name, tokens=24))
        for name in ("a-llm", "b-big", "w-big")
        if ready(h, name)
    ]
    assert len(busy) == 2
    await eventually(
        lambda: asyncio.sleep(0, sum(r.in_flight for r in h.rec.replicas.values()) == 2),
        "both replicas serving",
    )
    early = asyncio.create_task(chat(h, "p-early"))
    await eventually(lambda: asyncio.sleep(0, h.decisions("submit", "p-early")), "p-early queued")
    late = asyncio.create_task(chat(h, "q-late"))
    await eventually(lambda: asyncio.sleep(0, h.decisions("submit", "q-late")), "q-late queued")
    assert not any(t.done() for t in busy)
    await asyncio.gather(*busy)
    done, _ = await asyncio.wait({early, late}, return_when=asyncio.FIRST_COMPLETED)
    assert done == {early}
    assert "hello" in early.result()
    first = h.decisions("evict")[before]
    assert "to make room for p-early" in first.reason
    # The other model is not starved: the next eviction serves it.
    assert "hello" in await late
    second = h.decisions("evict")[before + 1]
    assert "to make room for q-late" in second.reason
