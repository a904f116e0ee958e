"""``llmgw``: what a researcher runs to find, start and try models.

Where the daemon is, and the API key, come from (first found wins): the
``--url``/``--key`` options, the ``LLMGW_URL``/``LLMGW_API_KEY`` environment
variables, then ``~/.config/llmgw/config.yaml`` (``url:`` and ``api_key:``;
``$XDG_CONFIG_HOME`` is honoured). Without any, the gateway's default address
on this host.

Before the CLI sends a key or a prompt, the server must prove it is the
daemon (:mod:`llmgw_slurm.identity`): over https its certificate (``--ca-file``
/ ``LLMGW_CA_FILE`` / ``ca_file:`` for a private CA); over plain http only on
this host, where the kernel says which user holds the port (checked against
the daemon's ``daemon.json``: ``LLMGW_DAEMON_INFO``, default
``/run/llmgw-slurm/daemon.json``). Anything else is refused with the fix.

Shell completion is click's: ``eval "$(_LLMGW_COMPLETE=bash_source llmgw)"``
(``zsh_source``, ``fish_source`` for other shells).
"""

from __future__ import annotations

import asyncio
import sys
import time
from typing import Any

import click

from llmgw_slurm import __version__
from llmgw_slurm.cli import login as login_commands
from llmgw_slurm.cli.batch import SETTINGS_KEY
from llmgw_slurm.cli.batch import batch as batch_commands
from llmgw_slurm.cli.common import DaemonReply, call_daemon, parse_when, print_json, run, table
from llmgw_slurm.cli.settings import (
    DEFAULT_URL,
    Settings,
    _get,
)
from llmgw_slurm.durations import format_duration


def _check_url(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    # A URL given on the command line (or in LLMGW_URL) is a usage error, told
    # before anything runs; one from the config file is checked in _settings.
    if value and not value.startswith(("http://", "https://")):
        raise click.BadParameter(f"{value!r} must start with http:// or https://")
    return value


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="llmgw")
@click.option(
    "--url",
    envvar="LLMGW_URL",
    metavar="URL",
    callback=_check_url,
    help=f"The gateway, e.g. http://login1:8000 (env LLMGW_URL; default {DEFAULT_URL}).",
)
@click.option(
    "--key", envvar="LLMGW_API_KEY", metavar="KEY", help="Your API key (env LLMGW_API_KEY)."
)
@click.option(
    "--ca-file",
    envvar="LLMGW_CA_FILE",
    metavar="PEM",
    help="CA certificates to verify an https gateway with (env LLMGW_CA_FILE).",
)
@click.pass_context
def main(ctx: click.Context, url: str | None, key: str | None, ca_file: str | None) -> None:
    """Use the site's LLMs through the llmgw-slurm gateway.

    \b
    Settings: --url/--key, env LLMGW_URL/LLMGW_API_KEY, or
    ~/.config/llmgw/config.yaml with `url:` and `api_key:`.
    Shell completion: eval "$(_LLMGW_COMPLETE=bash_source llmgw)"
    """
    # Read lazily: `llmgw --help` must work with a broken config file.
    ctx.obj = (url, key, ca_file)
    # How `llmgw batch` (cli/batch.py, which cannot import this module back) gets them.
    ctx.meta[SETTINGS_KEY] = lambda: _get(ctx)


main.add_command(batch_commands)
for _cmd in (login_commands.login, login_commands.logout, login_commands.keys):
    main.add_command(_cmd)


async def _status(s: Settings) -> dict[str, Any]:
    # With a key, the models it may use (the catalog's access rules) are listed
    # too; the key goes only to a server that proved it is the daemon, and
    # without that proof the listing is everyone's (models open to all).
    token = None
    if s.key:
        try:
            s.guard("your API key")
            token = s.key
        except click.ClickException:
            token = None
    reply = await call_daemon("GET", s.url, "/api/v1/status", token=token, ssl=s.ssl_context())
    if not reply.ok or not isinstance(reply.data, dict) or "models" not in reply.data:
        raise click.ClickException(
            f"{s.url} did not answer the status request ({reply.error_message()}); "
            "is it the llmgw gateway?"
        )
    return reply.data


def _model_names(status: dict[str, Any]) -> list[str]:
    return [str(m.get("name")) for m in status.get("models", [])]


