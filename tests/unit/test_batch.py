"""The Batch API without Slurm: the input check, the state machine, result files,
the store's ownership, and the service's decisions over a recording backend."""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from llmgw_slurm.accounting.quota import Ask, QuotaBook, Refusal, Reservation
from llmgw_slurm.auth.keys import KeyRecord
from llmgw_slurm.auth.secrets import batch_secret, sign_report
from llmgw_slurm.base.errors import SlurmError
from llmgw_slurm.base.yamlsrc import load_yaml
from llmgw_slurm.batch import results
from llmgw_slurm.batch.jobs import BatchJobs
from llmgw_slurm.batch.model import (
    MAX_ERRORS,
    BatchRecord,
    BatchStatus,
    Checked,
    check_input,
    transition,
)
from llmgw_slurm.batch.service import MAX_JOBS, BatchRefused, BatchService
from llmgw_slurm.batch.store import BatchStore, clean_filename
from llmgw_slurm.catalog import parse_catalog
from llmgw_slurm.config import BatchConfig, ClusterConfig, QuotaConfig, ServerConfig, SlurmConfig
from llmgw_slurm.reconciler.reports import ReportVerifier
from llmgw_slurm.slurm.types import Job, JobSpec, JobState
from tests.unit._router_support import serve

CHAT = "/v1/chat/completions"
KNOWN = {"tiny": "tiny", "tiny-alias": "tiny", "other": "other"}


def line(cid: str, model: str = "tiny", **over: Any) -> bytes:
    obj: dict[str, Any] = {
        "custom_id": cid,
        "method": "POST",
        "url": CHAT,
        "body": {"model": model, "messages": [{"role": "user", "content": "hi"}]},
    }
    obj.update(over)
    return json.dumps(obj).encode() + b"\n"


def check(*lines: bytes, max_requests: int = 1000) -> Checked | list[tuple[str, int | None]]:
    got = check_input(list(lines), CHAT, KNOWN.get, max_requests)
    if isinstance(got, Checked):
        return got
    return [(e.code, e.line) for e in got]


# ---- the input check ------------------------------------------------------------------


def test_a_valid_file_gives_its_count_and_its_one_model_through_an_alias() -> None:
    got = check(line("a"), line("b", "tiny-alias"))
    assert got == Checked(2, "tiny", ("a", "b"))


@pytest.mark.parametrize(
    ("bad", "code"),
    [
        (b"{not json\n", "invalid_json_line"),
        (b"[1, 2]\n", "invalid_json_line"),
        (b"\xff\xfe\n", "invalid_json_line"),
        (b"[" * 100_000 + b"\n", "invalid_json_line"),
        (line("", "tiny"), "missing_required_parameter"),
        (line("x" * 513), "invalid_value"),
        (line("c", method="GET"), "invalid_method"),
        (line("c", url="/v1/embeddings"), "invalid_url"),
        (line("c", url="/../../etc/passwd"), "invalid_url"),
        (line("c", body="text"), "missing_required_parameter"),
        (line("c", body={"messages": []}), "missing_required_parameter"),
        (line("c", body={"model": "tiny", "stream": True}), "invalid_value"),
        (line("c", "nope"), "model_not_found"),
        (line("c", "other"), "mismatched_model"),
        (line("a"), "duplicate_custom_id"),
    ],
)
def test_each_bad_line_is_named_with_its_code_and_line_number(bad: bytes, code: str) -> None:
    assert check(line("a"), bad, line("b")) == [(code, 2)]


def test_an_empty_file_and_a_file_over_the_limit_are_refused() -> None:
    assert check() == [("empty_file", None)]
    assert check(line("a"), line("b"), line("c"), max_requests=2) == [("too_many_requests", 3)]


def test_the_errors_list_is_cut_at_its_limit() -> None:
    got = check(*[b"nope\n"] * (MAX_ERRORS + 50))
    assert isinstance(got, list) and len(got) == MAX_ERRORS


# ---- the state machine ----------------------------------------------------------------


def record(**over: Any) -> BatchRecord:
    base = BatchRecord(
        id="batch_" + "0" * 24,
        owner="alice",
        endpoint=CHAT,
        input_file_id="file-" + "0" * 24,
        completion_window="24h",
        created_at=1000,
        expires_at=1000 + 86400,
    )
    return replace(base, **over)


def test_each_move_sets_its_timestamp_and_a_final_batch_never_moves() -> None:
    b = transition(record(), BatchStatus.IN_PROGRESS, 1001.5)
    assert (b.status, b.in_progress_at) == (BatchStatus.IN_PROGRESS, 1001)
    b = transition(b, BatchStatus.CANCELLING, 1002)
    b = transition(b, BatchStatus.CANCELLED, 1003)
    assert (b.cancelling_at, b.cancelled_at) == (1002, 1003)
    for to in BatchStatus:
        with pytest.raises(ValueError, match="no move from cancelled"):
            transition(b, to, 1004)


def test_a_cancelling_batch_can_only_end_cancelled() -> None:
    b = transition(record(status=BatchStatus.IN_PROGRESS), BatchStatus.CANCELLING, 1)
    with pytest.raises(ValueError, match="no move"):
        transition(b, BatchStatus.COMPLETED, 2)


