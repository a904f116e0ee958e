"""The model catalog: loading, defaults, every kind of error, alias resolution."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import pickle
import textwrap
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llmgw_slurm.base.errors import ConfigError, ConfigErrors
from llmgw_slurm.catalog import (
    PLACEHOLDERS,
    Catalog,
    EngineSpec,
    Model,
    Resources,
    Scaling,
    TimeLimit,
    load_catalog,
    read_replica_spec,
)
from llmgw_slurm.config import load_agent_config, load_server_config

SITE = Path(__file__).resolve().parents[2] / "site-config"


def write(tmp_path: Path, text: str, name: str = "models.yaml") -> Path:
    p = tmp_path / name
    p.write_text(textwrap.dedent(text))
    return p


def errors_of(tmp_path: Path, text: str) -> list[str]:
    """Every error message of a catalog text, as the person sees it, file name shortened."""
    p = write(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        load_catalog(p)
    err = info.value
    errs = err.errors if isinstance(err, ConfigErrors) else [err]
    for e in errs:
        assert e.file == str(p)
    return [str(e).replace(str(p), "F") for e in errs]


def one_model(extra: str = "", **blocks: str) -> str:
    """A catalog with one vllm model; ``blocks`` replace its engine/weights/... lines."""
    engine = blocks.get("engine", "{kind: vllm}")
    weights = blocks.get("weights", "{source: /m/x}")
    return f"models:\n  - name: m\n    engine: {engine}\n    weights: {weights}\n{extra}"


# ----------------------------------------------------------------- valid files


def test_a_models_context_length_is_its_own_or_its_engines_flag(tmp_path: Path) -> None:
    def ctx(text: str) -> int | None:
        m = load_catalog(write(tmp_path, text)).resolve("m")
        assert m is not None
        return m.context_tokens

    assert ctx(one_model()) is None
    assert ctx(one_model(engine="{kind: vllm, args: [--max-model-len, '8192']}")) == 8192
    assert ctx(one_model(engine="{kind: sglang, args: [--context-length=4096]}")) == 4096
    assert ctx(one_model("    context_length: 2048\n")) == 2048
    both = one_model(
        "    context_length: 2048\n", engine="{kind: vllm, args: [--max-model-len, '8192']}"
    )
    assert errors_of(tmp_path, both) == [
        "F:5: models[0].context_length: context_length 2048 differs from the engine's "
        "--max-model-len 8192; give one of them"
    ]
    site = load_catalog(SITE / "models.yaml").resolve("llama-3.1-8b")
    assert site is not None and site.context_tokens == 16384


def test_site_config_catalog_loads() -> None:
    cat = load_catalog(SITE / "models.yaml")
    assert cat.names == ("tiny", "llama-3.1-8b", "llama-3.1-70b")
    tiny = cat.resolve("tiny")
    assert tiny is not None
    assert tiny.engine.kind == "command"
    assert tiny.scaling.min == 0 and tiny.scaling.on_demand
    assert tiny.resources.gpus == 0 and tiny.resources.gres is None
    big = cat.resolve("llama-3.1-70b")
    assert big is not None and big.multi_node and big.resources.nodes == 2
    assert big.resources.gres == "gpu:a100:4"
    assert big.weights is not None and big.weights.method == "copy"
    # A 30m load: its requests wait longer than the server's router.hold_timeout.
    assert big.scaling.hold_timeout == 2400.0 > (big.engine.ready_timeout or 0)
    single = cat.resolve("meta-llama/Llama-3.1-8B-Instruct")
    assert single is not None and single.name == "llama-3.1-8b"
    assert single.engine.kind == "vllm" and not single.multi_node
    assert not single.scaling.on_demand


@pytest.mark.parametrize(
    "path", ["models.yaml", "dev/models.yaml", "examples/torch-gloo/models.yaml"]
)
def test_shipped_catalogs_keep_engine_keys_off_argv(path: str) -> None:
    # Any user of a node can read a command line; the engines read the key from
    # their environment instead (LLMGW_ENGINE_API_KEY, VLLM_API_KEY).
    cat = load_catalog(SITE / path)
    commands = [m for m in cat.models if m.engine.kind == "command"]
    assert commands
    for m in commands:
        assert not any("{api_key}" in a for a in (*m.engine.command, *m.engine.args)), m.name


def test_torch_gloo_example_is_a_two_node_command_engine_with_its_port_off_argv() -> None:
    # The example a site copies for its own distributed server: it reads the port
    # and the rendezvous from its environment, never from a command line.
    (m,) = load_catalog(SITE / "examples" / "torch-gloo" / "models.yaml").models
    assert m.engine.kind == "command" and m.resources.nodes == 2
    argv = " ".join((*m.engine.command, *m.engine.args))
    for secret in ("{port}", "{api_key}"):
        assert secret not in argv
    assert m.engine.command[1].endswith("/torch-gloo/server.py")


def test_site_config_server_and_agent_load() -> None:
    server = load_server_config(SITE / "server.yaml")
    agent = load_agent_config(SITE / "agent.yaml")
    assert server.models == SITE / "models.yaml"
    assert server.agent_config == SITE / "agent.yaml"
    assert agent.port_range.first == 20000


def test_minimal_model_gets_documented_defaults(tmp_path: Path) -> None:
    cat = load_catalog(write(tmp_path, one_model()))
    m = cat.models[0]
    assert m.aliases == () and m.description == ""
    assert m.engine == EngineSpec(kind="vllm")
    assert m.engine.health_path == "/health" and m.engine.ready_timeout is None
    assert m.weights is not None and m.weights.method == "none"
    assert m.resources == Resources()
    assert (m.resources.gpus, m.resources.nodes, m.resources.cpus) == (1, 1, 4)
    assert m.resources.time_limit is None and m.resources.partition is None
    assert m.scaling == Scaling(min=0, max=1, idle_timeout=1800.0, target_inflight=16)
    # Unset: the server's router.hold_timeout applies.
    assert m.scaling.hold_timeout is None
    assert cat.file == str(tmp_path / "models.yaml")


def test_hf_source_defaults_to_method_hf_and_parses_revision(tmp_path: Path) -> None:
    cat = load_catalog(write(tmp_path, one_model(weights="{source: hf:Org/Name-1.5@v2.0}")))
    w = cat.models[0].weights
    assert w is not None
    assert (w.method, w.is_hf, w.hf_repo, w.hf_revision) == ("hf", True, "Org/Name-1.5", "v2.0")

    cat = load_catalog(write(tmp_path, one_model(weights="{source: 'hf:Org/Name'}")))
    w = cat.models[0].weights
    assert w is not None and w.hf_revision is None
    cat = load_catalog(write(tmp_path, one_model(weights="{source: /m/x, method: copy}")))
    w = cat.models[0].weights
    assert w is not None and not w.is_hf and w.source == "/m/x" and w.hf_repo is None


def test_empty_models_list_is_an_empty_catalog(tmp_path: Path) -> None:
    assert load_catalog(write(tmp_path, "models: []\n")).models == ()
    assert load_catalog(write(tmp_path, "models:\n")).models == ()


def test_numbers_in_args_and_env_keep_their_text(tmp_path: Path) -> None:
    text = one_model(
        engine="{kind: vllm, args: [--gpu-memory-utilization, 0.90, --seed, 007], "
        "env: {A: 1, B: 1.50}}"
    )
    m = load_catalog(write(tmp_path, text)).models[0]
    assert m.engine.args == ("--gpu-memory-utilization", "0.90", "--seed", "007")
    assert m.engine.env == {"A": "1", "B": "1.50"}


def test_vllm_args_are_verbatim_braces_included(tmp_path: Path) -> None:
    text = one_model(engine="""{kind: vllm, args: [--override-generation-config, '{"t": 0}']}""")
    m = load_catalog(write(tmp_path, text)).models[0]
    assert m.engine.args[1] == '{"t": 0}'


def test_yaml_merge_keys_work(tmp_path: Path) -> None:
    text = """\
    models:
      - name: a
        engine: &eng {kind: vllm, args: [--x]}
        weights: {source: /m/a}
      - name: b
        engine:
          <<: *eng
          health_path: /ready
        weights: {source: /m/b}
    """
    cat = load_catalog(write(tmp_path, text))
    b = cat.models[1].engine
    assert (b.kind, b.args, b.health_path) == ("vllm", ("--x",), "/ready")


# ------------------------------------------------------------------ durations


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("30s", 30.0),
        ("15m", 900.0),
        ("4h", 14400.0),
        ("1d", 86400.0),
        ("1h30m", 5400.0),
        ("1.5h", 5400.0),
        ("45", 45.0),
        ("2.5", 2.5),
        ("'4:00:00'", 14400.0),
        ("4:00:00", 14400.0),  # YAML 1.1 base-60 integer, read from its text
        ("15:00", 900.0),
        ("1-00:00:00", 86400.0),
    ],
)
def test_durations(tmp_path: Path, text: str, seconds: float) -> None:
    cat = load_catalog(write(tmp_path, one_model("    scaling: {idle_timeout: " + text + "}\n")))
    assert cat.models[0].scaling.idle_timeout == seconds


@pytest.mark.parametrize(
    ("text", "seconds", "slurm"),
    [
        ("4:00:00", 14400, "4:00:00"),
        ("'04:00:00'", 14400, "4:00:00"),
        ("1-00:00:00", 86400, "1-00:00:00"),
        ("2-12", 216000, "2-12:00:00"),
        ("90m", 5400, "1:30:00"),
        ("36h", 129600, "1-12:00:00"),
        ("1d", 86400, "1-00:00:00"),
        ("30:00", 1800, "0:30:00"),
    ],
)
def test_time_limit_keeps_seconds_and_slurm_form(
    tmp_path: Path, text: str, seconds: int, slurm: str
) -> None:
    cat = load_catalog(write(tmp_path, one_model("    resources: {time_limit: " + text + "}\n")))
    assert cat.models[0].resources.time_limit == TimeLimit(seconds, slurm)
    assert str(cat.models[0].resources.time_limit) == slurm


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            "90",
            "'90' is ambiguous (Slurm reads minutes, other durations here read seconds); "
            "write 90m or 90s, or H:MM:SS",
        ),
        ("30s", "'30s' is under a minute; Slurm's time limits count whole minutes"),
        (
            "soon",
            "cannot read 'soon'; expected a Slurm time limit like 4:00:00, 1-00:00:00, "
            "90m, 4h or 1d",
        ),
        (
            "1:99:00",
            "cannot read '1:99:00'; expected a Slurm time limit like 4:00:00, "
            "1-00:00:00, 90m, 4h or 1d",
        ),
    ],
)
def test_bad_time_limits(tmp_path: Path, text: str, message: str) -> None:
    errs = errors_of(tmp_path, one_model("    resources: {time_limit: " + text + "}\n"))
    assert errs == [f"F:5: models[0].resources.time_limit: {message}"]


def test_bad_duration(tmp_path: Path) -> None:
    errs = errors_of(tmp_path, one_model("    scaling: {idle_timeout: 5 minutes}\n"))
    assert errs == [
        "F:5: models[0].scaling.idle_timeout: cannot read '5 minutes' as a duration; expected "
        "a duration like 30s, 15m, 4h, 1d, 2w, 1h30m, 4:00:00, or a number of seconds"
    ]
    errs = errors_of(tmp_path, one_model("    scaling: {idle_timeout: 0}\n"))
    assert errs == ["F:5: models[0].scaling.idle_timeout: must be more than 0; got 0"]
    errs = errors_of(tmp_path, one_model("    scaling: {idle_timeout: true}\n"))
    assert errs[0].startswith("F:5: models[0].scaling.idle_timeout: expected a duration like")


def test_per_model_hold_timeout(tmp_path: Path) -> None:
    cat = load_catalog(write(tmp_path, one_model("    scaling: {hold_timeout: 20m}\n")))
    assert cat.models[0].scaling.hold_timeout == 1200.0
    text = """\
    defaults:
      scaling: {hold_timeout: 10m}
    models:
      - {name: a, engine: {kind: vllm}, weights: {source: /m/a}, scaling: {hold_timeout: 45m}}
      - {name: b, engine: {kind: vllm}, weights: {source: /m/b}}
    """
    a, b = load_catalog(write(tmp_path, text)).models
    assert (a.scaling.hold_timeout, b.scaling.hold_timeout) == (2700.0, 600.0)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("0", "must be more than 0; got 0"),
        ("0s", "must be more than 0; got 0"),
        (
            "-5m",
            "cannot read '-5m' as a duration; expected a duration like 30s, 15m, 4h, 1d, 2w, "
            "1h30m, 4:00:00, or a number of seconds",
        ),
        (
            "soon",
            "cannot read 'soon' as a duration; expected a duration like 30s, 15m, 4h, 1d, 2w, "
            "1h30m, 4:00:00, or a number of seconds",
        ),
        (
            "true",
            "expected a duration like 30s, 15m, 4h, 1d, 2w, 1h30m, 4:00:00, or a number of "
            "seconds; got the boolean true",
        ),
    ],
)
def test_bad_hold_timeout(tmp_path: Path, text: str, message: str) -> None:
    errs = errors_of(tmp_path, one_model("    scaling:\n      hold_timeout: " + text + "\n"))
    assert errs == [f"F:6: models[0].scaling.hold_timeout: {message}"]


@pytest.mark.parametrize(
    ("text", "stored", "mb"),
    [
        ("64G", "64G", 65536),
        ("512m", "512M", 512),
        ("2048", "2048", 2048),
        ("1T", "1T", 1048576),
        ("0", "0", 0),
        ("64GB", "64G", 65536),
    ],
)
def test_memory(tmp_path: Path, text: str, stored: str, mb: int) -> None:
    cat = load_catalog(write(tmp_path, one_model("    resources: {memory: " + text + "}\n")))
    assert cat.models[0].resources.memory == stored
    assert cat.models[0].resources.memory_mb == mb


@pytest.mark.parametrize("text", ["\u0661\u0662G", "\uff16\uff14G", "64\u212a"])
def test_memory_takes_ascii_only(tmp_path: Path, text: str) -> None:
    """Arabic-Indic or fullwidth digits, or the Kelvin sign for K, loaded (Python's
    \\d and IGNORECASE take them), passed `config check`, and then every start of
    the model failed at rendering: no #SBATCH --mem line may hold them."""
    errs = errors_of(tmp_path, one_model(f"    resources: {{memory: '{text}'}}\n"))
    assert errs and "memory: cannot read" in errs[0], errs


