"""The default backend: Slurm's command-line tools, run as argument lists.

Works on every Slurm from 22.05 on. Costs to keep in mind:
- ``squeue -u USER`` is the cheap listing (slurmctld filters by user); any other
  filter is applied client-side after loading every job, and asking per job is
  a call per replica per pass, so the daemon lists once and filters here.
- ``squeue --json`` ignores filters in 22.05; 25.11 applies them, but with 515
  jobs it took 1.41 s and 4.3 MB against 0.086 s and 83 KB for ``--Format``
  and our parser (median of 7, dev cluster): not used.
- Each call forks a process (tens of milliseconds); the reconciler makes two per
  pass (squeue, sinfo) however many replicas it runs.

One backend reaches one cluster: the one its commands find through
``slurm_conf`` (as SLURM_CONF; default the process's own), or, with
``cluster``, the cluster of that name in Slurm's multi-cluster mode (``-M``,
found through slurmdbd). A daemon with several clusters has a backend each.
"""

from __future__ import annotations

import asyncio
import collections
import getpass
import logging
import os
import re
import subprocess
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime

from llmgw_slurm.base.errors import SlurmError, SlurmUnavailable
from llmgw_slurm.base.subprocs import communicate
from llmgw_slurm.slurm import parse
from llmgw_slurm.slurm.types import (
    AccountingRecord,
    Associations,
    Job,
    JobSpec,
    NodeInfo,
    already_gone,
)

log = logging.getLogger(__name__)

# What sbatch --test-only prints (on stderr) when the job could be scheduled.
_WILL_START = re.compile(r"Job \d+ to start at (\S+)")


# Slurm's commands read options from the environment as well as their arguments:
# SQUEUE_PARTITION or SQUEUE_STATES filter the listing (replicas outside it would
# look gone), SCANCEL_SIGNAL turns a cancel into a signal, SBATCH_EXPORT=NONE keeps
# from the job what the daemon passes it, SLURM_TIME_FORMAT rewrites every time.
# A daemon started from an admin's shell must not inherit any of that.
_COMMAND_INPUT_ENV = ("SQUEUE_", "SINFO_", "SACCT_", "SBATCH_", "SCANCEL_", "SCONTROL_")


def command_env(base: Mapping[str, str]) -> dict[str, str]:
    """``base`` without the Slurm commands' input variables, times in ISO format."""
    env = {k: v for k, v in base.items() if not k.startswith(_COMMAND_INPUT_ENV)}
    env["SLURM_TIME_FORMAT"] = "standard"
    return env


def show_hostnames(
    nodelist: str,
    *,
    run: Callable[..., subprocess.CompletedProcess[str]] | None = None,
    timeout: float = 30.0,
) -> list[str]:
    """``scontrol show hostnames NODELIST``: every host of a Slurm host list.

    Synchronous, for the agent (one call per multi-node start); the daemon's
    listings expand host lists in-process (:mod:`llmgw_slurm.slurm.hostlist`).
    Raises SlurmError naming the command when it fails or prints no host.
    """
    argv = ["scontrol", "show", "hostnames", nodelist]
    runner = run or subprocess.run
    try:
        proc = runner(
            argv,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
            env=command_env(os.environ),
        )
    except (OSError, subprocess.TimeoutExpired) as err:
        raise SlurmUnavailable(f"show hostnames {nodelist!r} failed: {err}", command=argv) from err
    if proc.returncode != 0:
        raise SlurmError(
            f"show hostnames {nodelist!r} failed",
            command=argv,
            returncode=proc.returncode,
            stderr=proc.stderr,
        )
    hosts = [h for h in proc.stdout.split() if h]
    if not hosts:
        raise SlurmError(f"show hostnames gave no hosts for {nodelist!r}", command=argv)
    return hosts


