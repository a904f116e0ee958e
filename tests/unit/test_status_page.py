"""The status page's HTML: what it shows, and that nothing in it is markup from outside."""

from __future__ import annotations

import re
from html.parser import HTMLParser
from typing import Any

from llmgw_slurm.api.status_page import REFRESH_SECONDS, render_page

EVIL = "<script>alert(1)</script>\"'&"


class Text(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.tags: list[str] = []
        self.text: list[str] = []
        self._skip = False

    def handle_starttag(self, tag: str, attrs: Any) -> None:
        self.tags.append(tag)
        self._skip = tag == "style"

    def handle_endtag(self, tag: str) -> None:
        self._skip = False

    def handle_data(self, data: str) -> None:
        if not self._skip:
            self.text.append(data)


def status(**kw: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "passes": 3,
        "last_pass_error": "",
        "version": "0.1.0",
        "now": 1.7e9,
        "models": [
            {
                "name": "tiny",
                "aliases": ["test/tiny-chat"],
                "gpus": 1,
                "min": 0,
                "max": 2,
                "state": "queued",
                "ready_replicas": 0,
                "reason": "Resources",
                "state_text": "queued (Resources)",
                "note": "queued (Resources): needs 1 node(s)",
                "replicas": [
                    {
                        "id": "0000aaaa",
                        "job_id": "42",
                        "state": "pending",
                        "reason": EVIL,
                        "nodes": [],
                        "step": "",
                        "in_flight": 0,
                        "idle_s": None,
                    }
                ],
            }
        ],
        "decisions": [
            {
                "at": 1.7e9,
                "action": "submit",
                "model": "tiny",
                "replica": "0000aaaa",
                "reason": "scale up to 1: " + EVIL,
                "pass": "p",
            }
        ],
        "nodes": [
            {
                "name": "gpunode1",
                "state": "mixed",
                "reason": "",
                "partitions": ["llm"],
                "gpus_free": 3,
                "gpus_total": 4,
            }
        ],
    }
    base.update(kw)
    return base


def test_page_shows_models_replicas_reasons_decisions_nodes() -> None:
    html = render_page(status(), "http://gw:8000/v1")
    p = Text()
    p.feed(html)
    text = " ".join(p.text)
    for want in (
        "tiny",
        "test/tiny-chat",
        "queued (Resources)",
        "0000aaaa",
        "job 42",
        "scale up to 1",
        "gpunode1",
        "3/4",
        "http://gw:8000/v1",
    ):
        assert want in text, want
    assert f'http-equiv="refresh" content="{REFRESH_SECONDS}"' in html
    assert "As Slurm listed them" not in text  # no listing time given, none claimed


def test_page_says_how_old_the_node_listing_is() -> None:
    # The daemon keeps a node listing up to reconcile.nodes_max_age: say so.
    p = Text()
    p.feed(render_page(status(nodes_listed_at=1.7e9 - 42), "e"))
    assert "As Slurm listed them 42s ago" in " ".join(p.text)
    assert "replicas placed since" not in " ".join(p.text)
    # The one duration formatter, as `llmgw-admin status` writes it.
    p = Text()
    p.feed(render_page(status(nodes_listed_at=1.7e9 - 300), "e"))
    assert "As Slurm listed them 5m00s ago" in " ".join(p.text)


def test_page_says_when_the_services_own_replicas_are_counted_in() -> None:
    st = status(nodes_listed_at=1.7e9 - 42)
    st["nodes"][0].update(gpus_free=1, gpus_free_listed=3, gpus_placed_since_listing=2)
    p = Text()
    p.feed(render_page(st, "e"))
    text = " ".join(p.text)
    assert "GPUs free counts this service's replicas placed since" in text
    assert "1/4" in text and "3/4" not in text


def test_everything_from_outside_is_escaped() -> None:
    html = render_page(status(), "http://gw:8000/v1?<b>")
    p = Text()
    p.feed(html)
    assert "script" not in p.tags and "b" not in p.tags
    assert EVIL in " ".join(p.text)  # shown as text, literally
    assert "<script>" not in html


def test_stale_warning_and_empty_catalog() -> None:
    html = render_page(
        status(models=[], decisions=[], nodes=[], last_pass_error="squeue: <x>"), "e"
    )
    assert "The catalog has no models." in html and "No decisions yet." in html
    assert re.search(r"may be stale: squeue: &lt;x&gt;", html)


class Markup(HTMLParser):
    """Every tag and attribute the page holds."""

    def __init__(self) -> None:
        super().__init__()
        self.tags: set[str] = set()
        self.attrs: list[tuple[str, str | None]] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.add(tag)
        self.attrs.extend(attrs)


def test_a_hostile_value_in_any_field_is_shown_as_text() -> None:
    """Model names, aliases, states, reasons, node names: each could carry markup."""
    evil = EVIL + '" onload="x'
    st = status(version=evil, passes=evil, last_pass_error=evil)
    model = st["models"][0]
    model.update(name=evil, aliases=[evil], state=evil, state_text=evil, note=evil, min=evil)
    model["replicas"][0].update(id=evil, job_id=evil, state=evil, nodes=[evil], step=evil)
    st["decisions"][0].update(action=evil, model=evil, replica=evil, reason=evil)
    st["nodes"][0].update(name=evil, state=evil, reason=evil, partitions=[evil])
    st["nodes"][0].update(gpus_free=evil, gpus_total=evil)
    html = render_page(st, evil)
    m = Markup()
    m.feed(html)
    allowed = {"html", "head", "meta", "title", "style", "body", "h1", "h2", "p", "code"}
    assert m.tags <= allowed | {"table", "tr", "th", "td", "strong", "span"}
    assert {name for name, _ in m.attrs} <= {
        "lang",
        "charset",
        "http-equiv",
        "content",
        "name",
        "class",
    }
    classes = {v for name, v in m.attrs if name == "class"}
    # A state that is not one of the words gets no class ("").
    assert classes <= {"model", "replica", "queued", "muted", "error", ""}
    t = Text()
    t.feed(html)
    text = " ".join(t.text)
    # Each field's value arrives whole, as text: the test would not see a
    # field that was dropped instead of escaped as escaped.
    assert text.count(evil) == 24
