"""Model access by user, Unix group and Slurm account (issue 18, item 3)."""

from __future__ import annotations

import os
import textwrap
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import aiohttp
import openai
import pytest
from _router_support import engine, serve
from prometheus_client import CollectorRegistry

from llmgw_slurm.auth.access import GROUPS_TTL, AccessGuard, unix_groups
from llmgw_slurm.auth.keys import KeyRecord, KeyRing, add_key
from llmgw_slurm.auth.tls import PinnedContexts, make_identity
from llmgw_slurm.base.errors import ConfigError
from llmgw_slurm.catalog import Access, Catalog, load_catalog
from llmgw_slurm.reconciler.directory import ReplicaDirectory
from llmgw_slurm.reconciler.replicas import ReplicaTable
from llmgw_slurm.reconciler.spans import ReconcileTracing
from llmgw_slurm.router import (
    GATEWAY_KEY,
    Endpoint,
    Gateway,
    ModelInfo,
    StaticDirectory,
    create_app,
)

# ---- the catalog ------------------------------------------------------------------------


def catalog_errors(tmp_path: Path, text: str) -> list[str]:
    p = tmp_path / "models.yaml"
    p.write_text(textwrap.dedent(text))
    with pytest.raises(ConfigError) as e:
        load_catalog(p)
    return [ln.replace(str(p), "F") for ln in str(e.value).splitlines()]


MODEL = "  - name: {name}\n    engine: {{kind: command, command: [x]}}\n"


def test_access_rules_load_and_merge_under_defaults(tmp_path: Path) -> None:
    p = tmp_path / "models.yaml"
    p.write_text(
        "defaults:\n  access: {groups: [hpc]}\nmodels:\n"
        + MODEL.format(name="a")
        + "    access: {users: [alice], accounts: [t18phys]}\n"
        + MODEL.format(name="b")
    )
    a, b = load_catalog(p).models
    assert a.access == Access(users=("alice",), groups=("hpc",), accounts=("t18phys",))
    assert b.access == Access(groups=("hpc",))


def test_no_access_block_is_everyone(tmp_path: Path) -> None:
    p = tmp_path / "models.yaml"
    p.write_text("models:\n" + MODEL.format(name="a"))
    assert load_catalog(p).models[0].access is None


def test_bad_access_rules_say_file_line_and_what_is_valid(tmp_path: Path) -> None:
    text = (
        "models:\n"
        + MODEL.format(name="a")
        + "    access: {users: [alice], grups: [x]}\n"
        + MODEL.format(name="b")
        + "    access: {users: ['bad name'], accounts: [ok]}\n"
        + MODEL.format(name="c")
        + "    access: {}\n"
        + MODEL.format(name="d")
        + "    access: [alice]\n"
    )
    assert catalog_errors(tmp_path, text) == [
        "F:4: models[0].access.grups: unknown key 'grups'; did you mean 'groups'? "
        "(valid keys: accounts, groups, users)",
        "F:7: models[1].access.users[0]: 'bad name' is not valid: expected a user or group "
        "name: letters, digits, '_', '.', '@', '-'",
        "F:10: models[2].access.users: an access block that names nobody lets nobody in; "
        "list users, groups or accounts, or leave access out for everyone",
        "F:13: models[3].access: expected a mapping with keys users, groups, accounts; got a list",
    ]


# ---- the guard --------------------------------------------------------------------------


def key(user: str, account: str = "") -> KeyRecord:
    return KeyRecord("0000000" + user[0], user, account, "0" * 64, 0.0)


def test_a_key_is_let_in_by_user_group_or_account() -> None:
    guard = AccessGuard(CollectorRegistry(), groups_of=lambda u: frozenset({f"{u}-grp", "all"}))
    rules = Access(users=("alice",), groups=("bob-grp",), accounts=("t18phys",))
    assert guard.allows(rules, key("alice"))
    assert guard.allows(rules, key("bob"))
    assert guard.allows(rules, key("carol", "t18phys"))
    assert not guard.allows(rules, key("carol", "t18chem"))
    assert guard.allows(None, key("carol")) and guard.allows(None, None)
    # Without keys nobody is known: a model with rules is nobody's.
    assert not guard.allows(rules, None)