# ---------------------------------------------------------------- defaults


def test_defaults_merge_under_each_model_and_model_wins(tmp_path: Path) -> None:
    text = """\
    defaults:
      engine:
        env: {HF_HOME: /cache, A: from-defaults}
        ready_timeout: 20m
      resources: {partition: gpu, time_limit: 4:00:00, gpus: 2}
      scaling: {idle_timeout: 15m, max: 3}
    models:
      - name: a
        engine: {kind: vllm, env: {A: mine}}
        weights: {source: /m/a}
        resources: {gpus: 1}
      - name: b
        engine: {kind: sglang}
        weights: {source: /m/b}
        scaling: {max: 1}
    """
    cat = load_catalog(write(tmp_path, text))
    a, b = cat.models
    assert a.engine.env == {"A": "mine", "HF_HOME": "/cache"}
    assert a.engine.ready_timeout == 1200.0
    assert (a.resources.gpus, a.resources.partition) == (1, "gpu")
    assert a.resources.time_limit == TimeLimit(14400, "4:00:00")
    assert (a.scaling.idle_timeout, a.scaling.max) == (900.0, 3)
    assert (b.resources.gpus, b.scaling.max, b.engine.kind) == (2, 1, "sglang")


def test_bad_value_in_defaults_is_reported_once_where_it_is_written(tmp_path: Path) -> None:
    text = """\
    defaults:
      resources: {gpus: many}
    models:
      - {name: a, engine: {kind: vllm}, weights: {source: /m/a}}
      - {name: b, engine: {kind: vllm}, weights: {source: /m/b}}
    """
    assert errors_of(tmp_path, text) == [
        "F:2: defaults.resources.gpus: expected a whole number, got the string 'many'"
    ]


