"""relay.LaneSink's ends, which the stream tests cannot time at will: an
answer that ends as its client goes, and a drain cut by its limits."""

from __future__ import annotations

from typing import Any

from multidict import CIMultiDict

from llmgw_slurm.router.relay import LaneSink, _Call, _SseRelay
from llmgw_slurm.router.upstream import Conn

USAGE = b'data: {"choices": [], "usage": {"completion_tokens": 4}}\n\n'


class FakeConn:
    """The three things a sink does to an engine's connection; anything else fails."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def pause(self) -> None:
        self.calls.append("pause")

    def resume(self) -> None:
        self.calls.append("resume")

    def abandon(self) -> None:
        self.calls.append("abandon")

    def __getattr__(self, name: str) -> Any:
        raise AssertionError(f"a sink has no business with Conn.{name}")


class FakeClient:
    def __init__(self) -> None:
        self.written: list[bytes] = []
        self.events: list[str] = []

    def begin_stream(self, headers: dict[str, str], sink: LaneSink) -> None:
        self.events.append("begin")

    def write_chunk(self, data: bytes) -> bool:
        self.written.append(data)
        return True

    def end_stream(self) -> None:
        self.events.append("end")

    def cut(self) -> None:
        self.events.append("cut")


def make(drain: tuple[float, int] = (30.0, 10_000)) -> tuple[LaneSink, FakeConn, list[bool]]:
    drained: list[bool] = []
    sink = LaneSink(
        FakeClient(), _SseRelay(False), _Call(t0=0.0), lambda h: {}, drain, drained.append
    )
    conn = FakeConn()
    sink.head(conn, CIMultiDict())  # type: ignore[arg-type]
    return sink, conn, drained


def as_conn(conn: FakeConn) -> Conn:
    return conn  # type: ignore[return-value]


async def test_an_answer_that_ended_as_its_client_went_is_counted_once() -> None:
    sink, conn, drained = make()
    sink.data(USAGE)
    sink.end(True)
    # The client's cancel comes before the gateway saw the end: the usage counts
    # now, and the connection (idle, not the sink's) is the caller's to cut.
    assert sink.keep_reading(as_conn(conn)) is False
    assert drained == [True]
    assert sink.usage == {"completion_tokens": 4}


async def test_a_connection_back_in_the_pool_is_not_paused_by_the_old_stream() -> None:
    sink, conn, _ = make()
    sink.pause()
    sink.end(True)
    sink.pause()
    sink.resume()
    assert conn.calls == ["pause"]


async def test_a_drain_past_its_bytes_cuts_the_engine_and_ends_once() -> None:
    sink, conn, drained = make(drain=(30.0, 100))
    assert sink.keep_reading(as_conn(conn)) is True
    sink.data(b"data: " + b"x" * 200 + b"\n\n")
    assert conn.calls == ["resume", "abandon"] and drained == [False]
    sink.end(False)  # the abandoned connection's own end: nothing more
    assert drained == [False]


async def test_a_drain_that_reaches_the_end_counts_the_usage() -> None:
    sink, conn, drained = make()
    assert sink.keep_reading(as_conn(conn)) is True
    sink.data(USAGE)
    sink.end(True)
    assert drained == [True] and conn.calls == ["resume", "abandon"]
    assert sink.usage == {"completion_tokens": 4}


async def test_without_a_drain_the_caller_cuts_at_once() -> None:
    sink, conn, drained = make(drain=(0.0, 0))
    assert sink.keep_reading(as_conn(conn)) is False
    assert drained == [] and conn.calls == []