def test_groups_are_cached_for_a_while() -> None:
    calls: list[str] = []
    now = [0.0]

    def groups_of(user: str) -> frozenset[str]:
        calls.append(user)
        return frozenset({"g"})

    guard = AccessGuard(CollectorRegistry(), groups_of=groups_of, clock=lambda: now[0])
    rules = Access(groups=("g",))
    assert guard.allows(rules, key("alice")) and guard.allows(rules, key("alice"))
    assert calls == ["alice"]
    now[0] += GROUPS_TTL + 1
    assert guard.allows(rules, key("alice"))
    assert calls == ["alice", "alice"]


def test_unix_groups_of_a_real_user_and_of_a_name_that_is_none() -> None:
    import grp
    import pwd

    me = pwd.getpwuid(os.getuid())
    assert grp.getgrgid(me.pw_gid).gr_name in unix_groups(me.pw_name)
    assert unix_groups("t18-no-such-user") == frozenset()


def test_the_replica_directory_reads_the_current_catalogs_rules(tmp_path: Path) -> None:
    p = tmp_path / "models.yaml"
    p.write_text("models:\n" + MODEL.format(name="a") + "    access: {users: [alice]}\n")
    table = ReplicaTable(load_catalog(p), lambda: 0.0, ReconcileTracing(None, False))
    d = ReplicaDirectory(table, b"k" * 32, PinnedContexts(make_identity(tmp_path, "gw", "gw", 1)))
    assert d.access("a") == Access(users=("alice",))
    # A reload replaces the catalog: the next request sees the narrower rules.
    p.write_text("models:\n" + MODEL.format(name="a") + "    access: {users: [bob]}\n")
    table.catalog = load_catalog(p)
    assert d.access("a") == Access(users=("bob",))
    table.catalog = Catalog(models=())
    assert d.access("a") is None


# ---- the gateway ------------------------------------------------------------------------


@asynccontextmanager
async def gateway(tmp_path: Path) -> AsyncIterator[tuple[str, Gateway, dict[str, str]]]:
    keyfile = tmp_path / "keys.json"
    keys = {
        "alice": add_key(keyfile, "alice", "t18phys").key,
        "bob": add_key(keyfile, "bob", "t18chem").key,
    }
    directory = StaticDirectory([ModelInfo("open"), ModelInfo("phys", aliases=("physics",))])
    directory.rules["phys"] = Access(accounts=("t18phys",))
    app = create_app(directory, keys=KeyRing(keyfile))
    async with engine("phys", key="k0") as eurl, serve(app) as url:
        directory.add_endpoint("phys", Endpoint("r0", eurl, "k0"))
        yield url, app[GATEWAY_KEY], keys


async def test_models_lists_only_what_the_key_may_use(tmp_path: Path) -> None:
    async with gateway(tmp_path) as (url, _, keys):
        ids = {}
        for who in ("alice", "bob"):
            async with openai.AsyncOpenAI(api_key=keys[who], base_url=url + "/v1") as c:
                ids[who] = {m.id for m in (await c.models.list()).data}
    assert ids == {"alice": {"open", "phys", "physics"}, "bob": {"open"}}


async def test_a_forbidden_model_is_the_same_404_as_an_unknown_one(tmp_path: Path) -> None:
    async with gateway(tmp_path) as (url, gw, keys):
        async with openai.AsyncOpenAI(api_key=keys["alice"], base_url=url + "/v1") as c:
            out = await c.completions.create(model="physics", prompt="a b", max_tokens=2)
            assert out.choices[0].text
        bodies = {}
        async with aiohttp.ClientSession() as s:
            for name in ("phys", "physics", "nothing-like-it"):
                r = await s.post(
                    url + "/v1/completions",
                    json={"model": name, "prompt": "a"},
                    headers={"Authorization": f"Bearer {keys['bob']}"},
                )
                assert r.status == 404
                bodies[name] = (await r.json())["error"]
        assert bodies["phys"]["code"] == bodies["nothing-like-it"]["code"] == "model_not_found"
        assert bodies["phys"]["message"] == "The model 'phys' does not exist. Known models: open."
        assert bodies["nothing-like-it"]["message"].endswith("Known models: open.")
        # The admin sees the refusals.
        assert gw.access.denied.labels("phys")._value.get() == 2


