"""Node roles from fake SLURM_* environments, hostlist expansion, the port file."""

from __future__ import annotations

import asyncio
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from llmgw_slurm.agent import rendezvous as rdzv
from llmgw_slurm.agent.errors import RendezvousError
from llmgw_slurm.slurm.cli import show_hostnames

HOSTS = {
    "gpu[01-02]": ["gpu01", "gpu02"],
    "gpu[03-04],big7": ["gpu03", "gpu04", "big7"],
}


def fake_expand(nodelist: str) -> list[str]:
    if nodelist in HOSTS:
        return HOSTS[nodelist]
    if "[" in nodelist:
        raise AssertionError(f"fake scontrol does not know {nodelist!r}")
    return nodelist.split(",")


def het_env(procid: int, offset: int, nodeid: int) -> dict[str, str]:
    # A 1 + 2 + 3 node het job: component 0 the head, then workers.
    return {
        "SLURM_JOB_ID": str(1000 + offset),
        "SLURM_HET_JOB_ID": "1000",
        "SLURM_HET_SIZE": "3",
        "SLURM_JOB_NUM_NODES_HET_GROUP_0": "1",
        "SLURM_JOB_NUM_NODES_HET_GROUP_1": "2",
        "SLURM_JOB_NUM_NODES_HET_GROUP_2": "3",
        "SLURM_JOB_NODELIST_HET_GROUP_0": "head9",
        "SLURM_JOB_NODELIST": "gpu[01-02]",
        "SLURM_PROCID": str(procid),
        "SLURM_HET_JOB_OFFSET": str(offset),
        "SLURM_NODEID": str(nodeid),
        "SLURM_RESTART_COUNT": "2",
    }


def test_single_node() -> None:
    role = rdzv.compute_role(
        {
            "SLURM_JOB_ID": "77",
            "SLURM_JOB_NODELIST": "gpu01",
            "SLURM_PROCID": "0",
            "SLURM_JOB_NUM_NODES": "1",
        },
        fake_expand,
    )
    assert role == rdzv.NodeRole(job_id="77", restart=0, rank=0, nnodes=1, head_host="gpu01")
    assert role.is_head and not role.multi_node


def test_het_job_roles() -> None:
    roles = [
        rdzv.compute_role(het_env(p, o, n), fake_expand)
        for p, o, n in [(0, 0, 0), (1, 1, 0), (2, 1, 1), (5, 2, 2)]
    ]
    assert [r.rank for r in roles] == [0, 1, 2, 5]
    assert {r.nnodes for r in roles} == {6}
    assert {r.head_host for r in roles} == {"head9"}
    assert {r.job_id for r in roles} == {"1000"}  # the het id, not the component's
    assert {r.restart for r in roles} == {2}


def test_het_rank_without_procid_uses_offsets() -> None:
    env = het_env(0, 2, 1)
    del env["SLURM_PROCID"]
    assert rdzv.compute_role(env, fake_expand).rank == 1 + 2 + 1


def test_plain_multi_node_head_from_nodelist() -> None:
    env = {
        "SLURM_JOB_ID": "5",
        "SLURM_NODELIST": "gpu[03-04],big7",
        "SLURM_PROCID": "2",
        "SLURM_NNODES": "3",
    }
    role = rdzv.compute_role(env, fake_expand)
    assert role.head_host == "gpu03" and role.rank == 2 and role.nnodes == 3


@pytest.mark.parametrize(
    ("env", "words"),
    [
        ({}, "not inside a Slurm job"),
        ({"SLURM_JOB_ID": "5"}, "SLURM_JOB_NODELIST"),
        ({"SLURM_JOB_ID": "5", "SLURM_NODELIST": "a", "SLURM_PROCID": "x"}, "not an integer"),
        (
            {
                "SLURM_JOB_ID": "5",
                "SLURM_NODELIST": "a,b",
                "SLURM_NNODES": "2",
                "SLURM_PROCID": "3",
            },
            "one agent task per node",
        ),
        (
            {
                "SLURM_JOB_ID": "5",
                "SLURM_NODELIST": "a",
                "SLURM_HET_SIZE": "2",
                "SLURM_JOB_NUM_NODES_HET_GROUP_0": "1",
            },
            "HET_GROUP_1",
        ),
    ],
)
def test_bad_environments(env: dict[str, str], words: str) -> None:
    with pytest.raises(RendezvousError, match=words):
        rdzv.compute_role(env, fake_expand)