def test_a_record_reads_back_from_its_json() -> None:
    errors = check_input([b"x\n"], CHAT, KNOWN.get, 9)
    assert isinstance(errors, list)
    b = transition(record(), BatchStatus.FAILED, 5, errors=tuple(errors))
    assert BatchRecord.from_json(json.loads(json.dumps(b.to_json()))) == b
    api = b.to_api()
    assert api["errors"]["data"] == [
        {
            "code": "invalid_json_line",
            "message": "This line is not valid JSON.",
            "param": None,
            "line": 1,
        }
    ]


# ---- result files ---------------------------------------------------------------------


def test_repair_cuts_only_a_partial_last_line(tmp_path: Path) -> None:
    f = tmp_path / "out.jsonl"
    whole = b'{"custom_id": "a"}\n{"custom_id": "b"}\n'
    f.write_bytes(whole + b'{"custom_id": "c", "resp')
    results.repair(f)
    assert f.read_bytes() == whole
    results.repair(f)
    assert f.read_bytes() == whole
    assert results.custom_ids(f) == {"a", "b"}
    g = tmp_path / "one.jsonl"
    g.write_bytes(b'{"custom_id": "half')
    results.repair(g)
    assert g.read_bytes() == b""
    results.repair(tmp_path / "missing.jsonl")


# ---- the store ------------------------------------------------------------------------


def test_another_owners_objects_are_missing_and_ids_never_become_paths(tmp_path: Path) -> None:
    store = BatchStore(tmp_path / "b")
    up = store.new_upload()
    up.write_bytes(line("a"))
    f = store.add_file("alice", "../../etc/passwd\n", "batch", up)
    assert f.filename == "passwd_"
    assert store.file("bob", f.id) is None and store.files("bob") == []
    assert not store.delete_file("bob", f.id)
    assert store.file("alice", f.id) == f
    for bad in ("../x", "file-" + "0" * 23 + "/", f.id + "/../x"):
        with pytest.raises(ValueError, match="not a file id"):
            store.data_path(bad)
    # Records outlive the daemon.
    assert BatchStore(tmp_path / "b").file("alice", f.id) == f


def test_clean_filename_keeps_the_base_name_only() -> None:
    assert clean_filename("C:\\x\\y.jsonl") == "y.jsonl"
    assert clean_filename("") == "upload.jsonl"
    assert len(clean_filename("a" * 1000)) == 255


# ---- the service over a recording backend ---------------------------------------------

MODELS = """
models:
  - name: tiny
    aliases: [tiny-alias]
    engine: {kind: command, command: [python3, -m, llmgw_slurm.testing.engine]}
    resources: {gpus: 1, partition: service, qos: normal, time_limit: 1h}
"""


class Backend:
    def __init__(self) -> None:
        self.submitted: list[JobSpec] = []
        self.cancelled: list[str] = []
        self.jobs: list[Job] = []
        self.fail_submit = False

    async def submit(self, spec: JobSpec) -> str:
        if self.fail_submit:
            raise SlurmError("sbatch: slurmctld not answering")
        self.submitted.append(spec)
        return str(100 + len(self.submitted))

    async def list_jobs(self, name_prefix: str = "") -> list[Job]:
        return [j for j in self.jobs if j.name.startswith(name_prefix)]

    async def cancel(
        self, job_id: str, *, signal: str | None = None, batch_only: bool = False
    ) -> None:
        self.cancelled.append(job_id)

    def run(self, spec: JobSpec, job_id: str, state: JobState = JobState.RUNNING) -> None:
        self.jobs = [
            Job(
                job_id,
                spec.name,
                state,
                "",
                "batch",
                "u",
                spec.comment,
                (),
                None,
                None,
                None,
                None,
                0,
                (),
            )
        ]


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def svc(tmp_path: Path) -> tuple[BatchService, Backend, Clock]:
    catalog_file = tmp_path / "models.yaml"
    catalog_file.write_text(MODELS)
    catalog = parse_catalog(load_yaml(catalog_file), str(catalog_file))
    server = ServerConfig(
        slurm=SlurmConfig(partition="llm", job_prefix="llmgw."),
        state_dir=tmp_path / "state",
        agent_config=tmp_path / "agent.yaml",
        batch=BatchConfig(partition="preempt", qos="low", max_completion_window=7200),
    )
    backend, clock = Backend(), Clock()
    store = BatchStore(server.batch_directory)
    jobs = BatchJobs(server, b"k" * 32, "http://login:8001", "CERT", python="/usr/bin/python3")
    verifier = ReportVerifier(b"k" * 32)
    service = BatchService(store, server, backend, lambda: catalog, jobs, verifier, clock)  # type: ignore[arg-type]
    return service, backend, clock


def upload(svc: BatchService, owner: str, data: bytes) -> str:
    p = svc.store.new_upload()
    p.write_bytes(data)
    return svc.store.add_file(owner, "in.jsonl", "batch", p).id


