"""The pyslurm backend's translation and call plumbing, with strict fakes.

pyslurm cannot be built on this machine (it links one Slurm release, 25.11);
these tests pin what the backend does with the attribute names and shapes
taken from pyslurm's source. Every fake raises AttributeError for any
attribute it was not given, so a name the code guesses wrong fails here
instead of reading as a silent default.
"""

from __future__ import annotations

import os
import re
import signal
import sys
import threading
from datetime import datetime
from typing import Any

import pytest

from llmgw_slurm.base.errors import ConfigError, SlurmError, SlurmParseError, SlurmUnavailable
from llmgw_slurm.slurm import JobSpec, JobState, make_backend
from llmgw_slurm.slurm.cli import CliBackend
from llmgw_slurm.slurm.pyslurm_backend import (
    UNAVAILABLE,
    PyslurmBackend,
    accounting_from_pyslurm,
    accounting_from_pyslurm_all,
    gpu_counts,
    jobs_from_pyslurm,
    node_from_pyslurm,
    node_state,
    nodes_from_pyslurm,
    sbatch_options,
    signal_number,
    submit_kwargs,
)


class Fake:
    """Only the attributes it was built with; reading anything else is an AttributeError."""

    def __init__(self, **attrs: Any) -> None:
        object.__setattr__(self, "_attrs", dict(attrs))

    def __getattr__(self, name: str) -> Any:
        attrs = object.__getattribute__(self, "_attrs")
        if name in attrs:
            return attrs[name]
        raise AttributeError(f"fake has no attribute {name!r}")

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"fake is read-only ({name})")


SUBMIT = 1_700_000_000
START = 1_700_000_060


def pjob(**over: Any) -> Fake:
    """A pyslurm 25.11 Job with the attribute names its source uses."""
    attrs: dict[str, Any] = {
        "id": 42,
        "name": "llmgw.tiny.0123abcd",
        "state": "RUNNING",
        "state_reason": "None",
        "partition": "gpu",
        "user_id": 1000,
        "user_name": "alice",
        "comment": "llmgw replica",
        "heterogeneous_id": None,
        "heterogeneous_offset": None,
        "allocated_nodes": "gpu[01-02]",
        "num_nodes": 2,
        "gres_per_node": {"gpu:a100": 2},
        "submit_time": SUBMIT,
        "start_time": START,
        "time_limit": 60,
        "end_time": START + 3600,
        "requeue_count": 1,
    }
    attrs.update(over)
    return Fake(**attrs)


# ------------------------------------------------------------------------ jobs


def test_plain_job_translates_every_field() -> None:
    [job] = jobs_from_pyslurm([pjob()], uid=1000)
    assert job.job_id == "42"
    assert job.name == "llmgw.tiny.0123abcd"
    assert job.state is JobState.RUNNING
    assert job.reason == ""
    assert job.partition == "gpu"
    assert job.user == "alice"
    assert job.comment == "llmgw replica"
    assert job.nodes == ("gpu01", "gpu02")
    assert job.submit_time == datetime.fromtimestamp(SUBMIT)
    assert job.start_time == datetime.fromtimestamp(START)
    assert job.time_limit_s == 3600
    assert job.end_time == datetime.fromtimestamp(START + 3600)
    assert job.restarts == 1
    assert not job.heterogeneous
    [comp] = job.components
    assert (comp.offset, comp.job_id, comp.node_count) == (0, "42", 2)
    assert comp.tres_per_node == "gres/gpu:a100:2"


def test_het_components_fold_into_one_job_under_the_het_id() -> None:
    worker = pjob(
        id=101,
        heterogeneous_id=100,
        heterogeneous_offset=1,
        allocated_nodes="gpu03",
        num_nodes=1,
        state_reason="Resources",
    )
    head = pjob(
        id=100,
        heterogeneous_id=100,
        heterogeneous_offset=0,
        allocated_nodes="gpu[01-02]",
        state_reason="Priority",
    )
    [job] = jobs_from_pyslurm([worker, head], uid=1000)
    assert job.job_id == "100"
    assert job.heterogeneous
    assert [c.offset for c in job.components] == [0, 1]
    assert [c.job_id for c in job.components] == ["100", "101"]
    assert job.nodes == ("gpu01", "gpu02", "gpu03")
    assert job.reason == "Priority"  # the head's


