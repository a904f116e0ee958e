"""The gateway's per-request families, counted in plain numbers, expose what
prometheus_client's own Counter and Histogram would, sample for sample."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from llmgw_slurm.router import ModelInfo, StaticDirectory
from llmgw_slurm.router.metrics import GatewayMetrics

BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)


def _lines(text: bytes, prefix: str) -> list[str]:
    """The exposition's samples of one family, without ``_created`` (a time)."""
    return [
        line for line in text.decode().splitlines()
        if line.startswith(prefix) and "_created" not in line
    ]  # fmt: skip


def test_requests_and_durations_are_exposed_as_prometheus_clients_own() -> None:
    ours = GatewayMetrics(StaticDirectory([ModelInfo("m")]), CollectorRegistry())
    ref = CollectorRegistry()
    requests = Counter("llmgw_requests", "r", ["model", "status"], registry=ref)
    latency = Histogram("llmgw_request_duration_seconds", "d", ["model"], buckets=BUCKETS,
                        registry=ref)  # fmt: skip
    ttfb = Histogram("llmgw_time_to_first_byte_seconds", "t", ["model"], buckets=BUCKETS,
                     registry=ref)  # fmt: skip
    # On a bound (0.01, 600), between bounds, past the last one, and no first byte.
    answers = [("m", 200, 0.01, 0.005), ("m", 200, 0.3, 0.2), ("m", 502, 900.0, None),
               ("x", 404, 600.0, None), ("m", 200, 0.0, 0.0)]  # fmt: skip
    for model, status, seconds, first in answers:
        ours.answered(model, status, seconds, first)
        requests.labels(model, str(status)).inc()
        latency.labels(model).observe(seconds)
        ttfb.labels(model)  # the series exists once its model answered, as ours
        if first is not None:
            ttfb.labels(model).observe(first)
    mine, theirs = ours.exposition(), generate_latest(ref)
    for family in ("llmgw_requests", "llmgw_request_duration", "llmgw_time_to_first_byte"):
        assert _lines(mine, family) == _lines(theirs, family), family
        assert _lines(mine, family)
    # Every labelled series also has its _created sample, as prometheus_client's.
    created = [line for line in mine.decode().splitlines() if "_created{" in line]
    assert len(created) == 3 + 2 + 2  # (m, 200), (m, 502), (x, 404); m and x twice
    assert ours.registry.get_sample_value(
        "llmgw_request_duration_seconds_bucket", {"model": "m", "le": "0.01"}
    ) == 2.0  # fmt: skip


def test_tokens_are_summed_by_model_and_kind() -> None:
    ours = GatewayMetrics(StaticDirectory([ModelInfo("m")]), CollectorRegistry())
    ours.counted("m", 3, 5)
    ours.counted("m", 4, 0)
    got = ours.registry.get_sample_value
    assert got("llmgw_tokens_total", {"model": "m", "kind": "prompt"}) == 7.0
    assert got("llmgw_tokens_total", {"model": "m", "kind": "completion"}) == 5.0
    assert got("llmgw_tokens_total", {"model": "other", "kind": "prompt"}) is None