def test_defaults_may_not_set_name_or_unknown_blocks(tmp_path: Path) -> None:
    text = """\
    defaults:
      name: x
      resources: 3
    models: []
    """
    assert errors_of(tmp_path, text) == [
        "F:2: defaults.name: unknown key 'name' (valid keys: access, description, engine, "
        "resources, routing, scaling, weights); name and aliases belong to each model",
        "F:3: defaults.resources: expected a mapping; got the integer 3",
    ]


# ------------------------------------------------------------------- errors


def test_unknown_key_suggests_the_closest_and_lists_valid_keys(tmp_path: Path) -> None:
    errs = errors_of(tmp_path, one_model("    resources:\n      gpu: 2\n"))
    assert errs == [
        "F:6: models[0].resources.gpu: unknown key 'gpu'; did you mean 'gpus'? (valid keys: "
        "account, clusters, constraint, cpus, gpu_type, gpus, memory, nodes, partition, qos, time_limit)"
    ]
    errs = errors_of(tmp_path, one_model("    scaling: {hold_timout: 5m}\n"))
    assert errs == [
        "F:5: models[0].scaling.hold_timout: unknown key 'hold_timout'; did you mean "
        "'hold_timeout'? (valid "
        "keys: evict_for, hold_timeout, idle_timeout, max, max_wait, min, scale_on, "
        "target_inflight, target_waiting)"
    ]
    errs = errors_of(tmp_path, one_model("    zzz: 1\n"))
    assert errs == [
        "F:5: models[0].zzz: unknown key 'zzz' (valid keys: access, aliases, context_length, "
        "description, "
        "endpoints, engine, name, resources, routing, scaling, weights)"
    ]