async def create(
    svc: BatchService, fid: str, owner: str = "alice", window: str = "1h"
) -> BatchRecord:
    return await svc.create(owner, fid, CHAT, window, {}, KNOWN.get)


async def test_a_valid_batch_is_submitted_in_the_batch_partition_with_secrets_off_argv(
    svc: tuple[BatchService, Backend, Clock],
) -> None:
    s, backend, _ = svc
    fid = upload(s, "alice", line("a") + line("b", "tiny-alias"))
    b = await s.create("alice", fid, CHAT, "1h", {}, KNOWN.get, ("k1", "t18phys"))
    assert (b.status, b.total, b.model, b.job_id) == (BatchStatus.IN_PROGRESS, 2, "tiny", "101")
    (spec,) = backend.submitted
    assert spec.name == "llmgw._batch." + b.id
    assert "#SBATCH --partition=preempt" in spec.script
    assert "#SBATCH --qos=low" in spec.script
    assert "#SBATCH --time=4:00:00" in spec.script
    secret = spec.env["LLMGW_BATCH_SECRET"]
    assert secret == batch_secret(b"k" * 32, b.id)
    assert secret not in spec.script and secret not in spec.comment
    # Whose batch it is, for the audit by user and account (the job runs under the
    # service's own Slurm account).
    assert spec.comment == f"llmgw batch={b.id} model=tiny gpus=1 user=alice account=t18phys"


async def test_a_bad_file_fails_the_batch_and_submits_nothing(
    svc: tuple[BatchService, Backend, Clock],
) -> None:
    s, backend, _ = svc
    b = await create(s, upload(s, "alice", line("a") + line("a")))
    assert b.status is BatchStatus.FAILED and b.failed_at is not None
    assert [(e.code, e.line) for e in b.errors] == [("duplicate_custom_id", 2)]
    assert backend.submitted == []


@pytest.mark.parametrize(
    ("owner", "endpoint", "window", "status"),
    [
        ("bob", CHAT, "1h", 404),
        ("alice", "/v1/images", "1h", 400),
        ("alice", CHAT, "3h", 400),
        ("alice", CHAT, "soon", 400),
    ],
)
async def test_refused_creates_record_nothing(
    svc: tuple[BatchService, Backend, Clock], owner: str, endpoint: str, window: str, status: int
) -> None:
    s, backend, _ = svc
    fid = upload(s, "alice", line("a"))
    with pytest.raises(BatchRefused) as err:
        await s.create(owner, fid, endpoint, window, {}, KNOWN.get)
    assert err.value.status == status
    assert s.store.batches(owner) == [] and backend.submitted == []


def answer(work: Path, name: str, *cids: str) -> None:
    with (work / name).open("ab") as f:
        for c in cids:
            f.write(json.dumps({"custom_id": c, "response": {"status_code": 200}}).encode() + b"\n")


async def test_a_finished_job_with_every_answer_completes_with_files_of_the_owner(
    svc: tuple[BatchService, Backend, Clock],
) -> None:
    s, backend, _ = svc
    b = await create(s, upload(s, "alice", line("a") + line("b") + line("c")))
    backend.run(backend.submitted[0], b.job_id)
    await s.poll()
    assert s.store.batch("alice", b.id).status is BatchStatus.IN_PROGRESS  # type: ignore[union-attr]
    work = s.store.work_dir(b.id)
    answer(work, results.OUTPUT, "a", "b")
    answer(work, results.ERRORS, "c")
    backend.run(backend.submitted[0], b.job_id, JobState.COMPLETED)
    await s.poll()
    done = s.store.batch("alice", b.id)
    assert done is not None and done.status is BatchStatus.COMPLETED
    assert (done.completed, done.failed) == (2, 1)
    assert done.output_file_id and done.error_file_id
    out = s.store.file("alice", done.output_file_id)
    assert out is not None and out.purpose == "batch_output"
    assert s.store.file("bob", done.output_file_id) is None
    assert results.custom_ids(s.store.data_path(done.output_file_id)) == {"a", "b"}


async def test_a_job_that_ends_short_is_resubmitted_then_the_batch_fails(
    svc: tuple[BatchService, Backend, Clock],
) -> None:
    s, backend, _ = svc
    b = await create(s, upload(s, "alice", line("a") + line("b")))
    answer(s.store.work_dir(b.id), results.OUTPUT, "a")
    for n in range(1, MAX_JOBS):
        backend.jobs = []  # gone (time limit): squeue forgot it
        await s.poll()
        assert len(backend.submitted) == n + 1
    backend.jobs = []
    await s.poll()
    failed = s.store.batch("alice", b.id)
    assert failed is not None and failed.status is BatchStatus.FAILED
    assert failed.errors[0].code == "batch_job_failed"
    assert "1 of 2 requests" in failed.errors[0].message


async def test_a_failed_submission_is_tried_again_on_the_next_poll(
    svc: tuple[BatchService, Backend, Clock],
) -> None:
    s, backend, _ = svc
    backend.fail_submit = True
    b = await create(s, upload(s, "alice", line("a")))
    assert b.job_id == "" and "slurmctld" in b.note
    backend.fail_submit = False
    await s.poll()
    assert s.store.batch("alice", b.id).job_id == "101"  # type: ignore[union-attr]