def test_filters_by_uid_and_prefix_without_a_passwd_lookup_per_job() -> None:
    class NoLookup(Fake):
        @property
        def user_name(self) -> str:
            raise AssertionError("user_name read for a job that the uid already excludes")

    theirs = NoLookup(
        **{k: v for k, v in pjob(id=7, user_id=2000)._attrs.items() if k != "user_name"}
    )
    other_prefix = pjob(id=8, name="notebook")
    jobs = jobs_from_pyslurm([theirs, other_prefix, pjob()], uid=1000, name_prefix="llmgw.")
    assert [j.job_id for j in jobs] == ["42"]


def test_filters_by_user_name_when_the_uid_is_unknown() -> None:
    jobs = jobs_from_pyslurm([pjob(id=1, user_name="bob"), pjob(id=2)], user="alice")
    assert [j.job_id for j in jobs] == ["2"]


def test_pending_job_older_attribute_names() -> None:
    # Older pyslurm names (het_job_*, restart_cnt, nodes): the fallbacks must find
    # them. Pending: Slurm's expected start and end are dropped.
    old = Fake(
        id=5,
        name="llmgw.x.00000000",
        state="PENDING",
        state_reason="Resources",
        partition="gpu",
        user_id=1000,
        user_name="alice",
        comment=None,
        het_job_id=0,
        het_job_offset=0,
        nodes=None,
        num_nodes=1,
        gres_per_node={},
        submit_time=SUBMIT,
        start_time=START,
        time_limit=10,
        end_time=START + 600,
        restart_cnt=0,
    )
    [job] = jobs_from_pyslurm([old], uid=1000)
    assert job.state is JobState.PENDING
    assert job.start_time is None
    assert job.reason == "Resources"
    assert job.comment == ""
    assert job.nodes == ()
    assert job.time_limit_s == 600
    assert job.end_time is None
    assert job.components[0].tres_per_node == ""


def test_unlimited_time_reads_as_none() -> None:
    [job] = jobs_from_pyslurm([pjob(time_limit=None, end_time=0)], uid=1000)
    assert job.time_limit_s is None
    assert job.end_time is None


def test_a_running_job_without_a_limit_has_no_end_whatever_slurm_filled_in() -> None:
    # Slurm 25.11 sets a year past the start; squeue prints NONE.
    [job] = jobs_from_pyslurm([pjob(time_limit=None, end_time=START + 365 * 86400)], uid=1000)
    assert job.end_time is None
    [ended] = jobs_from_pyslurm(
        [pjob(state="COMPLETED", time_limit=None, end_time=START + 5)], uid=1000
    )
    assert ended.end_time == datetime.fromtimestamp(START + 5)


def test_a_running_job_without_an_end_time_ends_at_start_plus_limit() -> None:
    [job] = jobs_from_pyslurm([pjob(end_time=None)], uid=1000)
    assert job.end_time == datetime.fromtimestamp(START + 3600)


def test_a_job_missing_a_required_attribute_is_skipped_not_fatal(
    caplog: pytest.LogCaptureFixture,
) -> None:
    broken = Fake(**{k: v for k, v in pjob(id=9)._attrs.items() if k != "state"})
    jobs = jobs_from_pyslurm([broken, pjob()], uid=1000)
    assert [j.job_id for j in jobs] == ["42"]
    assert "skipping job 9" in caplog.text


def test_a_bad_timestamp_is_skipped_with_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    jobs = jobs_from_pyslurm([pjob(submit_time="yesterday")], uid=1000)
    assert jobs == []
    assert "unexpected timestamp" in caplog.text


# ----------------------------------------------------------------------- nodes


