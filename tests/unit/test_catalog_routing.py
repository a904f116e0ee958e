"""The catalog's endpoints and routing: defaults per engine kind, errors with file:line, and
what the reconciler's directory hands the gateway from them."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest

from llmgw_slurm.auth.tls import PinnedContexts, make_identity
from llmgw_slurm.base.errors import ConfigErrors
from llmgw_slurm.catalog import ENDPOINTS, load_catalog, read_replica_spec
from llmgw_slurm.reconciler.directory import ReplicaDirectory
from llmgw_slurm.reconciler.replicas import ReplicaTable
from llmgw_slurm.reconciler.spans import ReconcileTracing
from llmgw_slurm.router.directory import ModelRouting

CATALOG = """\
defaults:
  routing: {prefix_chars: 500}
models:
  - {name: v, engine: {kind: vllm}, weights: {source: /m/v}}
  - {name: s, engine: {kind: sglang}, weights: {source: /m/s}}
  - name: c
    engine: {kind: command, command: [run, "{port}"]}
    endpoints: [chat/completions, tokenize]
    routing: {policy: prefix, load_factor: 1.5}
"""


def test_endpoints_default_per_engine_kind_and_routing_merges(tmp_path: Path) -> None:
    p = tmp_path / "models.yaml"
    p.write_text(CATALOG)
    v, s, c = load_catalog(p).models
    assert v.served_endpoints == ENDPOINTS
    assert s.served_endpoints == ("chat/completions", "completions", "embeddings")
    assert c.served_endpoints == ("chat/completions", "tokenize")
    assert (v.routing.policy, v.routing.prefix_chars) == ("least_outstanding", 500)
    assert (c.routing.policy, c.routing.prefix_chars, c.routing.load_factor) == (
        "prefix",
        500,
        1.5,
    )
    # The job's copy of the entry reads back the same.
    back, ignored = read_replica_spec(c.to_spec_json())
    assert (back, ignored) == (c, [])


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (
            "    endpoints: [chat]\n",
            "F:5: models[0].endpoints[0]: expected one of: chat/completions, completions, "
            "embeddings, responses, rerank, score, tokenize, detokenize, audio/transcriptions, "
            "audio/translations; got the string 'chat'",
        ),
        (
            "    endpoints: [rerank, score, rerank]\n",
            "F:5: models[0].endpoints: endpoints names rerank more than once",
        ),
        (
            "    routing: {policy: prefx}\n",
            "F:5: models[0].routing.policy: expected one of: least_outstanding, prefix; "
            "got the string 'prefx'; did you mean 'prefix'?",
        ),
        (
            "    routing: {load_factor: 0.9}\n",
            "F:5: models[0].routing.load_factor: must be at least 1; got 0.9",
        ),
    ],
)
def test_bad_endpoints_and_routing(tmp_path: Path, extra: str, message: str) -> None:
    p = tmp_path / "models.yaml"
    p.write_text(
        "models:\n  - name: m\n    engine: {kind: vllm}\n    weights: {source: /m/x}\n" + extra
    )
    with pytest.raises(ConfigErrors) as info:
        load_catalog(p)
    assert [str(e).replace(str(p), "F") for e in info.value.errors] == [message]


def test_replica_directory_hands_the_gateway_each_models_routing(tmp_path: Path) -> None:
    p = tmp_path / "models.yaml"
    p.write_text(CATALOG)
    table = ReplicaTable(load_catalog(p), lambda: 0.0, ReconcileTracing(None, False))
    gw = make_identity(Path(tempfile.mkdtemp(prefix="llmgw-test-gw-")), "gw", "gw", 1)
    d = ReplicaDirectory(table, b"k" * 64, PinnedContexts(gw))
    assert d.routing("c") == ModelRouting(
        frozenset({"chat/completions", "tokenize"}), "prefix", 500, 1.5
    )
    v = d.routing("v")
    assert v is not None and v.endpoints == frozenset(ENDPOINTS)
    assert d.routing("nope") is None
    # A reloaded catalog is read again.
    p.write_text(CATALOG.replace("tokenize]", "detokenize]"))
    table.catalog = load_catalog(p)
    c = d.routing("c")
    assert c is not None and c.endpoints == frozenset({"chat/completions", "detokenize"})