def test_unknown_top_level_key(tmp_path: Path) -> None:
    errs = errors_of(tmp_path, "model: []\n")
    assert errs == [
        "F:1: model: unknown key 'model'; did you mean 'models'? (valid keys: defaults, models)",
        "F:1: models: missing required key 'models' (a list of model entries)",
    ]


def test_wrong_types_say_what_was_expected(tmp_path: Path) -> None:
    text = one_model(
        "    resources: {gpus: '2', nodes: 1.5, gpu_type: [a]}\n"
        "    scaling: {min: true}\n"
        "    aliases: x\n"
    )
    assert errors_of(tmp_path, text) == [
        "F:5: models[0].resources.gpus: expected a whole number, got the string '2'",
        "F:5: models[0].resources.gpu_type: expected a string, got a list",
        "F:5: models[0].resources.nodes: expected a whole number, got the number 1.5",
        "F:6: models[0].scaling.min: expected a whole number, got the boolean true",
        "F:7: models[0].aliases: expected a list of strings, got the string 'x'",
    ]


def test_boolean_where_a_word_was_meant_asks_for_quotes(tmp_path: Path) -> None:
    errs = errors_of(tmp_path, one_model("    resources: {partition: on}\n"))
    assert errs == [
        "F:5: models[0].resources.partition: expected a string, got the boolean on "
        '(write "on" in quotes if you mean the text)'
    ]


