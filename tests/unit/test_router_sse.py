"""The stream relay: events pass whole and in order, whatever the chunking."""

from __future__ import annotations

import json
import re

from hypothesis import given
from hypothesis import strategies as st

from llmgw_slurm.router.sse import USAGE_SET as _USAGE_SET
from llmgw_slurm.router.sse import SseRelay as _SseRelay


def _events(n: int, with_usage: bool, sep: bytes) -> list[bytes]:
    out = []
    for i in range(n):
        chunk = {"id": "x", "choices": [{"index": 0, "text": f"t{i}"}]}
        if with_usage:
            chunk["usage"] = None
        out.append(b"data: " + json.dumps(chunk).encode() + sep)
    if with_usage:
        usage = {"choices": [], "usage": {"prompt_tokens": 2, "completion_tokens": n}}
        out.append(b"data: " + json.dumps(usage).encode() + sep)
    out.append(b"data: [DONE]" + sep)
    return out


def _split(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({c % (len(data) + 1) for c in cuts})
    pieces, last = [], 0
    for p in points:
        pieces.append(data[last:p])
        last = p
    pieces.append(data[last:])
    return pieces


@given(
    n=st.integers(0, 6),
    cuts=st.lists(st.integers(0, 10_000), max_size=20),
    strip=st.booleans(),
    sep=st.sampled_from([b"\n\n", b"\r\n\r\n"]),
)
def test_any_chunking_gives_the_same_events(
    n: int, cuts: list[int], strip: bool, sep: bytes
) -> None:
    events = _events(n, True, sep)
    relay = _SseRelay(strip)
    out = b"".join(relay.feed(p) for p in _split(b"".join(events), cuts)) + relay.rest()
    expected = [e for e in events if not (strip and b'"choices": []' in e)]
    assert out == b"".join(expected)
    assert relay.usage == {"prompt_tokens": 2, "completion_tokens": n}


def _event_by_event(chunks: list[bytes], relay: _SseRelay) -> bytes:
    """The relay's output the plain way: every event split off and looked at."""
    buf, out = b"", []
    for c in chunks:
        buf += c
        start = 0
        while True:
            ends = [e + len(s) for s in (b"\n\n", b"\r\n\r\n") if (e := buf.find(s, start)) >= 0]
            if not ends:
                break
            end = min(ends)
            if relay._keep(buf[start:end]):
                out.append(buf[start:end])
            start = end
        buf = buf[start:]
    return b"".join(out) + buf


_USAGE_EVENT = b'data: {"choices": [], "usage": {"prompt_tokens": 1}}'
_PIECES = [
    b"\n",
    b"\r",
    b"\n\n",
    b"\r\n\r\n",
    b"data: x",
    b'"usage": null',
    b'"usage" :\t null',
    b'"usage"',
    _USAGE_EVENT,
    b'data: {"choices": [], "usage" :  {"prompt_tokens": 2}}',
]


@given(
    pieces=st.lists(st.sampled_from(_PIECES), max_size=30),
    cuts=st.lists(st.integers(0, 10_000), max_size=8),
    strip=st.booleans(),
)
def test_runs_of_events_give_what_event_by_event_gives(
    pieces: list[bytes], cuts: list[int], strip: bool
) -> None:
    chunks = _split(b"".join(pieces), cuts)
    relay = _SseRelay(strip)
    out = b"".join(relay.feed(c) for c in chunks) + relay.rest()
    reference = _SseRelay(strip)
    # The same events, as an SSE client reads them. Not the same bytes: a chunk that
    # ends in a blank line passes whole, so a blank line split across two reads may
    # go with the usage event the next read drops (found by hypothesis); extra
    # blank lines mean nothing to a client.
    assert _as_client_reads(out) == _as_client_reads(_event_by_event(chunks, reference))
    assert relay.usage == reference.usage


def _as_client_reads(stream: bytes) -> list[list[bytes]]:
    """The events of an SSE stream, each as its lines (the spec's line endings)."""
    events: list[list[bytes]] = [[]]
    for line in re.split(rb"\r\n|\r|\n", stream):
        if line:
            events[-1].append(line)
        elif events[-1]:
            events.append([])
    return [e for e in events if e]


def test_a_blank_line_cut_between_reads_loses_no_event() -> None:
    # The case hypothesis found: the first read ends inside a run of blank lines.
    chunks = [b"data: x\r\n\r\n\r\n", b"\r\n" + _USAGE_EVENT + b"\r\n\r\ndata: y\r\n\r\n"]
    relay = _SseRelay(True)
    out = b"".join(relay.feed(c) for c in chunks) + relay.rest()
    assert _as_client_reads(out) == [[b"data: x"], [b"data: y"]]
    assert relay.usage == {"prompt_tokens": 1}


def test_a_null_usage_however_spaced_needs_no_look() -> None:
    # Events of the common kind must take the fast path (the spaces before
    # null must not let the lookahead through).
    for text in (b'"usage":null', b'"usage": null', b'"usage" :\t\r\n null'):
        assert _USAGE_SET.search(b'data: {"choices": [], ' + text + b"}\n\n") is None
    assert _USAGE_SET.search(b'"usage" : {"prompt_tokens": 1}')


def test_usage_text_inside_content_is_not_taken_for_usage() -> None:
    chunk = {"choices": [{"text": 'say "usage": {"prompt_tokens": 9}'}]}
    relay = _SseRelay(True)
    data = b"data: " + json.dumps(chunk).encode() + b"\n\n"
    assert relay.feed(data) == data
    assert relay.usage is None


def test_incomplete_tail_is_kept_until_complete() -> None:
    relay = _SseRelay(False)
    assert relay.feed(b"data: {}\n\ndata: {") == b"data: {}\n\n"
    assert relay.feed(b"}\n\n") == b"data: {}\n\n"
    assert relay.rest() == b""


def test_many_whole_events_in_one_chunk_still_give_up_their_usage() -> None:
    for sep in (b"\n\n", b"\r\n\r\n"):
        events = _events(40, True, sep)
        relay = _SseRelay(True)
        out = relay.feed(b"".join(events))
        assert out == b"".join(e for e in events if b'"choices": []' not in e)
        assert relay.usage == {"prompt_tokens": 2, "completion_tokens": 40}
        plain = b"".join(_events(40, False, sep))
        assert _SseRelay(True).feed(plain) == plain