async def test_cancel_cancels_the_job_and_keeps_what_was_done(
    svc: tuple[BatchService, Backend, Clock],
) -> None:
    s, backend, _ = svc
    b = await create(s, upload(s, "alice", line("a") + line("b")))
    backend.run(backend.submitted[0], b.job_id)
    with pytest.raises(BatchRefused) as err:
        await s.cancel("bob", b.id)
    assert err.value.status == 404 and backend.cancelled == []
    c = await s.cancel("alice", b.id)
    assert c.status is BatchStatus.CANCELLING and backend.cancelled == [b.job_id]
    answer(s.store.work_dir(b.id), results.OUTPUT, "a")
    backend.jobs = []
    await s.poll()
    done = s.store.batch("alice", b.id)
    assert done is not None and done.status is BatchStatus.CANCELLED and done.completed == 1
    with pytest.raises(BatchRefused) as again:
        await s.cancel("alice", b.id)
    assert again.value.status == 409


async def test_expiry_cancels_the_job_and_lists_the_requests_not_done(
    svc: tuple[BatchService, Backend, Clock],
) -> None:
    s, backend, clock = svc
    b = await create(s, upload(s, "alice", line("a") + line("b") + line("c")))
    backend.run(backend.submitted[0], b.job_id)
    answer(s.store.work_dir(b.id), results.OUTPUT, "a")
    clock.now = b.expires_at
    await s.poll()
    assert backend.cancelled == [b.job_id]
    backend.jobs = []
    await s.poll()
    done = s.store.batch("alice", b.id)
    assert done is not None and done.status is BatchStatus.EXPIRED
    assert (done.completed, done.failed) == (1, 2)
    assert done.error_file_id is not None
    errs = [json.loads(x) for x in s.store.data_path(done.error_file_id).read_text().splitlines()]
    assert {(e["custom_id"], e["error"]["code"]) for e in errs} == {
        ("b", "batch_expired"),
        ("c", "batch_expired"),
    }


async def test_a_batch_jobs_report_must_be_signed_with_its_own_secret_once(
    svc: tuple[BatchService, Backend, Clock],
) -> None:
    s, _, _ = svc
    b = await create(s, upload(s, "alice", line("a") + line("b")))
    body = {"event": "progress", "job_id": "101", "counts": {"completed": 1, "failed": 0}}
    raw = json.dumps(body).encode()
    other = batch_secret(b"k" * 32, "batch_" + "1" * 24)
    with pytest.raises(PermissionError, match="bad signature"):
        s.report(b.id, sign_report(other, b.id, int(time.time()), raw), raw, body)
    auth = sign_report(batch_secret(b"k" * 32, b.id), b.id, int(time.time()), raw)
    assert s.report(b.id, auth, raw, body) == {"ok": True, "drain": False}
    assert s.store.batch("alice", b.id).completed == 1  # type: ignore[union-attr]
    with pytest.raises(PermissionError, match="replayed"):
        s.report(b.id, auth, raw, body)
    await s.cancel("alice", b.id)
    auth = sign_report(batch_secret(b"k" * 32, b.id), b.id, int(time.time()), raw)
    assert s.report(b.id, auth, raw, body)["drain"] is True


async def test_slurm_not_answering_finishes_nothing(
    svc: tuple[BatchService, Backend, Clock],
) -> None:
    s, backend, _ = svc
    b = await create(s, upload(s, "alice", line("a")))

    async def down(name_prefix: str = "") -> list[Job]:
        raise SlurmError("squeue: timed out")

    backend.list_jobs = down  # type: ignore[method-assign]
    await s.poll()
    assert s.store.batch("alice", b.id).status is BatchStatus.IN_PROGRESS  # type: ignore[union-attr]
    assert "timed out" in s.last_poll_error


# ---- the HTTP routes, hostile clients -------------------------------------------------


async def test_hostile_uploads_get_clear_errors_and_leave_nothing(
    svc: tuple[BatchService, Backend, Clock],
) -> None:
    import aiohttp

    from llmgw_slurm.batch.routes import add_batch_routes
    from llmgw_slurm.router import create_app
    from llmgw_slurm.router.directory import StaticDirectory

    s, _, _ = svc
    app = create_app(StaticDirectory())
    add_batch_routes(app, s)
    files = s.store.root / "files"
    async with serve(app) as url, aiohttp.ClientSession() as http:
        # A 10 GB claim is refused before a byte of it is read.
        head = (
            "POST /v1/files HTTP/1.1\r\nHost: x\r\n"
            "Content-Type: multipart/form-data; boundary=x\r\n"
            f"Content-Length: {10**10}\r\n\r\n--x\r\n"
        ).encode()
        reader, writer = await asyncio.open_connection(*url.removeprefix("http://").split(":"))
        writer.write(head)
        status = await reader.readline()
        writer.close()
        assert status.split()[1] == b"413", status
        form = aiohttp.FormData()
        form.add_field("purpose", "fine-tune")
        form.add_field("file", line("a"), filename="../../x.jsonl")
        async with http.post(url + "/v1/files", data=form) as r:
            assert r.status == 400
            assert "purpose" in (await r.json())["error"]["message"]
        async with http.get(url + "/v1/files/..%2F..%2Fetc%2Fpasswd/content") as r:
            assert r.status == 404
        async with http.post(url + "/v1/batches", data=b"[[[") as r:
            assert r.status == 400
        form = aiohttp.FormData()
        form.add_field("purpose", "batch")
        form.add_field("file", line("a"), filename="../../x.jsonl")
        async with http.post(url + "/v1/files", data=form) as r:
            made = await r.json()
        assert "/" not in made["filename"] and made["bytes"] == len(line("a"))
    assert sorted(p.suffix for p in files.iterdir()) == [".json", ".jsonl"]