def test_bad_names_and_aliases(tmp_path: Path) -> None:
    text = """\
    models:
      - name: Llama 8B
        engine: {kind: command, command: [x]}
      - name: ok
        aliases: ["has space", "tab\\there", "org/Fine-Name"]
        engine: {kind: command, command: [x]}
      - name: aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa
        engine: {kind: command, command: [x]}
    """
    errs = errors_of(tmp_path, text)
    rule = (
        "expected 1-48 characters: lowercase letters, digits, '.', '_' or '-', starting "
        "with a letter or digit"
    )
    assert errs == [
        f"F:2: models[0].name: 'Llama 8B' is not valid: {rule}",
        "F:5: models[1].aliases[0]: 'has space' is not valid: expected 1-200 characters "
        "without whitespace or control characters",
        "F:5: models[1].aliases[1]: 'tab\\there' is not valid: expected 1-200 characters "
        "without whitespace or control characters",
        f"F:7: models[2].name: '{'a' * 49}' is not valid: {rule}",
    ]


def test_names_and_aliases_must_be_unique(tmp_path: Path) -> None:
    text = """\
    models:
      - name: a
        aliases: [org/A]
        engine: {kind: command, command: [x]}
      - name: a
        engine: {kind: command, command: [x]}
      - name: b
        aliases:
          - a
          - org/A
        engine: {kind: command, command: [x]}
    """
    assert errors_of(tmp_path, text) == [
        "F:5: models[1].name: 'a' is already used as the name of models[0] (line 2); "
        "names and aliases must be unique",
        "F:9: models[2].aliases[0]: alias 'a' is already used as the name of models[0] "
        "(line 2); names and aliases must be unique",
        "F:10: models[2].aliases[1]: alias 'org/A' is already used as an alias of models[0] "
        "(a) (line 3); names and aliases must be unique",
    ]


def test_engine_rules(tmp_path: Path) -> None:
    text = """\
    models:
      - name: a
        engine: {kind: command}
      - name: b
        engine: {kind: vllm, command: [x]}
        weights: {source: /m/b}
      - name: c
        engine:
          kind: command
          command: [srv, "{port}", "{prot}", "{host!r}", "{{literal}}", "{"]
          args: ["{api_key}", "{nope}"]
      - name: d
        engine: {kind: vlm}
      - name: e
        engine: {kind: sglang, health_path: health}
        weights: {source: /m/e}
    """
    valid = "{host}, {port}, {model_path}, {api_key}, {served_name}, {nnodes}, {node_rank}, {master_addr}, {master_port}, {tls_certfile}, {tls_keyfile}, {tls_ca_certs}"
    assert errors_of(tmp_path, text) == [
        "F:3: models[0].engine.command: kind 'command' needs a command list, e.g. "
        "[python, -m, my.server, --port, '{port}']",
        "F:5: models[1].engine.command: only kind 'command' takes a command; kind 'vllm' is "
        "started by the agent (use args for extra flags)",
        f"F:10: models[2].engine.command[2]: '{{prot}}': unknown placeholder {{prot}}; valid: "
        f"{valid} (write {{{{ and }}}} for literal braces)",
        "F:10: models[2].engine.command[3]: '{host!r}': placeholder {host} takes no format "
        "or conversion",
        "F:10: models[2].engine.command[5]: '{': Single '{' encountered in format string; "
        "write {{ and }} for literal braces",
        f"F:11: models[2].engine.args[1]: '{{nope}}': unknown placeholder {{nope}}; valid: "
        f"{valid} (write {{{{ and }}}} for literal braces)",
        "F:13: models[3].engine.kind: expected one of: vllm, sglang, command; got the string "
        "'vlm'; did you mean 'vllm'?",
        "F:15: models[4].engine.health_path: 'health' is not valid: expected a path starting "
        "with '/'",
    ]


def test_env_names_are_checked_and_llmgw_names_reserved(tmp_path: Path) -> None:
    text = one_model(engine="{kind: vllm, env: {LLMGW_REPLICA_SECRET: x, TRACEPARENT: y}}")
    assert errors_of(tmp_path, text) == [
        "F:3: models[0].engine.env.LLMGW_REPLICA_SECRET: LLMGW_REPLICA_SECRET is reserved for "
        "llmgw (it carries the replica's identity or trace); choose another name",
        "F:3: models[0].engine.env.TRACEPARENT: TRACEPARENT is reserved for llmgw (it carries "
        "the replica's identity or trace); choose another name",
    ]
    text = one_model(engine="{kind: vllm, env: {'A-B': x, OK: null}}")
    assert errors_of(tmp_path, text) == [
        "F:3: models[0].engine.env.A-B: 'A-B' is not a valid name: expected an environment "
        "variable name (letters, digits, '_', not starting with a digit)",
        "F:3: models[0].engine.env.OK: expected a string, got nothing (null)",
    ]