async def test_metrics_name_a_restricted_model_only_to_who_may_use_it(tmp_path: Path) -> None:
    from llmgw_slurm.auth.secrets import AdminToken, rotate_admin_token
    from llmgw_slurm.router.metrics import tokens_gate

    async with gateway(tmp_path) as (url, gw, keys):
        async with openai.AsyncOpenAI(api_key=keys["alice"], base_url=url + "/v1") as c:
            await c.completions.create(model="phys", prompt="a b", max_tokens=2)
        async with aiohttp.ClientSession() as s:
            await s.post(url + "/v1/completions", json={"model": "phys", "prompt": "a"},
                         headers={"Authorization": f"Bearer {keys['bob']}"})  # fmt: skip
        scrape = tmp_path / "metrics.token"
        rotate_admin_token(scrape)
        gw.metrics_token = tokens_gate(AdminToken(tmp_path / "none"), AdminToken(scrape))
        texts = {}
        async with aiohttp.ClientSession() as s:
            for who, auth in (
                ("anyone", None),
                ("bob", keys["bob"]),
                ("alice", keys["alice"]),
                ("scraper", scrape.read_text().strip()),
                ("a wrong token", "llmgw-admin-nope"),
            ):
                headers = {"Authorization": f"Bearer {auth}"} if auth else {}
                async with s.get(url + "/metrics", headers=headers) as r:
                    assert r.status == 200
                    texts[who] = await r.text()
    # Its requests, its tokens, its replicas and the refusals of it: all name it.
    for who in ("anyone", "bob", "a wrong token"):
        assert 'model="phys"' not in texts[who] and "phys" not in texts[who], who
        assert 'llmgw_replicas{model="open"' in texts[who]  # what they may see stays
    for who in ("alice", "scraper"):
        assert 'llmgw_requests_total{model="phys",status="200"} 1.0' in texts[who], who
    assert 'llmgw_access_denied_total{model="phys"} 1.0' in texts["scraper"]


async def test_narrower_rules_hold_from_the_next_request(tmp_path: Path) -> None:
    async with (
        gateway(tmp_path) as (url, gw, keys),
        openai.AsyncOpenAI(api_key=keys["alice"], base_url=url + "/v1", max_retries=0) as c,
    ):
        await c.completions.create(model="phys", prompt="a", max_tokens=1)
        gw.directory.rules["phys"] = Access(users=("bob",))  # type: ignore[attr-defined]
        with pytest.raises(openai.NotFoundError):
            await c.completions.create(model="phys", prompt="a", max_tokens=1)


async def test_other_routes_learn_the_callers_user_and_account(tmp_path: Path) -> None:
    from aiohttp import web

    from llmgw_slurm.router import request_key

    keyfile = tmp_path / "keys.json"
    k = add_key(keyfile, "alice", "t18phys").key
    app = create_app(StaticDirectory(), keys=KeyRing(keyfile))

    async def mine(request: web.Request) -> web.Response:
        _, denied = app[GATEWAY_KEY].authenticate(request)
        if denied is not None:
            return denied
        rec = request_key(request)
        assert rec is not None
        return web.json_response({"user": rec.user, "account": rec.project})

    app.router.add_get("/v1/mine", mine)
    async with serve(app) as url, aiohttp.ClientSession() as s:
        r = await s.get(url + "/v1/mine", headers={"Authorization": f"Bearer {k}"})
        assert await r.json() == {"user": "alice", "account": "t18phys"}
        r = await s.get(url + "/v1/mine")
        assert r.status == 401
