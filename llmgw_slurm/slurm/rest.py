"""The backend on Slurm's REST API (slurmrestd), for a service outside the cluster.

Same interface as :class:`~llmgw_slurm.slurm.cli.CliBackend`; select it with
``slurm.backend: rest`` and ``slurm.rest:`` (docs/slurm-backends.md). It needs
no Slurm commands, configuration, munge or pyslurm on the service's host:
only HTTP to slurmrestd and a JWT (:mod:`llmgw_slurm.slurm.rest_auth`).

- One OpenAPI version, chosen in the config and checked against the server
  (:meth:`RestBackend.check`): Slurm keeps each for three releases
  (v0.0.42 in 24.11-26.11, v0.0.43 in 25.05-27.05, v0.0.44 in 25.11-27.11),
  which is the contract a long-lived service wants. A server without it is
  told apart from one that is down, and the error lists what it offers.
- The listing is ``GET /jobs/``, which has no user filter: slurmctld sends
  every job it holds, like pyslurm's ``Jobs.load``, as JSON (about 5 KB a
  job). The backend asks with ``update_time`` set to the last listing's
  stamp, as ``squeue -i`` does, and slurmctld then answers "no change" in a
  few hundred bytes when no job on the cluster changed; the previous listing
  stands, and the Job objects of jobs whose fields did not change are the
  same objects (the reconciler's fast path, as the CLI's row cache).
- HTTP through httpx2 (h11), not aiohttp: slurmrestd 25.11 writes each error
  reply twice on a connection it then closes (``HTTP/1.1 511 ... Connection:
  Close``, the JSON, then a second plain-text reply). aiohttp's parser
  (llhttp) refuses the whole answer ("Data after Connection: close") and the
  status and the error's words are lost; h11 reads the first reply by its
  Content-Length and the connection is closed. One client per event loop,
  connections kept alive between calls, a timeout on every call.
- No request is retried blindly: a submission that got no answer may or may
  not have made a job, so it is an error and the next listing decides (the
  daemon adopts a replica's job by its name). Reads and cancels are retried
  once on a kept-alive connection the server had closed.
- A refused token gets one more try only with a different token (a file
  rewritten, a key rotated), and is then held back (rest_auth), so a daemon
  with a bad token sends a few requests a minute, not a storm.
- No requeue: slurmrestd has no call for it (v0.0.44); :meth:`requeue`
  says so. The daemon never requeues.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import getpass
import json
import logging
import os
import re
import ssl
import time
from collections.abc import Mapping
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx2

from llmgw_slurm.base.errors import ConfigError, SlurmError, SlurmParseError, SlurmUnavailable
from llmgw_slurm.slurm import directives, rest_parse, rest_submit
from llmgw_slurm.slurm.rest_auth import SigningKey, Token, TokenFile, TokenSource
from llmgw_slurm.slurm.types import AccountingRecord, Job, JobSpec, NodeInfo, already_gone

log = logging.getLogger(__name__)

# The OpenAPI versions this backend speaks; the fields it reads are the same in each.
VERSIONS = ("v0.0.42", "v0.0.43", "v0.0.44")
DEFAULT_VERSION = "v0.0.44"

# slurmctld could not be reached (slurmrestd answers, Slurm does not).
_UNREACHABLE = re.compile(r"Unable to contact|connect|timed? ?out|Socket", re.I)
_AUTH_CODE = 1007  # "Protocol authentication error": slurmctld refused the token
_NO_CHANGE = "No job changes since"
# Above this many bytes an answer is decoded in a worker thread: a 2,000-job
# listing is about 10 MB of JSON, some 100 ms of parsing that would otherwise
# hold up every request the gateway is serving.
_DECODE_IN_THREAD = 1 << 20


class _VersionMissing(SlurmUnavailable):
    """slurmrestd answers, but not in the configured OpenAPI version."""


class _Http:
    """One HTTP client with kept-alive connections, on the loop that made it.

    The client lives as long as that loop: a task waits for the loop's end and
    closes the client then (asyncio.run cancels every task before it closes its
    loop), so a command that calls asyncio.run twice gets a client each time and
    leaks no connection.
    """

    def __init__(self, timeout: float, tls: ssl.SSLContext | None) -> None:
        self.loop = asyncio.get_running_loop()
        self.client = httpx2.AsyncClient(
            verify=tls or True,
            timeout=httpx2.Timeout(timeout, connect=min(timeout, 10.0)),
            limits=httpx2.Limits(max_connections=8, keepalive_expiry=15.0),
            # A proxy from the environment (an admin's http_proxy) would see every token.
            trust_env=False,
        )
        self.closed = False
        self._keeper = self.loop.create_task(self._keep())

    async def _keep(self) -> None:
        try:
            await asyncio.Future()
        finally:
            self.closed = True
            await self.client.aclose()

    async def close(self) -> None:
        self._keeper.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._keeper


class RestBackend:
    """Talks to Slurm through slurmrestd, authenticated with JWTs."""

    def __init__(
        self,
        *,
        url: str,
        version: str = DEFAULT_VERSION,
        token_file: str | Path | None = None,
        jwt_key: str | Path | None = None,
        user: str | None = None,
        token_lifespan: float = 3600.0,
        timeout: float = 30.0,
        ca_file: str | Path | None = None,
        env: Mapping[str, str] | None = None,
        workdir: str | None = None,
        tokens: TokenSource | None = None,
        incremental: bool = True,
    ) -> None:
        """``tokens`` stands in for the token source in tests; ``env`` is the
        environment jobs inherit (default the daemon's, as sbatch's --export=ALL);
        ``incremental`` False asks for every job at every listing (benchmarks)."""
        self.url = _check_url(url)
        if version not in VERSIONS:
            raise ConfigError(
                f"OpenAPI version {version!r} is not one this backend speaks; valid: "
                f"{', '.join(VERSIONS)}",
                field="slurm.rest.version",
            )
        self.version = version
        self._tokens = tokens or _token_source(token_file, jwt_key, user, token_lifespan)
        self.user = self._tokens.user
        self.timeout = timeout
        self._tls = ssl.create_default_context(cafile=str(ca_file)) if ca_file else None
        self._env = dict(env) if env is not None else None
        self._workdir = workdir or os.getcwd()
        self._http: _Http | None = None
        self.call_counts: collections.Counter[str] = collections.Counter()
        self._version_ok = False
        self.cluster = ""  # slurmrestd's ClusterName, from the version check
        self.release = ""  # its Slurm release, for messages
        # The last full listing: its records and slurmctld's stamp (for update_time).
        self._records: list[Mapping[str, Any]] = []
        self._listed_at: int | None = None
        # Per name prefix: job key -> (what its Job was made of, the Job).
        self._jobs: dict[str, dict[str, tuple[tuple[Any, ...], Job]]] = {}
        self._incremental = incremental

    @property
    def calls(self) -> int:
        return sum(self.call_counts.values())

    # ------------------------------------------------------------------ HTTP

    def _client(self) -> httpx2.AsyncClient:
        loop = asyncio.get_running_loop()
        if self._http is None or self._http.loop is not loop or self._http.closed:
            self._http = _Http(self.timeout, self._tls)
        return self._http.client

    async def close(self) -> None:
        """Close the kept-alive connections (the daemon's stop)."""
        if self._http is not None and self._http.loop is asyncio.get_running_loop():
            await self._http.close()
        self._http = None

    async def _send(
        self, method: str, path: str, token: Token, params: Mapping[str, str], body: Any, once: bool
    ) -> tuple[int, bytes]:
        """One request; (status, body). Retried once (``once`` False) when a kept-alive
        connection turns out to have been closed by the server."""
        headers = {"X-SLURM-USER-TOKEN": token.text, "Accept": "application/json"}
        self.call_counts[f"{method} {_endpoint(path)}"] += 1
        try:
            resp = await self._client().request(
                method, self.url + path, params=params, json=body, headers=headers
            )
        except httpx2.RemoteProtocolError:
            if once:
                raise
            return await self._send(method, path, token, params, body, True)
        return resp.status_code, resp.content

    async def _request(
        self,
        method: str,
        path: str,
        params: Mapping[str, str] | None = None,
        body: Any = None,
        *,
        retry: bool = True,
    ) -> dict[str, Any]:
        """The decoded answer of one call; SlurmError (or SlurmUnavailable) for any failure."""
        await self._ensure_version()
        return await self._call(method, path, params or {}, body, retry=retry)

    async def _call(
        self, method: str, path: str, params: Mapping[str, str], body: Any, *, retry: bool
    ) -> dict[str, Any]:
        what = [f"slurmrestd {method} {path}"]
        token: Token | None = self._tokens.current()
        tried: Token | None = None
        while token is not None:
            try:
                status, raw = await self._send(method, path, token, params, body, not retry)
            except (httpx2.HTTPError, OSError) as exc:
                raise SlurmUnavailable(
                    f"{self.url} did not answer: {_describe(exc)}"
                    + ("; the job may or may not exist: the next listing shows" if body else ""),
                    command=what,
                ) from None
            payload = await _decode(raw)
            if not _auth_refused(status, payload):
                return self._checked(status, raw, payload, what)
            # Once more only with another token: the same one would be refused again.
            tried, token = token, (self._tokens.refused(token) if tried is None else None)
        assert tried is not None
        raise self._refused(tried, status, payload, what)

    def _checked(
        self, status: int, raw: bytes, payload: dict[str, Any] | None, what: list[str]
    ) -> dict[str, Any]:
        if status == 404 and payload is None:
            # Not ours to answer: the version went away (a server downgraded), or a
            # plugin is not loaded. Check again before the next call says which.
            self._version_ok = False
            raise SlurmUnavailable(
                f"{self.url} has no such endpoint (HTTP 404): {_snippet(raw)}", command=what
            )
        if payload is None:
            raise SlurmParseError(
                f"HTTP {status}, not JSON: {_snippet(raw)}", command=what, returncode=status
            )
        errors = [e for e in payload.get("errors") or () if isinstance(e, Mapping)]
        if errors or status >= 400:
            message = "; ".join(_error_text(e) for e in errors) or f"HTTP {status}"
            kind = (
                SlurmUnavailable if status >= 500 and _UNREACHABLE.search(message) else SlurmError
            )
            raise kind(message, command=what, returncode=status)
        return payload

    def _refused(
        self, token: Token, status: int, payload: dict[str, Any] | None, what: list[str]
    ) -> SlurmUnavailable:
        detail = "; ".join(_error_text(e) for e in (payload or {}).get("errors") or ())
        expired = token.expired(time.time())
        message = (
            f"token refused (HTTP {status}{': ' + detail if detail else ''}): {token.where} "
            f"for user {token.user}"
            + (" has expired" if expired else "")
            + "; the next calls wait for a new token rather than send this one again"
        )
        log.error("slurmrestd %s: %s", self.url, message)
        return SlurmUnavailable(message, command=what, returncode=status)

    # ------------------------------------------------------------ the version

    async def check(self) -> None:
        """At start: the server offers the configured version (ConfigError naming what
        it does offer when not), and takes the token (SlurmUnavailable when not, or
        when it does not answer: the passes try again)."""
        try:
            await self._ensure_version()
        except _VersionMissing as exc:
            raise ConfigError(exc.message, field="slurm.rest.version") from None
        await self._call("GET", f"/slurm/{self.version}/licenses/", {}, None, retry=True)

    async def _ensure_version(self) -> None:
        if self._version_ok:
            return
        path = f"/slurm/{self.version}/ping/"
        token = self._tokens.current()
        try:
            status, raw = await self._send("GET", path, token, {}, None, False)
        except (httpx2.HTTPError, OSError) as exc:
            raise SlurmUnavailable(
                f"{self.url} did not answer: {_describe(exc)}", command=[f"slurmrestd GET {path}"]
            ) from None
        if status == 404:
            raise _VersionMissing(await self._offers(token), command=[f"slurmrestd GET {path}"])
        payload = self._checked(status, raw, await _decode(raw), [f"slurmrestd GET {path}"])
        slurm = (payload.get("meta") or {}).get("slurm") or {}
        self.cluster = str(slurm.get("cluster") or "")
        self.release = str(slurm.get("release") or "")
        self._version_ok = True
        log.info(
            "slurmrestd %s: Slurm %s, cluster %s, OpenAPI %s, as user %s",
            self.url,
            self.release or "?",
            self.cluster or "?",
            self.version,
            self.user,
        )

    async def _offers(self, token: Token) -> str:
        """Why the version is missing, naming the versions the server offers."""
        try:
            status, raw = await self._send("GET", "/openapi/v3", token, {}, None, False)
            spec = await _decode(raw) if status == 200 else None
        except (httpx2.HTTPError, OSError):
            spec = None
        paths = (spec or {}).get("paths") or {}
        offered = sorted({m.group(1) for p in paths if (m := re.match(r"/slurm/(v[\d.]+)/", p))})
        common = [v for v in offered if v in VERSIONS]
        return (
            f"slurmrestd at {self.url} does not offer OpenAPI {self.version}; it offers "
            f"{', '.join(offered) or 'no version it would name'}"
            + (f"; set slurm.rest.version to {common[-1]}" if common else "")
            + f" (this release speaks {', '.join(VERSIONS)})"
        )

    # ------------------------------------------------------------- the calls

    async def submit(self, spec: JobSpec) -> str:
        base_env = self._env if self._env is not None else dict(os.environ)
        body = rest_submit.submit_body(spec, base_env, self._workdir)
        # Never retried: a lost answer may hide a job that exists (see the module's doc).
        payload = await self._request(
            "POST", f"/slurm/{self.version}/job/submit", body=body, retry=False
        )
        job_id = rest_parse.number(payload.get("job_id"))
        if job_id is None:
            raise SlurmParseError(
                f"submitted, but the answer holds no job id: {payload.get('job_id')!r}",
                command=["slurmrestd job/submit"],
            )
        return str(job_id)

    async def list_jobs(self, name_prefix: str = "") -> list[Job]:
        records = await self._job_records()
        cache = self._jobs.setdefault(name_prefix, {})
        fresh: dict[str, tuple[tuple[Any, ...], Job]] = {}
        jobs: list[Job] = []
        for key, members in rest_parse.group_jobs(records, self.user, name_prefix).items():
            printed = rest_parse.fingerprint(members)
            known = cache.get(key)
            try:
                job = known[1] if known and known[0] == printed else _job(key, members)
            except SlurmParseError as exc:
                if name_prefix:
                    # One of the service's own jobs: skipping it would look like its end.
                    raise
                log.warning("slurmrestd: skipping job %s: %s", key, exc)
                continue
            fresh[key] = (printed, job)
            jobs.append(job)
        self._jobs[name_prefix] = fresh
        return jobs

    async def _job_records(self) -> list[Mapping[str, Any]]:
        """Every job slurmctld holds; the last listing again when it says none changed."""
        params = {"flags": "ALL"}
        if self._listed_at is not None and self._incremental:
            params["update_time"] = str(self._listed_at)
        payload = await self._request("GET", f"/slurm/{self.version}/jobs/", params)
        records = payload.get("jobs")
        unchanged = any(
            _NO_CHANGE in str(w.get("description", ""))
            for w in payload.get("warnings") or ()
            if isinstance(w, Mapping)
        )
        if unchanged and not records and self._listed_at is not None:
            return self._records
        if not isinstance(records, list):
            raise SlurmParseError("the job listing holds no jobs list", command=["slurmrestd"])
        self._records = records
        self._listed_at = rest_parse.number(payload.get("last_update"))
        return records

    async def list_nodes(self) -> list[NodeInfo]:
        payload = await self._request("GET", f"/slurm/{self.version}/nodes/")
        nodes = payload.get("nodes")
        if not isinstance(nodes, list):
            raise SlurmParseError("the node listing holds no nodes list", command=["slurmrestd"])
        return rest_parse.nodes_from_rest(nodes)

    async def cancel(
        self, job_id: str, *, signal: str | None = None, batch_only: bool = False
    ) -> None:
        if not job_id.strip().isdigit():
            raise SlurmError(f"not a plain job id: {job_id!r}", command=["slurmrestd cancel"])
        params: dict[str, str] = {}
        if signal:
            # scancel --signal reaches the steps, with --batch the batch shell only.
            params["signal"] = str(directives.signal_number(signal))
            params["flags"] = "BATCH_JOB" if batch_only else "FULL_STEPS_ONLY"
        elif batch_only:
            params["flags"] = "BATCH_JOB"
        payload = await self._request("DELETE", f"/slurm/{self.version}/job/{job_id}", params)
        for item in payload.get("status") or ():
            err = item.get("error") or {}
            code = rest_parse.number(err.get("code")) or 0
            if not code:
                continue
            text = str(err.get("message") or err.get("string") or code)
            if already_gone(job_id, text, code):
                continue
            raise SlurmError(text, command=[f"slurmrestd cancel {job_id}"])

    async def requeue(self, job_id: str) -> None:
        raise SlurmError(
            f"slurmrestd has no requeue call (OpenAPI {self.version}): requeue job {job_id} "
            "with `scontrol requeue` on a host with Slurm's commands",
            command=["slurmrestd requeue"],
        )

    async def accounting(
        self,
        start: datetime,
        end: datetime | None = None,
        name_prefix: str = "",
        all_users: bool = False,
        duplicates: bool = False,
    ) -> list[AccountingRecord]:
        params = {
            "start_time": str(int(start.timestamp())),
            "end_time": str(int((end or datetime.now()).timestamp())),
            # Allocations only, as sacct --allocations: steps are most of the answer.
            "skip_steps": "true",
        }
        if not all_users:
            params["users"] = self.user
        if duplicates:
            params["show_duplicates"] = "true"
        if self.cluster:
            params["cluster"] = self.cluster
        payload = await self._request("GET", f"/slurmdb/{self.version}/jobs/", params)
        jobs = payload.get("jobs")
        if not isinstance(jobs, list):
            raise SlurmParseError("the accounting answer holds no jobs", command=["slurmrestd"])
        return rest_parse.accounting_records(jobs, name_prefix)


def _job(key: str, members: list[Mapping[str, Any]]) -> Job:
    try:
        return rest_parse.job_from_components(key, members)
    except (KeyError, TypeError, ValueError) as exc:
        raise SlurmParseError(f"cannot read job {key}: {exc}", command=["slurmrestd"]) from exc


def _token_source(
    token_file: str | Path | None, jwt_key: str | Path | None, user: str | None, lifespan: float
) -> TokenSource:
    if (token_file is None) == (jwt_key is None):
        raise ConfigError(
            "set one of token_file (a JWT renewed by the site: scontrol token) or jwt_key "
            "(auth/jwt's key; the daemon mints its own tokens)",
            field="slurm.rest",
        )
    if token_file is not None:
        return TokenFile(Path(token_file), user=user)
    assert jwt_key is not None
    return SigningKey(Path(jwt_key), user=user or getpass.getuser(), lifespan=lifespan)


def _check_url(url: str) -> str:
    text = url.strip().rstrip("/")
    if not re.fullmatch(r"https?://[^\s/]+", text):
        raise ConfigError(
            f"{url!r} is not slurmrestd's address; expected http(s)://HOST:PORT",
            field="slurm.rest.url",
        )
    return text


async def _decode(raw: bytes) -> dict[str, Any] | None:
    """The JSON object in ``raw``, or None when it is not one (slurmrestd answers some
    errors in plain text)."""
    try:
        if len(raw) > _DECODE_IN_THREAD:
            data = await asyncio.to_thread(json.loads, raw)
        else:
            data = json.loads(raw)
    except (ValueError, RecursionError):
        return None
    return data if isinstance(data, dict) else None


def _auth_refused(status: int, payload: dict[str, Any] | None) -> bool:
    """slurmrestd (401/403) or slurmctld (511, "Protocol authentication error") refused it."""
    if status in (401, 403):
        return True
    errors = (payload or {}).get("errors") or ()
    return any(isinstance(e, Mapping) and e.get("error_number") == _AUTH_CODE for e in errors)


def _error_text(e: Mapping[str, Any]) -> str:
    parts = [str(e.get(k)) for k in ("description", "error") if e.get(k)]
    return ": ".join(dict.fromkeys(parts)) or str(e.get("error_number", "error"))


def _endpoint(path: str) -> str:
    """``/slurm/v0.0.44/job/123`` -> ``job``: per-call counts without ids in them."""
    parts = [p for p in path.split("/") if p]
    return parts[2] if len(parts) > 2 else path


def _snippet(raw: bytes) -> str:
    return raw[:200].decode(errors="replace").strip() or "(empty)"


def _describe(exc: BaseException) -> str:
    if isinstance(exc, httpx2.TimeoutException | TimeoutError):
        return "timed out"
    return str(exc) or type(exc).__name__