def test_gpu_counts_from_configured_and_allocated_shapes() -> None:
    assert gpu_counts({"gpu:a100": 4, "gpu": 2, "shard": 8}) == {"a100": 4, "": 2}
    used = {
        "gpu:a100": {"count": "2", "indexes": "0-1"},
        "gpu:(null)": {"count": "0", "indexes": "N/A"},
        "gres/gpu:v100": 1,
    }
    assert gpu_counts(used) == {"a100": 2, "": 0, "v100": 1}
    assert gpu_counts("gpu:a100:4(S:0-1),gpu:v100:2") == {"a100": 4, "v100": 2}
    assert gpu_counts(None) == {}
    with pytest.raises(SlurmParseError, match="unexpected gres count"):
        gpu_counts({"gpu:a100": "many"})


@pytest.mark.parametrize(
    ("slurm", "ours", "usable"),
    [
        ("IDLE", "idle", True),
        ("MIXED", "mixed", True),
        ("ALLOCATED", "allocated", True),
        ("MIXED+DRAIN", "draining", False),
        ("IDLE+DRAIN", "drained", False),
        ("DOWN+DRAIN", "drained", False),
        ("DOWN+NOT_RESPONDING", "down*", False),
        ("IDLE+NOT_RESPONDING", "idle*", False),
        ("IDLE+CLOUD+POWERED_DOWN", "idle~", True),
        ("ALLOCATED+FAIL", "failing", False),
        ("IDLE+MAINT", "maint", False),
        ("FUTURE", "future", False),
        ("", "unknown", False),
    ],
)
def test_node_state_reads_like_sinfo(slurm: str, ours: str, usable: bool) -> None:
    assert node_state(slurm) == ours
    node = node_from_pyslurm(pnode(state=slurm))
    assert node.usable is usable


def pnode(**over: Any) -> Fake:
    attrs: dict[str, Any] = {
        "name": "gpu01",
        "state": "MIXED",
        "partitions": ["gpu", "debug"],
        "total_cpus": 64,
        "allocated_cpus": 16,
        "real_memory": 515_000,
        "configured_gres": {"gpu:a100": 4, "gpu:v100": 2},
        "allocated_gres": {"gpu:a100": {"count": "3", "indexes": "0-2"}},
        "address": "10.0.0.1",
        "reason": None,
    }
    attrs.update(over)
    return Fake(**attrs)


def test_node_translates_every_field() -> None:
    node = node_from_pyslurm(pnode())
    assert node.name == "gpu01"
    assert node.state == "mixed"
    assert node.partitions == ("gpu", "debug")
    assert (node.cpus_total, node.cpus_alloc, node.memory_mb) == (64, 16, 515_000)
    assert [(g.type, g.total, g.used) for g in node.gpus] == [("a100", 4, 3), ("v100", 2, 0)]
    assert node.gpus_free("a100") == 1
    assert node.gpus_free() == 3
    assert node.address == "10.0.0.1"
    assert node.reason == ""
    assert node.features is None  # this pyslurm gives none: the plan does not check them
    assert node.memory_alloc_mb is None
    assert node_from_pyslurm(pnode(allocated_memory=4096)).memory_alloc_mb == 4096
    assert node_from_pyslurm(pnode(available_features=["nvlink", "ib"])).features == (
        "nvlink",
        "ib",
    )
    assert node_from_pyslurm(pnode(features="nvlink,ib")).features == ("nvlink", "ib")


def test_untyped_gpu_use_goes_to_the_nodes_gpu_type() -> None:
    # pyslurm 25.11 on a site tracking only gres/gpu: {"gpu": 2}, as on the dev cluster.
    one = node_from_pyslurm(pnode(configured_gres={"gpu:a100": 4}, allocated_gres={"gpu": 2}))
    assert [(g.type, g.total, g.used) for g in one.gpus] == [("a100", 4, 2)]
    # Typed counts tracked too: the untyped one is their sum, not more use.
    both = {"gpu": 3, "gpu:a100": 2, "gpu:v100": 1}
    exact = node_from_pyslurm(pnode(allocated_gres=both))
    assert [(g.type, g.used) for g in exact.gpus] == [("a100", 2), ("v100", 1)]
    # Two types and only an untyped count: it may be either, so neither is counted free.
    unsure = node_from_pyslurm(pnode(allocated_gres={"gpu": 3}))
    assert [(g.type, g.used) for g in unsure.gpus] == [("a100", 3), ("v100", 2)]
    assert unsure.gpus_free() == 1
    untyped = node_from_pyslurm(pnode(configured_gres={"gpu": 2}, allocated_gres={"gpu": 1}))
    assert [(g.type, g.total, g.used) for g in untyped.gpus] == [("", 2, 1)]


