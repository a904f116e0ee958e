"""``llmgw login``, ``llmgw logout`` and ``llmgw keys``: a user's own API keys.

``login`` proves who the user is with a munge credential (the cluster's own
identity, which Slurm uses too) and writes the key the daemon issues to the
user's config file (mode 0600), where every other command finds it. The
credential is sent only to a server that proved it is the daemon, as any
other secret: within its time to live it is worth a key to whoever holds it.
"""

from __future__ import annotations

import os
import re
import time
from pathlib import Path
from typing import Any

import click
import yaml

from llmgw_slurm.auth import munge
from llmgw_slurm.base.errors import LlmgwError
from llmgw_slurm.base.fsutil import atomic_write
from llmgw_slurm.cli import settings as r
from llmgw_slurm.cli.common import print_json, run, table

_KEY_ID = re.compile(r"^llmgw-([0-9a-f]{8})-")


def _write_config(path: Path, values: dict[str, str]) -> None:
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    text = yaml.safe_dump(values, default_flow_style=False, sort_keys=True)
    # 0600 from the start: the key is never readable by others, not even briefly.
    atomic_write(path, text, mode=0o600)


def _key_id(key: str) -> str:
    m = _KEY_ID.match(key)
    if m is None:
        raise click.ClickException(
            "the API key is not one of llmgw's (llmgw-<id>-<secret>); check --key, "
            "LLMGW_API_KEY or api_key in " + str(r.config_path())
        )
    return m.group(1)


def _need_key(s: r.Settings) -> str:
    if not s.key:
        raise click.ClickException(
            f"no API key: run `llmgw login` first (or set --key, LLMGW_API_KEY, or api_key in "
            f"{r.config_path()})"
        )
    return s.key


def _gateway_auth(s: r.Settings) -> dict[str, bool]:
    """Whether the gateway takes keys and offers ``llmgw login`` (its status says;
    a daemon too old to say is taken to offer both, and the login call decides)."""
    reply = run(s.call("GET", "/api/v1/status"))
    auth = reply.data.get("auth") if reply.ok and isinstance(reply.data, dict) else None
    if not isinstance(auth, dict):
        return {"keys": True, "login": True}
    return {"keys": bool(auth.get("keys")), "login": bool(auth.get("login"))}


@click.command()
@click.option(
    "--account",
    metavar="ACCOUNT",
    help="The Slurm account to charge (default: your default account in Slurm).",
)
@click.option(
    "--munge-socket",
    envvar="LLMGW_MUNGE_SOCKET",
    metavar="PATH",
    help="munged's socket, if not at munge's default place (env LLMGW_MUNGE_SOCKET).",
)
@click.pass_context
def login(ctx: click.Context, account: str | None, munge_socket: str | None) -> None:
    """Get an API key of your own, proven by munge.

    Works on any host of the cluster (munged runs there). The key is shown
    nowhere: it goes to ~/.config/llmgw/config.yaml (mode 0600), where llmgw
    and your own code's settings can read it (`llmgw keys` lists yours).
    On a gateway without API keys there is nothing to do: it says so, exit 0.

    \b
    Examples:
      llmgw login
      llmgw login --account proj42
    """
    s = r._get(ctx)
    auth = _gateway_auth(s)
    if not auth["keys"]:
        click.echo(
            f"{s.url} needs no key: it has no API keys (anyone who reaches it may use it), "
            "so llmgw and your own code work as they are.",
            err=True,
        )
        return
    if not auth["login"]:
        raise click.ClickException(_login_off(s))
    s.guard("your munge credential")
    try:
        credential = run(munge.encode(Path(munge_socket) if munge_socket else None))
    except LlmgwError as exc:
        raise click.ClickException(str(exc)) from None
    body: dict[str, str] = {"credential": credential}
    if account:
        body["account"] = account
    reply = run(s.call("POST", "/api/v1/login", body=body))
    data = reply.data if isinstance(reply.data, dict) else {}
    if not reply.ok or not isinstance(data.get("key"), str):
        if reply.status == 404:
            raise click.ClickException(_login_off(s))
        raise click.ClickException(f"login refused: {reply.error_message()}")
    path = r.config_path()
    values = r._read_config(path)
    values["api_key"] = data["key"]
    if s.source == "--url or LLMGW_URL":
        values["url"] = s.url
    if s.ca_file:
        values["ca_file"] = s.ca_file
    _write_config(path, values)
    click.echo(
        f"Logged in as {data.get('user')} (Slurm account {data.get('account')}): "
        f"key {data.get('key_id')} saved in {path}"
    )