class CliBackend:
    """Talks to Slurm through sbatch, squeue, sinfo, scancel, scontrol and sacct."""

    def __init__(
        self,
        *,
        user: str | None = None,
        timeout: float = 30.0,
        bin_dir: str | None = None,
        env: Mapping[str, str] | None = None,
        slurm_conf: str | None = None,
        cluster: str | None = None,
    ) -> None:
        self.user = user or getpass.getuser()
        self.timeout = timeout
        self._bin_dir = bin_dir
        self._env = dict(env) if env is not None else None
        # The cluster's slurm.conf, given to every command as SLURM_CONF; None: the
        # environment's.
        self.slurm_conf = slurm_conf
        # Slurm's ClusterName in multi-cluster mode: every command gets -M with it.
        self.cluster = cluster
        self.call_counts: collections.Counter[str] = collections.Counter()
        self._squeue_cache: dict[str, parse.SqueueCache] = {}

    @property
    def calls(self) -> int:
        return sum(self.call_counts.values())

    async def check(self) -> None:
        """Nothing to check before the first call: a missing command fails that call."""

    async def close(self) -> None:
        """Nothing held open between calls."""

    def _exe(self, name: str) -> str:
        return os.path.join(self._bin_dir, name) if self._bin_dir else name

    async def _run(
        self,
        args: Sequence[str],
        *,
        stdin: str | None = None,
        extra_env: Mapping[str, str] | None = None,
        unset_env: Sequence[str] = (),
        timeout: float | None = None,
    ) -> str:
        out, _ = await self._run_both(
            args, stdin=stdin, extra_env=extra_env, unset_env=unset_env, timeout=timeout
        )
        return out

    def _argv(self, args: Sequence[str]) -> list[str]:
        """The command line: the cluster's -M right after the command (sacctmgr has none)."""
        argv = [self._exe(args[0])]
        if self.cluster and args[0] != "sacctmgr":
            argv.append(f"--clusters={self.cluster}")
        return [*argv, *args[1:]]

    async def _run_both(
        self,
        args: Sequence[str],
        *,
        stdin: str | None = None,
        extra_env: Mapping[str, str] | None = None,
        unset_env: Sequence[str] = (),
        timeout: float | None = None,
    ) -> tuple[str, str]:
        """Run a command; its stdout and stderr. Raises SlurmError on a non-zero exit."""
        argv = self._argv(args)
        env = command_env(self._env if self._env is not None else os.environ)
        if self.slurm_conf:
            # After command_env, and before the job's own: the cluster is the backend's.
            env["SLURM_CONF"] = self.slurm_conf
        for name in unset_env:
            env.pop(name, None)
        if extra_env:
            env.update(extra_env)
        self.call_counts[args[0]] += 1
        limit = self.timeout if timeout is None else timeout
        try:
            proc = await asyncio.create_subprocess_exec(
                *argv,
                stdin=asyncio.subprocess.PIPE if stdin is not None else asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                env=env,
            )
        except FileNotFoundError as exc:
            raise SlurmUnavailable(
                "command not found; is Slurm's client installed and on PATH?", command=argv
            ) from exc
        except PermissionError as exc:
            raise SlurmUnavailable(f"cannot run: {exc}", command=argv) from exc
        except OSError as exc:
            # EMFILE, ENOMEM, EAGAIN: the daemon (or the host) is out of something
            # for now; the pass fails as when slurmctld does not answer, and backs off.
            raise SlurmUnavailable(f"cannot start the command: {exc}", command=argv) from exc
        try:
            out, err = await asyncio.wait_for(
                communicate(proc, stdin.encode() if stdin is not None else None), limit
            )
        except TimeoutError as exc:
            proc.kill()
            await proc.wait()
            raise SlurmUnavailable(
                f"no answer within {limit:g}s (is slurmctld up?)", command=argv
            ) from exc
        except asyncio.CancelledError:
            # The caller gave up; do not leave the child behind, nor its
            # transport to be closed when collected, perhaps after the loop is.
            if proc.returncode is None:
                proc.kill()
                await asyncio.shield(proc.wait())
            raise
        stdout = out.decode(errors="replace")
        stderr = err.decode(errors="replace")
        if proc.returncode != 0:
            raise SlurmError("failed", command=argv, returncode=proc.returncode, stderr=stderr)
        return stdout, stderr

    async def submit(self, spec: JobSpec) -> str:
        args = ["sbatch", "--parsable", f"--job-name={spec.name}"]
        if spec.comment:
            args.append(f"--comment={spec.comment}")
        if spec.workdir:
            args.append(f"--chdir={spec.workdir}")
        # The script goes on stdin: no temporary file, and nothing of it on argv.
        out = await self._run(args, stdin=spec.script, extra_env=spec.env, unset_env=spec.unset_env)
        try:
            return parse.parse_sbatch(out)
        except SlurmError as exc:
            exc.command = args
            raise

    async def will_start(self, spec: JobSpec) -> datetime:
        """When Slurm expects ``spec`` to start here (``sbatch --test-only``: nothing is
        submitted). Raises SlurmError when the cluster could never run it (no such
        partition, GPU type or node configuration) or does not answer."""
        args = ["sbatch", "--test-only", f"--job-name={spec.name}"]
        _, err = await self._run_both(
            args, stdin=spec.script, extra_env=spec.env, unset_env=spec.unset_env
        )
        m = _WILL_START.search(err)
        if m is None:
            raise SlurmError(f"no start time in {err.strip()[:200]!r}", command=args)
        try:
            # SLURM_TIME_FORMAT=standard (command_env): local time, ISO 8601.
            return datetime.fromisoformat(m.group(1))
        except ValueError:
            raise SlurmError(f"cannot read the start time {m.group(1)!r}", command=args) from None

    async def list_jobs(self, name_prefix: str = "") -> list[Job]:
        out = await self._run(
            [
                "squeue",
                "--noheader",
                f"--user={self.user}",
                # Finished jobs too, while slurmctld keeps them (MinJobAge): a replica
                # that ended is reaped with its real final state, without asking sacct.
                "--states=all",
                "--Format=" + parse.format_arg(parse.SQUEUE_FIELDS),
            ]
        )
        # The row cache is per prefix: a listing for another prefix must not evict it.
        cache = self._squeue_cache.setdefault(name_prefix, parse.SqueueCache())
        return parse.parse_squeue(out, name_prefix, cache)

    async def list_nodes(self) -> list[NodeInfo]:
        out = await self._run(
            ["sinfo", "--noheader", "--Node", "--Format=" + parse.format_arg(parse.SINFO_FIELDS)]
        )
        return parse.parse_sinfo(out)

    async def cancel(
        self, job_id: str, *, signal: str | None = None, batch_only: bool = False
    ) -> None:
        args = ["scancel"]
        if signal:
            args.append(f"--signal={signal}")
        if batch_only:
            args.append("--batch")
        args.append(job_id)
        try:
            await self._run(args)
        except SlurmUnavailable:
            raise
        except SlurmError as exc:
            if already_gone(job_id, exc.stderr):
                return
            raise

    async def requeue(self, job_id: str) -> None:
        await self._run(["scontrol", "requeue", job_id])

    async def accounting(
        self,
        start: datetime,
        end: datetime | None = None,
        name_prefix: str = "",
        all_users: bool = False,
        duplicates: bool = False,
    ) -> list[AccountingRecord]:
        args = [
            "sacct",
            "--allocations",
            "--parsable2",
            "--noheader",
            f"--delimiter={parse.SEP}",
            "--format=" + ",".join(parse.SACCT_FIELDS),
            f"--starttime={start.strftime('%Y-%m-%dT%H:%M:%S')}",
            f"--endtime={(end or datetime.now()).strftime('%Y-%m-%dT%H:%M:%S')}",
        ]
        args.append("--allusers" if all_users else f"--user={self.user}")
        if duplicates:
            args.append("--duplicates")
        # --parsable2 with a custom delimiter leaves no trailing one; add it so the
        # shared splitter sees the same shape as squeue's.
        out = await self._run(args)
        recs = parse.parse_sacct("\n".join(ln + parse.SEP for ln in out.splitlines() if ln))
        if name_prefix:
            recs = [r for r in recs if r.name.startswith(name_prefix)]
        return recs

    async def associations(self, user: str) -> Associations:
        """The Slurm accounts ``user`` has an association with in slurmdbd, and the default.

        Two sacctmgr calls (tens of milliseconds each): once per `llmgw login`.
        """
        accounts = await self._run(
            [
                "sacctmgr",
                "--noheader",
                "--parsable2",
                "show",
                "associations",
                "where",
                f"users={user}",
                "format=account",
            ]
        )
        default = await self._run(
            ["sacctmgr", "--noheader", "--parsable2", "show", "user", user, "format=defaultaccount"]
        )
        return Associations(
            user=user,
            accounts=frozenset(ln.strip() for ln in accounts.splitlines() if ln.strip()),
            default=next((ln.strip() for ln in default.splitlines() if ln.strip()), ""),
        )