def test_node_older_names_and_a_broken_node_is_skipped(caplog: pytest.LogCaptureFixture) -> None:
    old = Fake(
        **{
            **{k: v for k, v in pnode()._attrs.items() if k != "allocated_cpus"},
            "alloc_cpus": 8,
            "partitions": None,
        }
    )
    broken = Fake(name="bad01", state="IDLE")
    nodes = nodes_from_pyslurm([old, broken])
    assert [(n.name, n.cpus_alloc, n.partitions) for n in nodes] == [("gpu01", 8, ())]
    assert "skipping node bad01" in caplog.text


# ------------------------------------------------------------------ accounting


def dbjob(**over: Any) -> Fake:
    attrs: dict[str, Any] = {
        "id": 77,
        "name": "llmgw.tiny.0123abcd",
        "user_name": "alice",
        "account": "ml",
        "partition": "gpu",
        "state": "COMPLETED",
        "exit_code": 0,
        "exit_code_signal": 0,
        "comment": "llmgw replica",
        "submit_time": SUBMIT,
        "start_time": START,
        "end_time": START + 7200,
        "elapsed_time": 7200,
        "num_nodes": 1,
        "allocated_tres": "billing=4,cpu=4,gres/gpu=2,gres/gpu:a100=2,mem=16G,node=1",
    }
    attrs.update(over)
    return Fake(**attrs)


def test_accounting_record_translates_every_field() -> None:
    rec = accounting_from_pyslurm(dbjob())
    assert (rec.job_id, rec.name, rec.user, rec.account, rec.partition) == (
        "77",
        "llmgw.tiny.0123abcd",
        "alice",
        "ml",
        "gpu",
    )
    assert rec.state is JobState.COMPLETED
    assert rec.exit_code == "0:0"
    assert rec.comment == "llmgw replica"
    assert rec.end == datetime.fromtimestamp(START + 7200)
    assert (rec.elapsed_s, rec.nodes, rec.gpus) == (7200, 1, 2)
    assert rec.gpu_hours == 4.0


def test_accounting_without_a_tres_attribute_reads_zero_gpus() -> None:
    attrs = {k: v for k, v in dbjob()._attrs.items() if k != "allocated_tres"}
    rec = accounting_from_pyslurm(Fake(**attrs))
    assert (rec.alloc_tres, rec.gpus) == ("", 0)


def test_accounting_tres_as_a_mapping_and_prefix_filter() -> None:
    recs = accounting_from_pyslurm_all(
        [dbjob(allocated_tres={"cpu": 4, "gres/gpu": 3}), dbjob(id=78, name="other")],
        name_prefix="llmgw.",
    )
    assert [(r.job_id, r.gpus, r.alloc_tres) for r in recs] == [("77", 3, "cpu=4,gres/gpu=3")]


def test_accounting_tres_from_pyslurm_2511_trackable_resources() -> None:
    # db.Job.allocated_tres: kinds to a resource or to a dict of them; raw_str is None.
    def res(name: str, count: int) -> Fake:
        return Fake(type_and_name=name, count=count)

    tres = Fake(
        to_dict=lambda: {
            "cpu": res("cpu", 1),
            "energy": None,
            "gres": {"gpu": res("gres/gpu", 2)},
            "mem": res("mem", 500),
            "fs": {},
            "raw_str": None,
        }
    )
    rec = accounting_from_pyslurm(dbjob(allocated_tres=tres))
    assert (rec.alloc_tres, rec.gpus) == ("cpu=1,gres/gpu=2,mem=500M", 2)


# ---------------------------------------------------------------------- submit