async def test_a_job_the_record_does_not_name_is_adopted_not_submitted_again(
    svc: tuple[BatchService, Backend, Clock],
) -> None:
    s, backend, _ = svc
    b = await create(s, upload(s, "alice", line("a")))
    # The daemon died between sbatch and recording the job's id.
    s.store.save(replace(b, job_id="", jobs_submitted=0))
    backend.run(backend.submitted[0], "555")
    await s.poll()
    adopted = s.store.batch("alice", b.id)
    assert adopted is not None and (adopted.job_id, adopted.jobs_submitted) == ("555", 1)
    assert len(backend.submitted) == 1


async def test_a_cancel_while_sbatch_runs_cancels_the_new_job_and_a_poll_submits_nothing(
    svc: tuple[BatchService, Backend, Clock],
) -> None:
    s, backend, _ = svc
    fid = upload(s, "alice", line("a"))
    gate = asyncio.Event()
    submit = backend.submit

    async def slow_submit(spec: JobSpec) -> str:
        await gate.wait()
        return await submit(spec)

    backend.submit = slow_submit  # type: ignore[method-assign]
    creating = asyncio.create_task(create(s, fid))
    while not s.store.batches("alice"):
        await asyncio.sleep(0)
    (b,) = s.store.batches("alice")
    await s.poll()  # sbatch is under way: no second job
    await s.cancel("alice", b.id)
    gate.set()
    await creating
    assert len(backend.submitted) == 1 and backend.cancelled == ["101"]
    backend.jobs = []
    await s.poll()
    done = s.store.batch("alice", b.id)
    assert done is not None and done.status is BatchStatus.CANCELLED


async def test_a_job_submitted_while_a_poll_lists_jobs_is_not_submitted_again(
    svc: tuple[BatchService, Backend, Clock],
) -> None:
    # The poll's listing is taken before the create's sbatch returns, and read
    # after: the new job is not in it, which must not read as a job gone.
    s, backend, _ = svc
    fid = upload(s, "alice", line("a"))
    submitting, listing = asyncio.Event(), asyncio.Event()
    submit, list_jobs = backend.submit, backend.list_jobs

    async def slow_submit(spec: JobSpec) -> str:
        submitting.set()
        await listing.wait()
        return await submit(spec)

    async def slow_list(name_prefix: str = "") -> list[Job]:
        jobs = await list_jobs(name_prefix)
        listing.set()
        await asyncio.sleep(0.05)  # the create's sbatch returns meanwhile
        return jobs

    backend.submit = slow_submit  # type: ignore[method-assign]
    backend.list_jobs = slow_list  # type: ignore[method-assign]
    creating = asyncio.create_task(create(s, fid))
    await submitting.wait()
    polling = asyncio.create_task(s.poll())
    await creating
    await polling
    assert len(backend.submitted) == 1


async def test_a_finished_batch_hands_its_tokens_and_its_key_to_the_usage_store(
    svc: tuple[BatchService, Backend, Clock],
) -> None:
    s, backend, _ = svc
    ended: list[BatchRecord] = []
    s.on_usage = ended.append
    fid = upload(s, "alice", line("a"))
    b = await s.create("alice", fid, CHAT, "1h", {}, KNOWN.get, ("0a0b0c0d", "proj"))
    body = {
        "event": "progress",
        "counts": {"completed": 1, "prompt_tokens": 7, "completion_tokens": 3},
    }
    raw = json.dumps(body).encode()
    s.report(
        b.id, sign_report(batch_secret(b"k" * 32, b.id), b.id, int(time.time()), raw), raw, body
    )
    answer(s.store.work_dir(b.id), results.OUTPUT, "a")
    backend.jobs = []
    await s.poll()
    (done,) = ended
    assert (done.status, done.key_id, done.project) == (BatchStatus.COMPLETED, "0a0b0c0d", "proj")
    assert (done.prompt_tokens, done.completion_tokens) == (7, 3)
    assert done.to_api()["usage"] == {"input_tokens": 7, "output_tokens": 3, "total_tokens": 10}