def _find_model(status: dict[str, Any], name: str) -> dict[str, Any]:
    for m in status.get("models", []):
        if m.get("name") == name or name in (m.get("aliases") or []):
            return dict(m)
    raise click.ClickException(
        f"unknown model {name!r}; known: {', '.join(_model_names(status)) or 'none'}"
    )


def _complete_model(ctx: click.Context, _: click.Parameter, incomplete: str) -> list[str]:
    """Model names for shell completion; nothing (not an error) if the daemon is away."""
    try:
        s = _get(ctx)
        status = run(_status(s))
    except (click.ClickException, OSError):
        return []
    names = []
    for m in status.get("models", []):
        names += [str(m.get("name")), *map(str, m.get("aliases") or [])]
    return [n for n in names if n.startswith(incomplete)]


# ---- models -----------------------------------------------------------------------


@main.command()
@click.option("--json", "as_json", is_flag=True, help="Print JSON for scripts.")
@click.pass_context
def models(ctx: click.Context, as_json: bool) -> None:
    """Every model: aliases, state, GPUs, and the endpoint to use."""
    s = _get(ctx)
    status = run(_status(s))
    endpoint = s.url + "/v1"
    if as_json:
        print_json(
            [
                {
                    "name": m.get("name"),
                    "aliases": m.get("aliases") or [],
                    "state": m.get("state"),
                    "note": m.get("note") or "",
                    "gpus": m.get("gpus"),
                    "replicas": len(m.get("replicas") or []),
                    "endpoint": endpoint,
                }
                for m in status["models"]
            ]
        )
        return
    rows = [
        (
            m.get("name"),
            ", ".join(m.get("aliases") or []) or "-",
            m.get("state"),
            m.get("gpus"),
        )
        for m in status["models"]
    ]
    if not rows:
        click.echo("The catalog has no models.")
        return
    click.echo(table(("MODEL", "ALIASES", "STATE", "GPUS"), rows))
    notes = [(m.get("name"), m.get("note")) for m in status["models"] if m.get("note")]
    if notes:
        click.echo()
        for name, note in notes:
            click.echo(f"{name}: {note}")
    click.echo(f"\nEndpoint (OpenAI API): {endpoint}")
    click.echo("Start one: llmgw up MODEL    Try one: llmgw chat MODEL 'hello'")


# ---- up ---------------------------------------------------------------------------

_STEP_WORDS = {
    "weights": "fetching weights",
    "rendezvous": "waiting for the other nodes",
    "engine_launch": "launching the engine",
    "readiness": "loading the engine",
    "drain": "draining",
}


def _phase(model: dict[str, Any]) -> str:
    """What a person waiting for ``model`` wants to read now."""
    state = str(model.get("state") or "")
    if state.startswith("ready"):
        return "ready"
    reps = model.get("replicas") or []
    running = [r for r in reps if r.get("state") in ("starting", "ready")]
    if running:
        step = str(running[0].get("step") or "")
        word, _, status = step.partition(" ")
        if status == "failed":
            return f"{_STEP_WORDS.get(word, word)} failed"
        return _STEP_WORDS.get(word, "job started") if word else "job started"
    pending = [r for r in reps if r.get("state") == "pending"]
    if pending:
        reason = pending[0].get("reason")
        return f"queued ({reason})" if reason else "queued"
    if state in ("backoff", "failing"):
        return state + (f": {model['note']}" if model.get("note") else "")
    return "requested"