def test_expand_plain_list_needs_no_scontrol() -> None:
    def boom(*a: Any, **k: Any) -> Any:
        raise AssertionError("scontrol called")

    assert rdzv.expand_hostnames("a1,b2", run=boom) == ["a1", "b2"]


def test_expand_brackets_asks_scontrol() -> None:
    seen: list[list[str]] = []

    def fake_run(argv: list[str], **kw: Any) -> subprocess.CompletedProcess[str]:
        seen.append(argv)
        return subprocess.CompletedProcess(argv, 0, "gpu01\ngpu02\n", "")

    assert rdzv.expand_hostnames("gpu[01-02]", run=fake_run) == ["gpu01", "gpu02"]
    assert seen == [["scontrol", "show", "hostnames", "gpu[01-02]"]]


def test_expand_asks_scontrol_through_the_slurm_layer_without_its_input_variables(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The agent's one Slurm call lives in llmgw_slurm/slurm/ and, like the daemon's,
    # does not let the job's SCONTROL_* variables change what scontrol prints.
    monkeypatch.setenv("SCONTROL_ALL", "1")
    envs: list[dict[str, str]] = []

    def fake_run(argv: list[str], **kw: Any) -> subprocess.CompletedProcess[str]:
        envs.append(kw["env"])
        return subprocess.CompletedProcess(argv, 0, "gpu01\n", "")

    assert show_hostnames("gpu[01]", run=fake_run) == ["gpu01"]
    assert "SCONTROL_ALL" not in envs[0] and envs[0]["PATH"] == os.environ["PATH"]


def test_expand_scontrol_failure_is_clear() -> None:
    def fake_run(argv: list[str], **kw: Any) -> subprocess.CompletedProcess[str]:
        return subprocess.CompletedProcess(argv, 1, "", "scontrol: error: bad list")

    with pytest.raises(RendezvousError, match="bad list"):
        rdzv.expand_hostnames("gpu[01-", run=fake_run)


def test_pick_free_port_skips_taken_and_excluded() -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        taken = s.getsockname()[1]
        port = rdzv.pick_free_port(
            (taken, taken + 2), seed=0, host="127.0.0.1", exclude={taken + 1}
        )
        assert port == taken + 2


async def test_publish_and_await(tmp_path: Path) -> None:
    role = rdzv.compute_role(het_env(0, 0, 0), fake_expand)
    worker = rdzv.compute_role(het_env(3, 2, 0), fake_expand)
    path = rdzv.rendezvous_path(tmp_path, role)
    assert path == rdzv.rendezvous_path(tmp_path, worker)
    waiter = asyncio.create_task(rdzv.await_published(path, worker, timeout_s=30, poll_s=0.05))
    await asyncio.sleep(0.1)
    assert not waiter.done()
    rdzv.publish(path, role, "head9", 29512)
    assert await waiter == ("head9", 29512)


async def test_stale_file_of_another_run_is_refused(tmp_path: Path) -> None:
    role = rdzv.compute_role(het_env(0, 0, 0), fake_expand)
    path = rdzv.rendezvous_path(tmp_path, role)
    rdzv.publish(path, rdzv.NodeRole("999", 0, 0, 2, "x"), "x", 1)
    with pytest.raises(RendezvousError, match="another job run"):
        await rdzv.await_published(path, role, timeout_s=1, poll_s=0.05)


async def test_await_times_out_clearly(tmp_path: Path) -> None:
    role = rdzv.compute_role(het_env(1, 1, 0), fake_expand)
    with pytest.raises(RendezvousError, match="did not publish"):
        await rdzv.await_published(tmp_path / "nothing.json", role, timeout_s=0, poll_s=0.01)


def test_derived_port_is_shared_by_every_node_of_a_run() -> None:
    head = rdzv.compute_role(het_env(0, 0, 0), fake_expand)
    worker = rdzv.compute_role(het_env(4, 2, 1), fake_expand)
    port = rdzv.derived_port((20000, 29999), head)
    assert port == rdzv.derived_port((20000, 29999), worker)
    assert 20000 <= port <= 29999
    # A requeued run (restart count + 1) gets another port.
    again = rdzv.NodeRole(head.job_id, head.restart + 1, 0, head.nnodes, head.head_host)
    ports = {rdzv.derived_port((20000, 29999), again), port}
    assert len(ports) == 2


def test_derived_port_taken_on_head_is_a_clear_error() -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        with pytest.raises(RendezvousError, match="rendezvous directory"):
            rdzv.check_port_free(s.getsockname()[1], "127.0.0.1")
