"""Engine installs inside their job (llmgw_slurm/agent/install.py): steps, traces, markers.

The interpreter a venv is built from and ``apptainer`` are stubs that record
their argv and do the least the real ones do (a venv's bin/python, an image
file); anything else they are asked fails.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanContext, StatusCode, TraceFlags

from llmgw_slurm.agent.errors import AgentError
from llmgw_slurm.agent.install import (
    InstallRequest,
    install_engine,
    install_marker_for,
    marker_path,
)
from llmgw_slurm.tracing.otel import read_trace_marker, traceparent_of, write_trace_marker

STUB = """#!{python}
import json, os, sys
args = sys.argv[1:]
with open({log!r}, "a") as f:
    f.write(json.dumps([os.path.basename(sys.argv[0]), *args]) + "\\n")
if args[:2] == ["-m", "venv"]:
    target = args[-1]
    os.makedirs(os.path.join(target, "bin"))
    os.symlink(os.path.abspath(sys.argv[0]), os.path.join(target, "bin", "python"))
elif args[:3] == ["-m", "pip", "install"]:
    sys.exit(7 if "broken==1" in args else 0)
elif args[:3] == ["-m", "pip", "freeze"]:
    print("vllm==0.6.3")
elif args[:1] == ["pull"]:
    open(args[-2], "w").write("image")
else:
    sys.exit("stub: unknown call " + repr(args))