def test_sbatch_options_read_like_sbatch() -> None:
    script = "\n".join(
        [
            "#!/bin/bash",
            "# a comment",
            "#SBATCH --partition=llm -N 1 --gres=gpu:a100:2",
            "",
            "#SBATCH -t 10 --cpus-per-task=4 --mem=500M --requeue --hold",
            "#SBATCH --job-name=x --output=/dev/null --signal=B:USR1@60",
            "echo run",
            "#SBATCH --qos=after-the-first-command-is-not-read",
        ]
    )
    assert sbatch_options(script) == {
        "partitions": "llm",
        "nodes": "1",
        "gres_per_node": "gpu:a100:2",
        "time_limit": 10,
        "cpus_per_task": 4,
        "memory_per_node": "500M",
        "is_requeueable": True,
        "priority": 0,
        "name": "x",
        "standard_output": "/dev/null",
        "signal": {"signal": int(signal.SIGUSR1), "time": 60, "batch_only": True},
    }
    assert sbatch_options("#!/bin/sh\n#SBATCH -t 01:00:00 --no-requeue --signal=10\n") == {
        "time_limit": "01:00:00",
        "is_requeueable": False,
        "signal": {"signal": 10, "time": 60},
    }


@pytest.mark.parametrize(
    ("line", "says"),
    [
        ("#SBATCH --export=NONE", "'--export=NONE' is not one it can pass on"),
        ("#SBATCH --cpus-per-task=four", "wants a number, got 'four'"),
        ("#SBATCH --partition", "has no value"),
        ("#SBATCH llm", "unexpected #SBATCH word 'llm'"),
        ("#SBATCH --comment='open", "cannot read the #SBATCH line"),
        ("#SBATCH --signal=X:USR1@60", "is not [{R|B}:]SIG[@SECONDS]"),
        ("#SBATCH --signal=USR1@soon", "is not [{R|B}:]SIG[@SECONDS]"),
        ("#SBATCH --signal=NOPE", "unknown signal 'NOPE'"),
    ],
)
def test_sbatch_options_refuse_what_they_cannot_pass_on(line: str, says: str) -> None:
    with pytest.raises(SlurmError, match=re.escape(says)) as err:
        sbatch_options(f"#!/bin/sh\n{line}\n")
    assert "or use slurm.backend: cli" in err.value.message


def test_submit_kwargs_merge_env_and_leave_unset_options_to_the_script() -> None:
    spec = JobSpec(
        name="llmgw.tiny.0123abcd",
        script="#!/bin/sh\n",
        env={"LLMGW_MODEL": "tiny", "PATH": "/ours"},
    )
    kw = submit_kwargs(spec, "/tmp/x.sbatch", {"PATH": "/usr/bin", "HOME": "/home/a"})
    assert kw == {
        "name": "llmgw.tiny.0123abcd",
        "script": "/tmp/x.sbatch",
        "environment": {"PATH": "/ours", "HOME": "/home/a", "LLMGW_MODEL": "tiny"},
    }
    full = submit_kwargs(
        JobSpec(name="n", script="#!/bin/sh\n", comment="c", workdir="/w"), "/s", {}
    )
    assert (full["comment"], full["working_directory"]) == ("c", "/w")


@pytest.mark.parametrize(
    ("given", "num"),
    [("USR1", signal.SIGUSR1), ("SIGTERM", 15), ("usr2", signal.SIGUSR2), ("9", 9), (10, 10)],
)
def test_signal_number(given: str | int, num: int) -> None:
    assert signal_number(given) == num


def test_signal_number_rejects_unknown_names() -> None:
    with pytest.raises(SlurmError, match="unknown signal 'NOPE'"):
        signal_number("NOPE")


# -------------------------------------------------------- backend, fake module


class RPCError(Exception):
    """Stands in for pyslurm.RPCError."""