def test_weights_rules(tmp_path: Path) -> None:
    text = """\
    models:
      - {name: a, engine: {kind: vllm}}
      - {name: b, engine: {kind: vllm}, weights: {source: models/b}}
      - {name: c, engine: {kind: vllm}, weights: {source: "hf:no-slash"}}
      - {name: d, engine: {kind: vllm}, weights: {source: "hf:o/n", method: copy}}
      - {name: e, engine: {kind: vllm}, weights: {source: /m/e, method: hf}}
      - {name: f, engine: {kind: vllm}, weights: {source: /m/f, method: rsync}}
      - {name: g, engine: {kind: vllm}, weights: {method: copy}}
    """
    assert errors_of(tmp_path, text) == [
        "F:2: models[0].weights: a vllm engine needs weights: {source: /path/to/model} or "
        "{source: hf:ORG/NAME}",
        "F:3: models[1].weights.source: 'models/b' is not valid: expected an absolute path, "
        "or hf:ORG/NAME[@revision]",
        "F:4: models[2].weights.source: 'hf:no-slash' is not hf:ORG/NAME or hf:ORG/NAME@revision",
        "F:5: models[3].weights.method: copy stages a local folder; an hf: source uses method "
        "hf (or none to let the engine resolve it)",
        "F:6: models[4].weights.method: method hf needs an hf:ORG/NAME source; a local path "
        "uses copy or none",
        "F:7: models[5].weights.method: expected one of: copy, hf, none; got the string 'rsync'",
        "F:8: models[6].weights.source: missing required key 'source'",
    ]


def test_resources_and_scaling_bounds(tmp_path: Path) -> None:
    text = one_model(
        "    resources: {gpus: -1, nodes: 0, cpus: 0, memory: lots, constraint: 'a b'}\n"
        "    scaling: {min: 2, max: 1}\n"
    )
    assert errors_of(tmp_path, text) == [
        "F:5: models[0].resources.gpus: must be at least 0; got -1",
        "F:5: models[0].resources.nodes: must be at least 1; got 0",
        "F:5: models[0].resources.cpus: must be at least 1; got 0",
        "F:5: models[0].resources.memory: cannot read 'lots'; expected Slurm memory like 64G, "
        "512M, 1T or a number of megabytes (0 = all of the node)",
        "F:5: models[0].resources.constraint: 'a b' is not valid: expected a Slurm constraint: "
        "feature names joined by & | , with [] () *N",
        "F:6: models[0].scaling.min: min (2) is more than max (1)",
    ]
    errs = errors_of(tmp_path, one_model("    scaling: {max: 0, target_inflight: 0}\n"))
    assert errs == [
        "F:5: models[0].scaling.max: must be at least 1; got 0",
        "F:5: models[0].scaling.target_inflight: must be at least 1; got 0",
    ]


def test_missing_required_keys(tmp_path: Path) -> None:
    text = """\
    models:
      - description: nameless
      - name: x
        engine: {args: []}
    """
    assert errors_of(tmp_path, text) == [
        "F:2: models[0].name: missing required key 'name'",
        "F:2: models[0].engine: missing required key 'engine'",
        "F:4: models[1].engine.kind: missing required key 'kind'",
    ]


def test_all_errors_of_a_file_come_together_in_line_order(tmp_path: Path) -> None:
    text = """\
    models:
      - name: a
        engine: {kind: vllm}
        weights: {source: /m/a}
        scaling: {max: 0}
      - name: B
        engine: {kind: vllm}
        weights: {source: /m/b}
        resources: {gpus: x}
    """
    p = write(tmp_path, text)
    with pytest.raises(ConfigErrors) as info:
        load_catalog(p)
    assert [(e.line, e.field) for e in info.value.errors] == [
        (5, "models[0].scaling.max"),
        (6, "models[1].name"),
        (9, "models[1].resources.gpus"),
    ]
    # str() of the collection is one line per error, for the CLI to print.
    assert str(info.value).count("\n") == 2


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (
            "models: [\n",
            "F:2: YAML syntax error: while parsing a flow node expected the node "
            "content, but found '<stream end>'",
        ),
        (
            "models:\n  - a: 1\n   b: 2\n",
            "F:3: YAML syntax error: while parsing a block "
            "collection expected <block end>, but found '<block mapping start>'",
        ),
        (
            "",
            "F: file is empty; a catalog is a mapping with 'models:' (a list of models) and "
            "optional 'defaults:'",
        ),
        (
            "# only a comment\n",
            "F: file is empty; a catalog is a mapping with 'models:' (a list "
            "of models) and optional 'defaults:'",
        ),
        ("- name: a\n", "F:1: expected a mapping with keys defaults, models; got a list"),
        (
            "models: {name: a}\n",
            "F:1: models: expected a list of model entries (each starting "
            "with '- name: ...'); got a mapping",
        ),
        (
            "models: []\nmodels: []\n",
            "F:2: duplicate key 'models' (first at line 1); each key may appear once",
        ),
        (
            "models: !!python/object:os.system []\n",
            "F:1: YAML tag "
            "tag:yaml.org,2002:python/object:os.system is not supported here; use a plain list",
        ),
        ("a: &x [*x]\n", "F:1: an alias refers to a node that contains it (recursive alias)"),
        ("a: !!int ''\n", "F:1: cannot read '' as int"),
        ("a: !!float x\n", "F:1: cannot read 'x' as float: could not convert string to float: 'x'"),
    ],
)
def test_broken_files(tmp_path: Path, text: str, expected: str) -> None:
    assert errors_of(tmp_path, text) == [expected]