def _login_off(s: r.Settings) -> str:
    return (
        f"login is off on the gateway at {s.url} (login.enabled in its server.yaml): "
        "ask the admin for a key (llmgw-admin keys add YOU), then set LLMGW_API_KEY"
    )


@click.command()
@click.pass_context
def logout(ctx: click.Context) -> None:
    """Revoke the key in use; remove it from your config.

    \b
    Example:
      llmgw logout
    """
    s = r._get(ctx)
    key = _need_key(s)
    key_id = _key_id(key)
    _own_keys_offered(s)
    s.guard("your API key")
    reply = run(s.call("DELETE", f"/api/v1/keys/{key_id}", token=key))
    # A key the daemon no longer takes (revoked elsewhere) is still removed here.
    if not reply.ok and reply.status != 401:
        raise click.ClickException(f"the daemon refused: {reply.error_message()}")
    path = r.config_path()
    values = r._read_config(path)
    if values.get("api_key") == key:
        del values["api_key"]
        _write_config(path, values)
        click.echo(f"Key {key_id} revoked and removed from {path}.")
    else:
        click.echo(f"Key {key_id} revoked.")
    if os.environ.get("LLMGW_API_KEY") == key:
        click.echo("LLMGW_API_KEY still holds it: unset it.")


def _own_keys_offered(s: r.Settings) -> None:
    """Refuse (ClickException) unless the gateway has the routes of one's own keys,
    which only a gateway with login has."""
    auth = _gateway_auth(s)
    if not auth["keys"]:
        raise click.ClickException(f"{s.url} has no API keys: there is no key to revoke")
    if not auth["login"]:
        raise click.ClickException(
            f"the gateway at {s.url} keeps keys but not `llmgw login` (login.enabled is "
            "off): your keys are the admin's to list and revoke (llmgw-admin keys)"
        )


def _keys_reply(s: r.Settings, method: str, path: str) -> Any:
    _own_keys_offered(s)
    key = _need_key(s)
    s.guard("your API key")
    reply = run(s.call(method, path, token=key))
    if not reply.ok:
        raise click.ClickException(reply.error_message())
    return reply.data


@click.group(invoke_without_command=True)
@click.option("--json", "as_json", is_flag=True, help="Print JSON for scripts.")
@click.pass_context
def keys(ctx: click.Context, as_json: bool) -> None:
    """List your API keys (revoke one with `keys revoke`).

    On a gateway without API keys the list is empty (exit 0; it says why on
    standard error).

    \b
    Examples:
      llmgw keys
      llmgw keys --json | jq -r '.keys[] | select(.revoked == null) | .key_id'
      llmgw keys revoke 0a1b2c3d
    """
    if ctx.invoked_subcommand is not None:
        return
    s = r._get(ctx)
    if not _gateway_auth(s)["keys"]:
        click.echo(f"{s.url} has no API keys: there are none to list.", err=True)
        if as_json:
            print_json({"user": None, "keys": []})
        return
    data = _keys_reply(s, "GET", "/api/v1/keys")
    if as_json:
        print_json(data)
        return
    rows = [
        (
            k.get("key_id"),
            k.get("account") or "-",
            _when(k.get("created")),
            "revoked " + _when(k.get("revoked")) if k.get("revoked") else "active",
            "(this one)" if k.get("current") else "",
        )
        for k in data.get("keys", [])
    ]
    click.echo(table(("KEY ID", "ACCOUNT", "CREATED", "STATE", ""), rows))


def _when(ts: object) -> str:
    if not isinstance(ts, (int, float)):
        return "-"
    return time.strftime("%Y-%m-%d %H:%M", time.localtime(ts))


@keys.command("revoke")
@click.argument("key_id")
@click.pass_context
def keys_revoke(ctx: click.Context, key_id: str) -> None:
    """Revoke your key KEY_ID (as `llmgw keys` lists it).

    \b
    Example:
      llmgw keys revoke 0a1b2c3d
    """
    if not re.fullmatch(r"[0-9a-f]{8}", key_id):
        raise click.BadParameter(
            f"{key_id!r} is not a key id (8 hex digits, as `llmgw keys` shows)"
        )
    _keys_reply(r._get(ctx), "DELETE", f"/api/v1/keys/{key_id}")
    click.echo(f"Key {key_id} revoked.")