class FakeSubmitDescription:
    """Accepts only the attributes pyslurm 25.11.2's JobSubmitDescription has."""

    KNOWN = frozenset(
        [
            "name",
            "account",
            "user_id",
            "group_id",
            "priority",
            "site_factor",
            "wckey",
            "array",
            "batch_constraints",
            "begin_time",
            "clusters",
            "cluster_constraints",
            "comment",
            "admin_comment",
            "requires_contiguous_nodes",
            "cores_reserved_for_system",
            "threads_reserved_for_system",
            "working_directory",
            "cpu_frequency",
            "nodes",
            "deadline",
            "delay_boot_time",
            "dependencies",
            "excluded_nodes",
            "required_nodes",
            "constraints",
            "kill_on_node_fail",
            "licenses",
            "mail_user",
            "mail_types",
            "mcs_label",
            "memory_per_cpu",
            "memory_per_node",
            "memory_per_gpu",
            "network",
            "nice",
            "log_files_open_mode",
            "overcommit",
            "partitions",
            "profile_types",
            "accounting_gather_frequency",
            "qos",
            "requires_node_reboot",
            "is_requeueable",
            "reservations",
            "script",
            "script_args",
            "environment",
            "resource_sharing",
            "distribution",
            "time_limit",
            "time_limit_min",
            "container",
            "container_id",
            "cpus_per_task",
            "cpus_per_gpu",
            "sockets_per_node",
            "cores_per_socket",
            "threads_per_core",
            "gpus",
            "gpus_per_socket",
            "gpus_per_task",
            "gres_per_node",
            "gpu_binding",
            "ntasks",
            "ntasks_per_node",
            "ntasks_per_socket",
            "ntasks_per_core",
            "ntasks_per_gpu",
            "switches",
            "signal",
            "standard_in",
            "standard_output",
            "standard_error",
            "kill_on_invalid_dependency",
            "spreads_over_nodes",
            "use_min_nodes",
            "gres_binding",
            "gres_tasks_per_sharing",
            "temporary_disk_per_node",
            "get_user_environment",
            "min_cpus_per_node",
            "wait_all_nodes",
            "selinux_context",
            "segment_size",
            "reserved_ports",
            "extra",
        ]
    )
    seen: list[dict[str, Any]] = []

    def __init__(self, **kwargs: Any) -> None:
        unknown = set(kwargs) - self.KNOWN
        if unknown:
            raise AttributeError(f"JobSubmitDescription has no {sorted(unknown)}")
        self.kwargs = kwargs

    def submit(self) -> int:
        with open(self.kwargs["script"]) as f:
            text = f.read()
        self.seen.append(
            {**self.kwargs, "text": text, "mode": os.stat(self.kwargs["script"]).st_mode & 0o777}
        )
        return 4242


class FakeJobHandle:
    calls: list[tuple[Any, ...]] = []
    fail_with: Exception | None = None

    def __init__(self, job_id: int) -> None:
        self.job_id = job_id

    def send_signal(self, sig: int, steps: str = "children") -> None:
        FakeJobHandle.calls.append(("signal", self.job_id, sig, steps))
        if FakeJobHandle.fail_with is not None:
            raise FakeJobHandle.fail_with

    def requeue(self) -> None:
        FakeJobHandle.calls.append(("requeue", self.job_id))


class FakeCli:
    def __init__(self) -> None:
        self.specs: list[JobSpec] = []
        self.accounting_asked: list[dict[str, Any]] = []

    async def submit(self, spec: JobSpec) -> str:
        self.specs.append(spec)
        return "999"

    async def accounting(
        self,
        start: datetime,
        end: datetime | None = None,
        *,
        name_prefix: str = "",
        all_users: bool = False,
        duplicates: bool = False,
    ) -> list[Any]:
        self.accounting_asked.append(
            {"name_prefix": name_prefix, "all_users": all_users, "duplicates": duplicates}
        )
        return []

    @property
    def calls(self) -> int:
        return len(self.specs)


def fake_module(
    jobs: Any = (), nodes: Any = (), db_jobs: Any = (), filters: list[dict[str, Any]] | None = None
) -> Fake:
    def job_filter(**kw: Any) -> dict[str, Any]:
        if filters is not None:
            filters.append(kw)
        return kw

    return Fake(
        __version__="25.11.0",
        RPCError=RPCError,
        JobSubmitDescription=FakeSubmitDescription,
        Job=FakeJobHandle,
        Jobs=Fake(load=lambda: jobs),
        Nodes=Fake(load=lambda: nodes),
        db=Fake(JobFilter=job_filter, Jobs=Fake(load=lambda flt: db_jobs)),
    )