async def _wait_up(s: Settings, name: str, timeout: float, live: bool) -> dict[str, Any]:
    # Aliases may hold a "/", which a URL path cannot carry: ask by the canonical name.
    canonical = str(_find_model(await _status(s), name)["name"])
    if s.key:
        s.guard("your API key")
    reply = await call_daemon(
        "POST", s.url, f"/api/v1/models/{canonical}/up", token=s.key, ssl=s.ssl_context()
    )
    if not reply.ok:
        raise click.ClickException(f"the daemon refused the start: {reply.error_message()}")
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    last_phase = ""
    last_want = t0
    while True:
        now = loop.time()
        # The daemon keeps a start going while someone wants the model; say so again
        # now and then, or a long queue wait would look like nobody is waiting.
        if now - last_want > 20:
            await call_daemon(
                "POST", s.url, f"/api/v1/models/{canonical}/up", token=s.key, ssl=s.ssl_context()
            )
            last_want = now
        status = await _status(s)
        model = _find_model(status, canonical)
        phase = _phase(model)
        elapsed = format_duration(now - t0)
        if phase != last_phase:
            if live and last_phase:
                click.echo()
            if not live:
                click.echo(f"[{elapsed:>6}] {phase}")
            last_phase = phase
        if live:
            click.echo(f"\r\x1b[K[{elapsed:>6}] {phase}", nl=False)
        if phase == "ready":
            if live:
                click.echo()
            return model
        if str(model.get("state")) == "failing":
            if live:
                click.echo()
            raise click.ClickException(
                f"{canonical} is failing to start: {model.get('note') or 'see llmgw models'}"
            )
        if now - t0 > timeout:
            if live:
                click.echo()
            raise click.ClickException(
                f"{canonical} is not ready after {format_duration(now - t0)} ({phase}); it goes on "
                "starting: watch it with `llmgw models`"
            )
        await asyncio.sleep(1.0)


@main.command()
@click.argument("model", shell_complete=_complete_model)
@click.option(
    "--timeout",
    default=1800.0,
    show_default=True,
    type=click.FloatRange(min=0),
    help="Seconds to wait.",
)
@click.pass_context
def up(ctx: click.Context, model: str, timeout: float) -> None:
    """Ask for MODEL to be started and wait until it is ready.

    Shows each step (queued, fetching weights, loading the engine, ready) with
    the time since the request. Ctrl-C stops waiting; the start goes on.
    """
    s = _get(ctx)
    live = sys.stdout.isatty()
    try:
        got = run(_wait_up(s, model, timeout, live))
    except KeyboardInterrupt:
        click.echo(
            f"\nStopped waiting; {model} goes on starting (`llmgw models` shows it).", err=True
        )
        sys.exit(130)
    click.echo(f"{got.get('name')} is ready: {s.url}/v1 (model {got.get('name')!r})")


# ---- chat -------------------------------------------------------------------------


@main.command()
@click.argument("model", shell_complete=_complete_model)
@click.argument("prompt", required=False)
@click.option("--system", help="A system message.")
@click.option("--max-tokens", type=click.IntRange(min=1), default=256, show_default=True)
@click.option("--temperature", type=click.FloatRange(min=0, max=2), default=None)
@click.option(
    "--timeout",
    default=900.0,
    show_default=True,
    type=click.FloatRange(min=1),
    help="Seconds to wait for an answer (a cold model starts first).",
)
@click.pass_context
def chat(
    ctx: click.Context,
    model: str,
    prompt: str | None,
    system: str | None,
    max_tokens: int,
    temperature: float | None,
    timeout: float,
) -> None:
    """Send PROMPT (or standard input) to MODEL and stream the answer.

    Goes through the gateway with the openai client, as your own code would;
    a model that is not running is started first (the gateway holds the request).
    """
    try:
        import openai
    except ImportError:  # pragma: no cover - a dependency of the package
        raise click.ClickException("llmgw chat needs the openai package") from None
    s = _get(ctx)
    if prompt is None:
        if sys.stdin.isatty():
            click.echo("Type the prompt, then Ctrl-D:", err=True)
        prompt = sys.stdin.read()
    if not prompt.strip():
        raise click.UsageError("the prompt is empty")
    from openai.types.chat import ChatCompletionMessageParam

    messages: list[ChatCompletionMessageParam] = []
    if system:
        messages.append({"role": "system", "content": system})
    messages.append({"role": "user", "content": prompt})
    s.guard("your API key and prompt" if s.key else "your prompt")
    ctx_ssl = s.ssl_context()
    client = openai.OpenAI(
        base_url=s.url + "/v1",
        api_key=s.key or "no-key",
        http_client=openai.DefaultHttpxClient(verify=ctx_ssl) if ctx_ssl is not None else None,
        # The gateway holds a request for a cold model itself; retries would only
        # hide an unreachable daemon for longer.
        max_retries=0,
        timeout=timeout,
    )
    # The sentinel for "not sent" was renamed across openai releases.
    unset: Any = getattr(openai, "omit", None) or openai.NOT_GIVEN
    try:
        stream = client.chat.completions.create(
            model=model,
            messages=messages,
            max_tokens=max_tokens,
            stream=True,
            temperature=unset if temperature is None else temperature,
        )
        wrote = ""
        for chunk in stream:
            for choice in chunk.choices:
                text = choice.delta.content if choice.delta else None
                if text:
                    click.echo(text, nl=False)
                    wrote = text
        if not wrote.endswith("\n"):
            click.echo()
    except openai.APIConnectionError as exc:
        cause = exc.__cause__ or exc
        raise click.ClickException(f"cannot reach the llmgw daemon at {s.url}: {cause}") from None
    except openai.APIStatusError as exc:
        raise click.ClickException(f"{_api_message(exc)} (HTTP {exc.status_code})") from None
    except KeyboardInterrupt:
        click.echo()
        sys.exit(130)