def test_missing_file_and_directory_and_bad_encoding(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        load_catalog(tmp_path / "nope.yaml")
    assert str(info.value) == f"{tmp_path / 'nope.yaml'}: file not found"
    with pytest.raises(ConfigError) as info:
        load_catalog(tmp_path)
    assert str(info.value) == f"{tmp_path}: is a directory, expected a YAML file"
    p = tmp_path / "latin1.yaml"
    p.write_bytes(b"models: []\n# caf\xe9\n")
    with pytest.raises(ConfigError) as info:
        load_catalog(p)
    assert str(info.value) == f"{p}:2: not valid UTF-8 (byte 16); save the file as UTF-8"


def test_alias_bomb_is_refused(tmp_path: Path) -> None:
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    lines += [f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 10) + "]" for i in range(1, 7)]
    errs = errors_of(tmp_path, "\n".join(lines) + "\n")
    assert len(errs) == 1 and "document expands to more than 200000 values" in errs[0]


# -------------------------------------------------------------- resolution


def _catalog() -> Catalog:
    def model(name: str, *aliases: str) -> Model:
        return Model(name=name, engine=EngineSpec(kind="command", command=("x",)), aliases=aliases)

    return Catalog((model("a", "org/A", "A"), model("b"), model("c", "b2")))


def test_resolve_by_name_and_alias() -> None:
    cat = _catalog()
    a = cat.resolve("a")
    assert a is not None and a.name == "a"
    assert cat.resolve("org/A") is a and cat.resolve("A") is a
    b2 = cat.resolve("b2")
    assert b2 is not None and b2.name == "c"
    assert cat.resolve("org/a") is None  # exact, case-sensitive
    assert cat.resolve("zz") is None
    assert cat.get("org/A") is None and cat.get("a") is a
    assert cat.names == ("a", "b", "c")
    assert dict(cat.aliases) == {"org/A": "a", "A": "a", "b2": "c"}
    assert "org/A" in cat and "zz" not in cat and 3 not in cat
    assert len(cat) == 3 and [m.name for m in cat] == ["a", "b", "c"]


def test_names_win_over_aliases_in_catalogs_built_in_code() -> None:
    eng = EngineSpec(kind="command", command=("x",))
    cat = Catalog((Model(name="x", engine=eng, aliases=("y",)), Model(name="y", engine=eng)))
    y = cat.resolve("y")
    assert y is not None and y.name == "y"


# ------------------------------------------------------------- helpers, spec


def test_resources_helpers() -> None:
    r = Resources(gpus=2, partition="mine")
    assert r.gres == "gpu:2"
    filled = r.with_slurm_defaults(partition="site", account="acct", qos=None)
    assert (filled.partition, filled.account, filled.qos) == ("mine", "acct", None)
    assert Resources(memory=None).memory_mb is None


def test_spec_round_trip(tmp_path: Path) -> None:
    cat = load_catalog(SITE / "models.yaml")
    for m in cat:
        text = m.to_spec_json()
        data = json.loads(text)
        assert data["name"] == m.name
        assert read_replica_spec(text) == (m, [])
    big = cat.resolve("llama-3.1-70b")
    assert big is not None
    assert big.to_spec()["resources"]["time_limit"] == "1-00:00:00"
    assert big.to_spec()["scaling"]["hold_timeout"] == 2400.0


def test_bad_spec_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match=r"^LLMGW_REPLICA_SPEC: not valid JSON"):
        read_replica_spec("{")
    with pytest.raises(ConfigError, match=r"^LLMGW_REPLICA_SPEC: expected a JSON object"):
        read_replica_spec("[]")
    with pytest.raises(ConfigErrors) as info:
        read_replica_spec(json.dumps({"name": "a", "engine": {"kind": "vllm", "args": "x"}}))
    assert [str(e) for e in info.value.errors] == [
        "LLMGW_REPLICA_SPEC: engine.args: expected a list of strings, got the string 'x'",
    ]