@pytest.fixture(autouse=True)
def _reset_fakes() -> None:
    FakeSubmitDescription.seen = []
    FakeJobHandle.calls = []
    FakeJobHandle.fail_with = None


def backend(module: Fake, **kw: Any) -> PyslurmBackend:
    return PyslurmBackend(user="alice", module=module, env={"PATH": "/usr/bin"}, **kw)


def test_without_pyslurm_the_constructor_says_what_to_do(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "pyslurm", None)  # import pyslurm -> ImportError
    with pytest.raises(SlurmUnavailable) as err:
        PyslurmBackend()
    assert UNAVAILABLE in str(err.value)
    assert "use slurm.backend: cli" in str(err.value)


async def test_submit_writes_a_private_script_file_and_removes_it() -> None:
    spec = JobSpec(
        name="llmgw.tiny.0123abcd",
        script="#!/bin/bash\n#SBATCH --gres=gpu:a100:1\n#SBATCH --time=01:00:00\nexec agent\n",
        env={"LLMGW_REPLICA_SECRET": "s3cret"},
        comment="llmgw replica",
    )
    b = backend(fake_module())
    assert await b.submit(spec) == "4242"
    [seen] = FakeSubmitDescription.seen
    assert seen["name"] == "llmgw.tiny.0123abcd"
    assert seen["comment"] == "llmgw replica"
    assert seen["environment"] == {"PATH": "/usr/bin", "LLMGW_REPLICA_SECRET": "s3cret"}
    assert (seen["gres_per_node"], seen["time_limit"]) == ("gpu:a100:1", "01:00:00")
    assert seen["text"] == spec.script
    assert seen["mode"] == 0o600
    assert not os.path.exists(seen["script"])
    assert b.calls == 1


async def test_het_submission_goes_through_sbatch(caplog: pytest.LogCaptureFixture) -> None:
    cli = FakeCli()
    b = backend(fake_module(), cli=cli)
    spec = JobSpec(
        name="llmgw.big.0123abcd",
        script="#!/bin/bash\n#SBATCH -N1\n#SBATCH hetjob\n#SBATCH -N1\nrun\n",
    )
    caplog.set_level("INFO")
    assert await b.submit(spec) == "999"
    assert cli.specs == [spec]
    assert FakeSubmitDescription.seen == []
    assert "heterogeneous" in caplog.text
    assert b.calls == 1  # the fallback's call counts too


async def test_list_jobs_loads_all_and_keeps_ours() -> None:
    # Jobs.load returns a map (id -> Job) in pyslurm 23.11+.
    everyone = {
        1: pjob(id=1, user_id=2000, user_name="bob"),
        42: pjob(),
        43: pjob(id=43, name="scratch"),
    }
    b = backend(fake_module(jobs=everyone))
    b._uid = 1000  # the test's "alice" need not exist in this machine's passwd
    jobs = await b.list_jobs("llmgw.")
    assert [j.job_id for j in jobs] == ["42"]
    assert b.call_counts["pyslurm.Jobs.load"] == 1


async def test_list_nodes_from_a_list_collection() -> None:
    b = backend(fake_module(nodes=[pnode(), pnode(name="gpu02", state="IDLE+DRAIN")]))
    nodes = await b.list_nodes()
    assert [(n.name, n.usable) for n in nodes] == [("gpu01", True), ("gpu02", False)]


async def test_cancel_maps_scancel_semantics_onto_send_signal() -> None:
    b = backend(fake_module())
    await b.cancel("42")
    await b.cancel("42", signal="USR1")
    await b.cancel("42", signal="TERM", batch_only=True)
    assert FakeJobHandle.calls == [
        ("signal", 42, int(signal.SIGKILL), "all"),
        ("signal", 42, int(signal.SIGUSR1), "children"),
        ("signal", 42, int(signal.SIGTERM), "batch"),
    ]