def _api_message(exc: Any) -> str:
    body = getattr(exc, "body", None)
    if isinstance(body, dict):
        err = body.get("error", body)
        if isinstance(err, dict) and err.get("message"):
            return str(err["message"])
        if body.get("message"):
            return str(body["message"])
    return str(getattr(exc, "message", exc))


# ---- usage ------------------------------------------------------------------------


def _usage_whose(data: dict[str, Any], by: str) -> str:
    """Whose usage the daemon answered with, in words."""
    if data.get("scope") == "gateway":
        # Keys are off: usage is nobody's in particular, so the daemon gives
        # the gateway's totals.
        return "the whole gateway (it has no API keys)"
    if by == "user":
        return f"user {data.get('user')} (all keys)"
    if by == "account":
        return f"account {data.get('project')} (every key charged to it)"
    who = f"key {data.get('key_id')} ({data.get('user')}"
    return who + (f", project {data['project']})" if data.get("project") else ")")


@main.command()
@click.option("--since", default="30d", show_default=True, help="30m, 12h, 7d, 2w ago, or a date.")
@click.option(
    "--by",
    type=click.Choice(["key", "user", "account"]),
    default="key",
    show_default=True,
    help="This key's usage, all your keys', or your key's Slurm account's.",
)
@click.option("--json", "as_json", is_flag=True, help="Print JSON for scripts.")
@click.option("--chart", is_flag=True, help="Bar charts: tokens and requests by model.")
@click.option("--no-color", is_flag=True, help="Plain text (also when NO_COLOR is set).")
@click.pass_context
def usage(
    ctx: click.Context,
    since: str,
    by: str,
    as_json: bool,
    chart: bool = False,
    no_color: bool = False,
) -> None:
    """Your own token usage (counted per API key), by model.

    --by user: all your keys; --by account: every key charged to your key's
    Slurm account. On a gateway without API keys: the gateway's totals, by model.
    """
    s = _get(ctx)
    t0 = parse_when(since, time.time())
    if s.key:
        s.guard("your API key")
    reply: DaemonReply = run(
        call_daemon(
            "GET",
            s.url,
            "/api/v1/usage",
            token=s.key,
            params={"since": f"{t0:.0f}", "by": by},
            ssl=s.ssl_context(),
        )
    )
    if not reply.ok:
        raise click.ClickException(reply.error_message())
    data = reply.data if isinstance(reply.data, dict) else {}
    rows = data.get("models") or []
    if as_json:
        print_json(data)
        return
    click.echo(f"Usage of {_usage_whose(data, by)} since {since}:")
    if not rows:
        click.echo("no requests")
        return
    if chart:
        from llmgw_slurm.cli import charts

        lines = charts.usage_chart(rows, cols=charts.width(), color=charts.use_color(no_color))
        click.echo("\n".join(lines))
        return
    total = {
        k: sum(int(r.get(k) or 0) for r in rows)
        for k in ("requests", "prompt_tokens", "completion_tokens", "total_tokens")
    }
    click.echo(
        table(
            ("MODEL", "REQUESTS", "PROMPT TOKENS", "COMPLETION TOKENS", "TOTAL TOKENS"),
            [
                (
                    r.get("model"),
                    r.get("requests"),
                    r.get("prompt_tokens"),
                    r.get("completion_tokens"),
                    r.get("total_tokens"),
                )
                for r in rows
            ]
            + [
                (
                    "total",
                    total["requests"],
                    total["prompt_tokens"],
                    total["completion_tokens"],
                    total["total_tokens"],
                )
            ],
        )
    )
