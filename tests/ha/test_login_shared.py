"""``llmgw login`` through either gateway: one set of keys, one cap per user, and a
clear 503 for a new login on a gateway that has lost the database (its known keys
keep working).

Real munge and slurmdbd (the dev cluster's), real other Unix users, as
tests/slurm/test_login.py does.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from psycopg import conninfo as pgconninfo

from tests.ha.conftest import PgDatabase
from tests.ha.peers import Peer, Peers
from tests.ha.proxy import Proxy
from tests.hostile_user import world_dir
from tests.slurm.conftest import eventually
from tests.slurm.harness import tiny_model
from tests.slurm.test_login import ALICE, associations, login, munge_socket

pytestmark = [pytest.mark.ha]
__all__ = ["associations"]  # the fixture, used by name

IDLE = tiny_model("idle", scaling={"min": 0, "max": 1})


def get(p: Peer, path: str, key: str) -> tuple[int, dict[str, object]]:
    req = urllib.request.Request(p.url + path, headers={"Authorization": f"Bearer {key}"})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, json.load(r)
    except urllib.error.HTTPError as e:
        return e.code, json.load(e)


async def test_logins_through_both_gateways_share_keys_and_the_cap(
    pgdb: PgDatabase, associations: None
) -> None:
    port = int(pgconninfo.conninfo_to_dict(pgdb.dsn)["port"])
    proxy = Proxy(port)
    await proxy.start()
    with world_dir() as top:
        login_cfg = {
            "enabled": True,
            "munge_socket": str(munge_socket()),
            "max_keys_per_user": 2,
            "attempts_per_minute": 100,
        }
        peers = Peers.make(
            Path(top), "ha" + secrets.token_hex(3) + ".", pgdb, [IDLE], login=login_cfg
        )
        a, b = peers[0], peers[1]
        assert a.db is not None
        a.db["dsn"] = pgconninfo.make_conninfo(pgdb.dsn, port=proxy.port)
        a.write(Path(top))
        try:
            peers.start()
            await peers.leader()
            for p in peers.peers:
                await eventually(lambda p=p: asyncio.to_thread(p.get, "/healthz"), f"{p.name} up")
            status, body, _ = await login(ALICE, a.url)
            assert status == 200, body
            key = str(body["key"])

            # Made on a, known on b (its copy of the keys, no restart).
            async def listed_on_b() -> bool:
                code, keys = await asyncio.to_thread(get, b, "/api/v1/keys", key)
                return code == 200 and len(keys["keys"]) == 1  # type: ignore[arg-type]

            await eventually(listed_on_b, "a's new key to work on b", 10)
            status, body, _ = await login(ALICE, b.url)
            assert status == 200, body
            # The cap counts both gateways' logins.
            status, body, _ = await login(ALICE, a.url)
            assert (status, body["error"]["code"]) == (409, "too_many_keys"), body  # type: ignore[index]

            # a loses the database: a new login there is a clear 503; its known key works.
            await proxy.cut()
            status, body, _ = await login(ALICE, a.url)
            assert (status, body["error"]["code"]) == (503, "keys_unavailable"), body  # type: ignore[index]
            code, models = await asyncio.to_thread(get, a, "/v1/models", key)
            assert code == 200 and [m["id"] for m in models["data"]] == ["idle"], models  # type: ignore[index]
        finally:
            peers.stop()
            peers.cancel_all()
            await proxy.cut()