async def test_cancel_of_a_job_already_gone_is_not_an_error() -> None:
    FakeJobHandle.fail_with = RPCError("Job/step already completing or completed")
    await backend(fake_module()).cancel("42", signal="TERM")


async def test_cancel_other_failures_raise_slurm_error() -> None:
    FakeJobHandle.fail_with = RPCError("Access/permission denied")
    with pytest.raises(SlurmError, match="permission denied") as err:
        await backend(fake_module()).cancel("42")
    assert err.value.command == ["pyslurm.Job.send_signal"]


async def test_cancel_and_requeue_refuse_ids_that_are_not_numbers() -> None:
    b = backend(fake_module())
    with pytest.raises(SlurmError, match="not a plain job id"):
        await b.cancel("42; rm -rf /")
    with pytest.raises(SlurmError, match="not a plain job id"):
        await b.requeue("42+1")
    assert FakeJobHandle.calls == []


async def test_requeue() -> None:
    await backend(fake_module()).requeue("42")
    assert FakeJobHandle.calls == [("requeue", 42)]


async def test_accounting_filters_on_user_unless_all_users() -> None:
    filters: list[dict[str, Any]] = []
    b = backend(fake_module(db_jobs=[dbjob(), dbjob(id=78, name="x")], filters=filters))
    start, end = datetime(2025, 1, 1), datetime(2025, 1, 2)
    recs = await b.accounting(start, end, name_prefix="llmgw.")
    assert [r.job_id for r in recs] == ["77"]
    await b.accounting(start, end, all_users=True)
    assert filters == [
        {"start_time": start, "end_time": end, "users": ["alice"]},
        {"start_time": start, "end_time": end},
    ]


async def test_every_run_of_requeued_jobs_comes_from_sacct() -> None:
    # pyslurm's db.Jobs holds one record per job id: the runs before a requeue
    # (a preemption) are only in sacct --duplicates.
    filters: list[dict[str, Any]] = []
    cli = FakeCli()
    b = backend(fake_module(db_jobs=[dbjob()], filters=filters), cli=cli)
    recs = await b.accounting(datetime(2025, 1, 1), name_prefix="llmgw.", duplicates=True)
    assert recs == [] and filters == []
    assert cli.accounting_asked == [
        {"name_prefix": "llmgw.", "all_users": False, "duplicates": True}
    ]


async def test_a_call_that_hangs_becomes_slurm_unavailable() -> None:
    release = threading.Event()

    def hang() -> list[Any]:
        release.wait(10)
        return []

    b = backend(fake_module(), timeout=0.01)
    b._m = Fake(Jobs=Fake(load=hang))
    try:
        with pytest.raises(SlurmUnavailable, match="no answer within"):
            await b.list_jobs()
    finally:
        release.set()


# ----------------------------------------------------------------- make_backend


def test_make_backend_cli() -> None:
    b = make_backend("cli", user="alice", timeout=5.0)
    assert isinstance(b, CliBackend)
    assert b.user == "alice"


def test_make_backend_pyslurm_passes_options() -> None:
    b = make_backend("pyslurm", user="alice", module=fake_module())
    assert isinstance(b, PyslurmBackend)


def test_make_backend_unknown_kind_lists_the_valid_ones() -> None:
    with pytest.raises(
        ConfigError,
        match=r"unknown Slurm backend 'slurmrestd'; valid: cli, "
        r"pyslurm",
    ):
        make_backend("slurmrestd")


def test_make_backend_unknown_option_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="cli backend"):
        make_backend("cli", colour="blue")


def test_array_tasks_carry_their_arrays_id_and_the_array_option_passes_on() -> None:
    task, alone = pjob(id=57, array_id=55), pjob(id=60, array_id=0)
    master = pjob(id=55, array_id=55)
    jobs = {j.job_id: j for j in jobs_from_pyslurm([task, alone, master], uid=1000)}
    assert (jobs["57"].array_job_id, jobs["55"].array_job_id, jobs["60"].array_job_id) == (
        "55",
        "",
        "",
    )
    assert sbatch_options("#!/bin/bash\n#SBATCH --array=0-3\n")["array"] == "0-3"