def test_a_batch_line_for_a_model_the_key_may_not_use_reads_as_unknown() -> None:
    from types import SimpleNamespace

    from llmgw_slurm.auth.keys import KeyRecord
    from llmgw_slurm.batch.routes import allowed_model

    aliases = {"tiny": "tiny", "t": "tiny", "big": "big"}
    ann = KeyRecord("a1", "ann", "p1", "0" * 64, 0.0)
    ben = KeyRecord("b1", "ben", "p1", "1" * 64, 0.0)
    gw = SimpleNamespace(
        directory=SimpleNamespace(resolve=aliases.get),
        may_use=lambda model, key: model != "big" or (key is not None and key.user == "ann"),
    )
    assert allowed_model(gw, ann)("big") == "big"  # type: ignore[arg-type]
    assert allowed_model(gw, ben)("big") is None  # type: ignore[arg-type]
    assert allowed_model(gw, ben)("t") == "tiny"  # type: ignore[arg-type]
    assert allowed_model(gw, ben)("nope") is None  # type: ignore[arg-type]


async def test_a_user_past_the_active_batch_limit_gets_a_429_until_one_ends(
    svc: tuple[BatchService, Backend, Clock],
) -> None:
    import aiohttp

    from llmgw_slurm.batch.routes import add_batch_routes
    from llmgw_slurm.router import create_app
    from llmgw_slurm.router.directory import StaticDirectory

    s, backend, _ = svc
    s.server = replace(s.server, batch=replace(s.server.batch, max_active_per_user=2))
    # A failed batch (a bad file) is final: it does not count.
    assert (await create(s, upload(s, "", b"{"), owner="")).status is BatchStatus.FAILED
    first = await create(s, upload(s, "", line("a")), owner="")
    await create(s, upload(s, "", line("a")), owner="")
    await create(s, upload(s, "bob", line("a")), owner="bob")  # bob's count is his own
    fid = upload(s, "", line("a"))
    app = create_app(StaticDirectory())
    add_batch_routes(app, s)
    ask = {"input_file_id": fid, "endpoint": CHAT, "completion_window": "1h"}
    async with serve(app) as url, aiohttp.ClientSession() as http:
        async with http.post(url + "/v1/batches", json=ask) as r:
            assert r.status == 429
            error = (await r.json())["error"]
        assert error["code"] == "too_many_active_batches"
        assert error["type"] == "rate_limit_error"
        assert "2 unfinished batches" in error["message"]
        assert "max_active_per_user" in error["message"]
        assert len(s.store.batches("")) == 3  # the refused one recorded nothing
    # (Out of the app: its own poll loop must not race this test's poll.)
    answer(s.store.work_dir(first.id), results.OUTPUT, "a")
    backend.jobs = []
    await s.poll()
    assert s.store.batch("", first.id).status is BatchStatus.COMPLETED  # type: ignore[union-attr]
    assert (await create(s, fid, owner="")).status is BatchStatus.IN_PROGRESS


# ---- shards: a job array -------------------------------------------------------------


def task(name: str, job_id: str, array: str, state: JobState) -> Job:
    return Job(job_id, name, state, "", "batch", "u", "", (), None, None, None, None, 0, (), array)


def report(s: BatchService, batch_id: str, counts: dict[str, int]) -> None:
    body = {"event": "progress", "counts": counts}
    raw = json.dumps(body).encode()
    secret = batch_secret(b"k" * 32, batch_id)
    s.report(batch_id, sign_report(secret, batch_id, int(time.time()), raw), raw, body)


async def test_a_sharded_batch_runs_as_one_array_and_ends_with_each_custom_id_once(
    svc: tuple[BatchService, Backend, Clock],
) -> None:
    s, backend, _ = svc
    s.server = replace(s.server, batch=replace(s.server.batch, shard_lines=2, max_shards=2))
    from llmgw_slurm.batch.jobs import shards_for

    # Whole shards of shard_lines, the last shorter; at most max_shards.
    assert [shards_for(s.server, n) for n in (1, 2, 3, 4, 5, 500)] == [1, 1, 2, 2, 2, 2]
    cids = [f"q{i}" for i in range(5)]
    b = await create(s, upload(s, "alice", b"".join(line(c) for c in cids)))
    assert (b.shards, b.job_id) == (2, "101")
    (spec,) = backend.submitted
    assert "#SBATCH --array=0-1" in spec.script
    assert (spec.env["LLMGW_BATCH_SHARDS"], spec.env["LLMGW_BATCH_SHARD_SIZE"]) == ("2", "3")
    # Task 0 running under its own id, task 1 done: the batch runs while one task does.
    backend.jobs = [
        task(spec.name, "102", "101", JobState.RUNNING),
        task(spec.name, "101", "", JobState.COMPLETED),
    ]
    await s.poll()
    now = s.store.get(b.id)
    assert now is not None and now.status is BatchStatus.IN_PROGRESS and now.job_id == "101"
    assert len(backend.submitted) == 1
    # Each shard reports its own counts: the batch's are their sum.
    report(s, b.id, {"completed": 2, "prompt_tokens": 5, "shard": 0})
    report(s, b.id, {"completed": 1, "prompt_tokens": 3, "shard": 1})
    report(s, b.id, {"completed": 3, "prompt_tokens": 7, "shard": 0})
    now = s.store.get(b.id)
    assert now is not None and (now.completed, now.prompt_tokens) == (4, 10)
    work = s.store.work_dir(b.id)
    out, err = work / results.OUTPUT, work / results.ERRORS
    (o0, _), (o1, e1) = results.shard_paths(out, err, 0), results.shard_paths(out, err, 1)
    for path, done in ((o0, ("q0", "q1", "q2")), (o1, ("q3",)), (e1, ("q4",))):
        path.parent.mkdir(exist_ok=True)
        answer(path.parent, path.name, *done)
    backend.jobs = [task(spec.name, j, "101", JobState.COMPLETED) for j in ("101", "102")]
    await s.poll()
    done = s.store.batch("alice", b.id)
    assert done is not None and done.status is BatchStatus.COMPLETED
    assert (done.completed, done.failed) == (4, 1)
    assert done.output_file_id is not None and done.error_file_id is not None
    merged = s.store.data_path(done.output_file_id).read_text().splitlines()
    assert sorted(json.loads(x)["custom_id"] for x in merged) == ["q0", "q1", "q2", "q3"]
    assert results.custom_ids(s.store.data_path(done.error_file_id)) == {"q4"}
    assert not o0.parent.exists() and not o1.parent.exists()