# ------------------------------------------------------- property: never crash

_KEYS = [
    "models",
    "defaults",
    "name",
    "aliases",
    "engine",
    "kind",
    "args",
    "command",
    "env",
    "weights",
    "source",
    "method",
    "resources",
    "gpus",
    "nodes",
    "memory",
    "time_limit",
    "scaling",
    "min",
    "max",
    "idle_timeout",
    "hold_timeout",
    "slurm",
    "listen",
    "gateway",
    "tracing",
    "enabled",
    "port_range",
    "headers",
    "reconcile",
    "restart",
    "sampling_ratio",
    "x",
]
_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(10**20), 10**20),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
    st.sampled_from(
        [
            "vllm",
            "command",
            "hf:o/n",
            "/m",
            "4:00:00",
            "15m",
            "64G",
            "{port}",
            "1-2",
            "127.0.0.1:80",
            "20000-20010",
            "grpc",
            "a" * 49,
            "~nobody-x/y",
        ]
    ),
)
_docs = st.recursive(
    _scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.dictionaries(st.one_of(st.sampled_from(_KEYS), st.text(max_size=5)), inner, max_size=5),
    ),
    max_leaves=25,
)


def _load_any(path: Path) -> None:
    """Each loader either returns or raises ConfigError; anything else fails the test."""
    for loader in (load_catalog, load_server_config, load_agent_config):
        with contextlib.suppress(ConfigError):
            loader(path)


@settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(doc=_docs)
def test_random_documents_load_or_raise_config_error(tmp_path: Path, doc: object) -> None:
    p = tmp_path / "doc.yaml"
    p.write_text(yaml.safe_dump(doc))
    _load_any(p)


@settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    text=st.text(alphabet=st.sampled_from(list("ab:- \n[]{},&*!|>'\"#%@`?\t0123.")), max_size=80)
)
def test_random_yamlish_text_loads_or_raises_config_error(tmp_path: Path, text: str) -> None:
    p = tmp_path / "doc.yaml"
    p.write_text(text)
    _load_any(p)


@settings(
    max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(doc=_docs)
def test_random_catalog_entries_load_or_raise_config_error(tmp_path: Path, doc: object) -> None:
    p = tmp_path / "doc.yaml"
    p.write_text(yaml.safe_dump({"models": [doc], "defaults": doc}))
    _load_any(p)


def test_loaded_models_are_frozen_and_hashable() -> None:
    cat = load_catalog(SITE / "models.yaml")
    big = cat.resolve("llama-3.1-70b")
    assert big is not None
    with pytest.raises(TypeError, match="read-only"):
        big.engine.env["X"] = "y"  # type: ignore[index]
    with pytest.raises(dataclasses.FrozenInstanceError):
        big.name = "other"  # type: ignore[misc]
    assert len({*cat.models, *cat.models}) == 3
    assert copy.deepcopy(big) == big and pickle.loads(pickle.dumps(big)) == big
    assert json.loads(json.dumps(big.engine.env)) == {"NCCL_SOCKET_IFNAME": "ib0"}


def test_scaling_evict_for(tmp_path: Path) -> None:
    ok = tmp_path / "ok"
    ok.mkdir()
    cat = load_catalog(write(ok, one_model("    scaling: {evict_for: [held, min]}\n")))
    assert cat.models[0].scaling.evict_for == ("held", "min")
    default = tmp_path / "default"
    default.mkdir()
    assert load_catalog(write(default, one_model(""))).models[0].scaling.evict_for == ("held",)
    text = one_model("    scaling:\n      evict_for: [held, mni]\n")
    assert errors_of(tmp_path, text) == [
        "F:6: models[0].scaling.evict_for[1]: expected one of: held, min, renewal, load; "
        "got the string 'mni'; did you mean 'min'?"
    ]
    text = one_model("    scaling: {evict_for: [load, load]}\n")
    assert errors_of(tmp_path, text) == [
        "F:5: models[0].scaling.evict_for: evict_for names load more than once"
    ]


def test_a_command_engine_may_use_every_placeholder_the_agent_fills(tmp_path: Path) -> None:
    # The catalog refused the multi-node ones the agent fills ({node_rank}, ...).
    from llmgw_slurm.agent.engine import LaunchParams, build_engine_command

    argv = [f"--{p}={{{p}}}" for p in PLACEHOLDERS]
    m = Model(
        name="m",
        engine=EngineSpec(kind="command", command=("serve", *argv)),
    )
    assert m.engine.schema_problems() == []
    p = LaunchParams(model_path="/w", served_name="m", host="h", port=1, python="py")
    assert len(build_engine_command(m.engine, p, "k").argv) == len(PLACEHOLDERS) + 1