"""


class World:
    def __init__(self, tmp_path: Path) -> None:
        self.tmp = tmp_path
        self.log = tmp_path / "argv.jsonl"
        self.log.touch()
        for name in ("python", "apptainer"):
            stub = tmp_path / "bin" / name
            stub.parent.mkdir(exist_ok=True)
            stub.write_text(STUB.format(python=sys.executable, log=str(self.log)))
            stub.chmod(0o755)
        self.exporter = InMemorySpanExporter()
        self.provider = TracerProvider()
        self.provider.add_span_processor(SimpleSpanProcessor(self.exporter))

    def venv(self, **kw: object) -> InstallRequest:
        return InstallRequest(
            "venv", self.tmp / "engines" / "vllm", python=str(self.tmp / "bin" / "python"), **kw
        )  # type: ignore[arg-type]

    def image(self) -> InstallRequest:
        return InstallRequest(
            "apptainer",
            self.tmp / "engines" / "vllm.sif",
            image_uri="docker://vllm/vllm-openai:v0.6.3",
            apptainer=str(self.tmp / "bin" / "apptainer"),
        )

    def install(self, req: InstallRequest) -> bool:
        return install_engine(req, self.provider.get_tracer("t")).installed

    def calls(self) -> list[list[str]]:
        return [json.loads(line) for line in self.log.read_text().splitlines()]

    def spans(self) -> dict[str, ReadableSpan]:
        return {s.name: s for s in self.exporter.get_finished_spans()}


@pytest.fixture
def w(tmp_path: Path) -> World:
    return World(tmp_path)


def test_venv_install_is_a_trace_with_a_span_per_step_and_leaves_its_marker(w: World) -> None:
    req = w.venv(packages=("vllm==0.6.3",), pip_args=("--index-url", "http://mirror.invalid/"))
    assert w.install(req)
    assert [c[1:] for c in w.calls()] == [
        ["-m", "venv", "--", str(req.target)],
        ["-m", "pip", "install", "--index-url", "http://mirror.invalid/", "--", "vllm==0.6.3"],
        ["-m", "pip", "freeze"],
    ]
    assert (req.target / ".llmgw-installed").read_text() == "vllm==0.6.3\n"
    spans = w.spans()
    root = spans["llmgw.engine_install"]
    assert set(spans) == {
        "llmgw.engine_install",
        "llmgw.engine_install.lock",
        "llmgw.engine_install.venv",
        "llmgw.engine_install.pip",
        "llmgw.engine_install.mark",
    }
    for name, span in spans.items():
        if span is not root:
            assert span.parent is not None and span.parent.span_id == root.context.span_id, name
    assert root.attributes is not None and root.attributes["llmgw.install.installed"] is True
    marker = read_trace_marker(marker_path(req.target))
    assert marker is not None and marker.span_id == root.context.span_id
    # The replica side finds it from the engine's interpreter in the venv.
    assert install_marker_for(str(req.target / "bin" / "python")) == marker_path(req.target)


def test_a_complete_venv_is_not_installed_again(w: World) -> None:
    req = w.venv(packages=("vllm==0.6.3",), system_site_packages=True)
    assert w.install(req)
    first_marker = marker_path(req.target).read_text()
    w.log.write_text("")
    w.exporter.clear()
    assert not w.install(req)
    assert w.calls() == []
    assert set(w.spans()) == {"llmgw.engine_install", "llmgw.engine_install.lock"}
    # The marker still names the trace that installed it.
    assert marker_path(req.target).read_text() == first_marker


def test_an_interrupted_venv_is_rebuilt(w: World) -> None:
    req = w.venv()
    (req.target / "bin").mkdir(parents=True)
    (req.target / "half-written").write_text("x")
    assert w.install(req)
    assert not (req.target / "half-written").exists()
    assert (req.target / ".llmgw-installed").exists()


def test_a_failed_pip_fails_the_install_marks_nothing_and_says_why(w: World) -> None:
    req = w.venv(packages=("broken==1",))
    with pytest.raises(AgentError, match=r"pip install failed \(exit 7\)"):
        w.install(req)
    assert not (req.target / ".llmgw-installed").exists()
    assert not marker_path(req.target).exists()
    root = w.spans()["llmgw.engine_install"]
    assert root.status.status_code is StatusCode.ERROR


def test_a_missing_interpreter_is_a_clear_error(w: World) -> None:
    req = InstallRequest("venv", w.tmp / "e", python=str(w.tmp / "no-such-python"))
    with pytest.raises(AgentError, match=r"creating the venv: cannot run .*no-such-python"):
        w.install(req)


def test_image_pull_is_renamed_into_place_and_traced(w: World) -> None:
    req = w.image()
    assert w.install(req)
    ((name, *args),) = w.calls()
    assert name == "apptainer"
    assert args[:3] == ["pull", "--force", "--"]
    assert args[3] != str(req.target) and args[4] == "docker://vllm/vllm-openai:v0.6.3"
    assert req.target.read_text() == "image"
    assert "llmgw.engine_install.pull" in w.spans()
    assert install_marker_for(str(req.target)) == marker_path(req.target)
    assert not w.install(req)


def test_install_continues_the_trace_in_its_environment(
    w: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TRACEPARENT", "00-" + "ab" * 16 + "-" + "cd" * 8 + "-01")
    w.install(w.venv())
    root = w.spans()["llmgw.engine_install"]
    assert root.context.trace_id == int("ab" * 16, 16)
    assert root.parent is not None and root.parent.span_id == int("cd" * 8, 16)


def test_refused_requests(w: World) -> None:
    with pytest.raises(AgentError, match="kind 'conda' refused; valid: venv, apptainer"):
        w.install(InstallRequest("conda", w.tmp / "e"))
    with pytest.raises(AgentError, match="must be an absolute path"):
        w.install(InstallRequest("venv", Path("relative/e")))


def test_marker_lookup(tmp_path: Path) -> None:
    target = tmp_path / "vllm"
    (target / "bin").mkdir(parents=True)
    assert install_marker_for(str(target / "bin" / "python")) is None
    assert install_marker_for("python3") is None
    sc = SpanContext(0x77, 0x88, is_remote=False, trace_flags=TraceFlags(1))
    write_trace_marker(marker_path(target), sc)
    assert install_marker_for(str(target / "bin" / "vllm")) == marker_path(target)
    got = read_trace_marker(marker_path(target))
    assert got is not None and traceparent_of(got) == traceparent_of(sc)
    # Three levels up is no longer the engine's install.
    assert install_marker_for(str(target / "lib" / "x" / "y")) is None
    assert os.path.basename(marker_path(target)) == "vllm.traceparent"