async def test_a_sharded_batch_is_cancelled_whole_and_its_array_adopted_after_a_restart(
    svc: tuple[BatchService, Backend, Clock],
) -> None:
    s, backend, _ = svc
    s.server = replace(s.server, batch=replace(s.server.batch, shard_lines=1))
    b = await create(s, upload(s, "alice", line("a") + line("b") + line("c")))
    (spec,) = backend.submitted
    assert "#SBATCH --array=0-2" in spec.script
    # The daemon died between sbatch and recording the id: the tasks, each listed
    # under its own id, give the array's, and nothing is submitted again.
    s.store.save(replace(b, job_id="", jobs_submitted=0))
    backend.jobs = [
        task(spec.name, "104", "101", JobState.RUNNING),
        task(spec.name, "101", "", JobState.PENDING),
    ]
    await s.poll()
    adopted = s.store.get(b.id)
    assert adopted is not None and (adopted.job_id, adopted.jobs_submitted) == ("101", 1)
    assert len(backend.submitted) == 1
    await s.cancel("alice", b.id)
    assert backend.cancelled == ["101"]  # the array's id: scancel takes every task with it


# ---- quotas: a batch spends its creator's day and month budgets ---------------------


def quota_svc(
    s: BatchService, cfg: QuotaConfig, book: QuotaBook | None = None
) -> tuple[BatchService, QuotaBook]:
    """The fixture's service again over its store, with a quota book (a restart when
    ``book`` is a fresh one over the same store)."""
    book = book or QuotaBook(cfg)
    again = BatchService(
        s.store, s.server, s.backend, s._catalog, s.jobs, s.verifier, s.clock, quota=book
    )
    return again, book


def lines(n: int, max_tokens: int) -> bytes:
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": max_tokens,
    }
    return b"".join(line(f"q{i}", body=body) for i in range(n))


ALICE = KeyRecord("0a0b0c0d", "alice", "proj", "0" * 64, 0.0)


async def create_for_alice(s: BatchService, data: bytes) -> BatchRecord:
    fid = upload(s, "alice", data)
    return await s.create("alice", fid, CHAT, "1h", {}, KNOWN.get, (ALICE.key_id, ALICE.project))


def left(book: QuotaBook) -> int:
    return int(book.headers(ALICE)["x-ratelimit-remaining-tokens"])


async def test_a_batch_past_the_budget_fails_at_once_and_runs_nothing(
    svc: tuple[BatchService, Backend, Clock],
) -> None:
    s, book = quota_svc(svc[0], QuotaConfig(user_tokens_per_day=2000))
    backend = svc[1]
    # Ten lines of 300 at most (and "user hi", 2 tokens): 3,020 against 2,000.
    b = await create_for_alice(s, lines(10, 300))
    assert b.status is BatchStatus.FAILED
    (err,) = b.errors
    assert err.code == "insufficient_quota"
    assert err.message.startswith("The batch's 10 requests may use up to 3020 tokens together")
    assert "tokens per day of user alice" in err.message
    assert backend.submitted == []
    assert left(book) == 2000


async def test_a_batch_holds_its_maximum_until_it_ends_then_settles_what_it_used(
    svc: tuple[BatchService, Backend, Clock],
) -> None:
    s, backend, _ = svc
    s, book = quota_svc(s, QuotaConfig(user_tokens_per_day=2000, tokens_per_minute=100))
    b = await create_for_alice(s, lines(5, 300))  # 5 x 302 = 1,510 held
    assert b.status is BatchStatus.IN_PROGRESS and b.reserved == 1510
    assert left(book) == 100  # the minute's limit is the tightest: batches do not touch it
    # The day has 490 left beside the batch: 600 more do not fit.
    day = book.reserve(ALICE, Ask(0, 600), per_minute=False)
    assert isinstance(day, Refusal) and "tokens per day of user alice" in day.message
    # A second batch that would fit an empty day does not fit beside the first.
    assert (await create_for_alice(s, lines(2, 300))).status is BatchStatus.FAILED
    body = {
        "event": "progress",
        "counts": {"completed": 5, "prompt_tokens": 5, "completion_tokens": 1500},
    }
    raw = json.dumps(body).encode()
    s.report(
        b.id, sign_report(batch_secret(b"k" * 32, b.id), b.id, int(time.time()), raw), raw, body
    )
    answer(s.store.work_dir(b.id), results.OUTPUT, *[f"q{i}" for i in range(5)])
    backend.jobs = []
    await s.poll()
    assert s.store.batch("alice", b.id).status is BatchStatus.COMPLETED  # type: ignore[union-attr]
    got = book.reserve(ALICE, Ask(0, 495), per_minute=False)  # 2,000 - 1,505 used, none held
    assert isinstance(got, Reservation)
    got.release()
    assert isinstance(book.reserve(ALICE, Ask(0, 496), per_minute=False), Refusal)


async def test_a_restarted_daemon_holds_an_unfinished_batchs_reservation_again(
    svc: tuple[BatchService, Backend, Clock],
) -> None:
    s, _, _ = svc
    first, _ = quota_svc(s, QuotaConfig(user_tokens_per_day=2000))
    b = await create_for_alice(first, lines(5, 300))
    again, book = quota_svc(s, QuotaConfig(user_tokens_per_day=2000))  # a fresh book
    assert left(book) == 2000 - 1510
    await again.cancel("alice", b.id)
    again.backend.jobs = []  # type: ignore[attr-defined]
    await again.poll()
    assert again.store.batch("alice", b.id).status is BatchStatus.CANCELLED  # type: ignore[union-attr]
    assert left(book) == 2000  # nothing was reported used


def test_each_lines_maximum_is_summed_as_online_requests_reckon_theirs() -> None:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 7}
    asks = [Ask(2, 7), Ask(2, 4096, own=False)]
    got = check_input([line("a", body=body), line("b")], CHAT, KNOWN.get, 10, lambda _: asks.pop(0))
    assert isinstance(got, Checked) and got.ask == Ask(4, 4103, own=False)


# ---- several clusters ----------------------------------------------------------------------


def two_clusters(tmp_path: Path, room: list[str]) -> tuple[BatchService, Backend, Backend]:
    """A service over clusters a and b; ``room``: where the reconciler says the batch's
    model fits now (its ``clusters_for``), in order."""
    catalog_file = tmp_path / "models.yaml"
    catalog_file.write_text(MODELS)
    catalog = parse_catalog(load_yaml(catalog_file), str(catalog_file))
    server = ServerConfig(
        slurm=SlurmConfig(partition="llm", job_prefix="llmgw."),
        clusters=(ClusterConfig(name="a"), ClusterConfig(name="b", partition="llm-b")),
        state_dir=tmp_path / "state",
        agent_config=tmp_path / "agent.yaml",
    )
    a, b = Backend(), Backend()
    jobs = BatchJobs(server, b"k" * 32, "http://login:8001", "CERT", python="/usr/bin/python3")
    s = BatchService(
        BatchStore(server.batch_directory),
        server,
        {"a": a, "b": b},  # type: ignore[dict-item]
        lambda: catalog,
        jobs,
        ReportVerifier(b"k" * 32),
        Clock(),
        place=lambda _m: room,
    )
    return s, a, b


async def test_a_batch_job_goes_to_the_cluster_with_room_and_is_followed_there(
    tmp_path: Path,
) -> None:
    s, a, b = two_clusters(tmp_path, ["b", "a"])
    batch = await create(s, upload(s, "alice", line("a")))
    assert (batch.job_id, batch.cluster) == ("101", "b")
    assert a.submitted == [] and "#SBATCH --partition=service" in b.submitted[0].script
    # Job ids are per cluster: a's job 101 is not the batch's.
    a.run(replace(b.submitted[0], name="llmgw._batch.other"), "101")
    b.run(b.submitted[0], "101")
    await s.poll()
    await s.cancel("alice", batch.id)
    assert (a.cancelled, b.cancelled) == ([], ["101"])


async def test_a_batch_whose_cluster_does_not_answer_is_left_as_it_is(tmp_path: Path) -> None:
    s, a, b = two_clusters(tmp_path, ["b"])
    batch = await create(s, upload(s, "alice", line("a")))
    b.run(b.submitted[0], "101")

    async def down(name_prefix: str = "") -> list[Job]:
        raise SlurmError("squeue: timed out")

    b.list_jobs = down  # type: ignore[method-assign]
    await s.poll()  # a answers and lists nothing: the batch's job is not gone for that
    got = s.store.batch("alice", batch.id)
    assert got is not None and got.status is BatchStatus.IN_PROGRESS and got.job_id == "101"
    assert len(b.submitted) == 1 and a.submitted == []
    assert s.last_poll_error.startswith("b: ") and "timed out" in s.last_poll_error
