"""``llmgw``: what a researcher runs to find, start and try models.

Where the daemon is, and the API key, come from (first found wins): the
``--url``/``--key`` options, the ``LLMGW_URL``/``LLMGW_API_KEY`` environment
variables, then ``~/.config/llmgw/config.yaml`` (``url:`` and ``api_key:``;
``$XDG_CONFIG_HOME`` is honoured). Without any, the gateway's default address
on this host. The URL may be given with or without the ``/v1`` that
``llmgw models`` prints as the OpenAI endpoint.

Before the CLI sends a key or a prompt, the server must prove it is the
daemon (:mod:`llmgw_slurm.auth.identity`): over https its certificate (``--ca-file``
/ ``LLMGW_CA_FILE`` / ``ca_file:`` for a private CA); over plain http only on
this host, where the kernel says which user holds the port (checked against
the daemon's ``daemon.json``: ``LLMGW_DAEMON_INFO``, default
``/run/llmgw-slurm/daemon.json``). Anything else is refused with the fix.

For scripts: every command that prints data takes ``--json``; what may wait
(``up``, ``chat`` on a model that is not running) shows its progress on
standard error; exit 0 is success, 1 a failure (one ``Error:`` line), 2 a
usage error, 130 Ctrl-C.

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
from llmgw_slurm.base.durations import format_duration
from llmgw_slurm.cli import login as login_commands
from llmgw_slurm.cli.batch import SETTINGS_KEY
from llmgw_slurm.cli.batch import batch as batch_commands
from llmgw_slurm.cli.common import (
    DaemonReply,
    iso_time,
    parse_when,
    print_json,
    run,
    table,
    token_totals,
)
from llmgw_slurm.cli.progress import (
    Progress,
    Watcher,
    fetch_status,
    find_model,
    model_json,
    phase,
)
from llmgw_slurm.cli.settings import DEFAULT_URL, Settings, _get, base_url

# The old names, for code that imported them from here.
_status, _find_model, _phase = fetch_status, find_model, phase


def _check_url(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    # A URL given on the command line (or in LLMGW_URL) is a usage error, told
    # before anything runs; one from the config file is checked in _settings.
    if value and not value.startswith(("http://", "https://")):
        raise click.BadParameter(f"{value!r} must start with http:// or https://")
    return base_url(value) if value else value


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="llmgw")
@click.option(
    "--url",
    envvar="LLMGW_URL",
    metavar="URL",
    callback=_check_url,
    help="The gateway, e.g. http://login1:8000, with or without /v1 "
    f"(env LLMGW_URL; default {DEFAULT_URL}).",
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
    Scripts: --json on every command that prints data; progress
    goes to stderr; exit 0 ok, 1 failed, 2 usage error, 130 Ctrl-C.
    Shell completion: eval "$(_LLMGW_COMPLETE=bash_source llmgw)"

    \b
    Examples:
      export LLMGW_URL=https://login1:8000
      llmgw models
      llmgw chat tiny "Hello"
      llmgw models --json | jq -r '.[] | select(.state == "ready") | .name'
    """
    # Read lazily: `llmgw --help` must work with a broken config file.
    ctx.obj = (url, key, ca_file)
    # How `llmgw batch` (cli/batch.py, which cannot import this module back) gets them.
    ctx.meta[SETTINGS_KEY] = lambda: _get(ctx)


main.add_command(batch_commands)
for _cmd in (login_commands.login, login_commands.logout, login_commands.keys):
    main.add_command(_cmd)


def _complete_model(ctx: click.Context, _: click.Parameter, incomplete: str) -> list[str]:
    """Model names for shell completion; nothing (not an error) if the daemon is away."""
    try:
        s = _get(ctx)
        status = run(fetch_status(s))
    except (click.ClickException, OSError):
        return []
    names = []
    for m in status.get("models", []):
        names += [str(m.get("name")), *map(str, m.get("aliases") or [])]
    return [n for n in names if n.startswith(incomplete)]


# ---- models -----------------------------------------------------------------------


def _replicas_text(m: dict[str, Any]) -> str:
    reps = m.get("replicas") or []
    return f"{int(m.get('ready_replicas') or 0)}/{len(reps)}" if reps else "-"


@main.command()
@click.option("--json", "as_json", is_flag=True, help="Print JSON for scripts.")
@click.pass_context
def models(ctx: click.Context, as_json: bool) -> None:
    """List the models, their state and the endpoint.

    STATE is one word (ready, starting, queued, backoff, failing, cold);
    REPLICAS counts the ready ones of all (ready/all). --json gives each model
    its state, reason (Slurm's, when queued), ready_replicas and description.

    \b
    Examples:
      llmgw models
      llmgw models --json | jq -r '.[] | select(.state == "ready") | .name'
      llmgw models --json | jq -r '.[0].endpoint'
    """
    s = _get(ctx)
    status = run(fetch_status(s))
    endpoint = s.url + "/v1"
    if as_json:
        print_json([model_json(m, endpoint) for m in status["models"]])
        return
    if not status["models"]:
        click.echo("The catalog has no models.")
        return
    rows = [
        (
            m.get("name"),
            ", ".join(m.get("aliases") or []) or "-",
            m.get("state_text") or m.get("state"),
            _replicas_text(m),
            m.get("gpus"),
            m.get("description") or "-",
        )
        for m in status["models"]
    ]
    heads = ("MODEL", "ALIASES", "STATE", "REPLICAS", "GPUS", "DESCRIPTION")
    click.echo(table(heads, rows, free_text=len(heads) - 1))
    notes = [(m.get("name"), m.get("note")) for m in status["models"] if m.get("note")]
    if notes:
        click.echo()
        for name, note in notes:
            click.echo(f"{name}: {note}")
    click.echo(f"\nEndpoint (OpenAI API): {endpoint}")
    click.echo("Start one: llmgw up MODEL    Try one: llmgw chat MODEL 'hello'")


# ---- up ---------------------------------------------------------------------------


async def _ask_up(s: Settings, canonical: str) -> None:
    reply = await s.call("POST", f"/api/v1/models/{canonical}/up", token=s.key)
    if not reply.ok:
        raise click.ClickException(f"the daemon refused the start: {reply.error_message()}")


async def _wait_up(s: Settings, name: str, timeout: float, live: bool) -> dict[str, Any]:
    # Aliases may hold a "/", which a URL path cannot carry: ask by the canonical name.
    canonical = str(find_model(await fetch_status(s), name)["name"])
    if s.key:
        s.guard("your API key")
    await _ask_up(s, canonical)
    loop = asyncio.get_running_loop()
    t0 = last_want = loop.time()
    progress = Progress(live)
    try:
        while True:
            now = loop.time()
            # The daemon keeps a start going while someone wants the model; say so again
            # now and then, or a long queue wait would look like nobody is waiting.
            if now - last_want > 20:
                await _ask_up(s, canonical)
                last_want = now
            model = find_model(await fetch_status(s), canonical)
            progress.show(now - t0, phase(model))
            if model.get("state") == "ready":
                return model
            if model.get("state") == "failing":
                raise click.ClickException(
                    f"{canonical} is failing to start: {model.get('note') or 'see llmgw models'}"
                )
            if now - t0 > timeout:
                raise click.ClickException(
                    f"{canonical} is not ready after {format_duration(now - t0)} "
                    f"({phase(model)}); it goes on starting: watch it with `llmgw models`"
                )
            await asyncio.sleep(1.0)
    finally:
        progress.end()


@main.command()
@click.argument("model", shell_complete=_complete_model)
@click.option(
    "--timeout",
    default=1800.0,
    show_default=True,
    type=click.FloatRange(min=0),
    help="Seconds to wait.",
)
@click.option("--json", "as_json", is_flag=True, help="Print the ready model as JSON.")
@click.pass_context
def up(ctx: click.Context, model: str, timeout: float, as_json: bool) -> None:
    """Start MODEL and wait until it is ready.

    Shows each step (queued, fetching weights, loading the engine, ready) with
    the time since the request, on standard error; the endpoint goes to
    standard output. Exit 0 once ready, 1 if it fails or --timeout passes,
    130 on Ctrl-C (which stops the waiting; the start goes on).

    \b
    Examples:
      llmgw up tiny
      llmgw up tiny --timeout 600 && llmgw chat tiny "Hello"
      llmgw up tiny --json | jq -r .endpoint
    """
    s = _get(ctx)
    live = sys.stderr.isatty()
    try:
        got = run(_wait_up(s, model, timeout, live))
    except KeyboardInterrupt:
        click.echo(
            f"\nStopped waiting; {model} goes on starting (`llmgw models` shows it).", err=True
        )
        sys.exit(130)
    if as_json:
        print_json(model_json(got, s.url + "/v1"))
        return
    click.echo(f"{got.get('name')} is ready: {s.url}/v1 (model {got.get('name')!r})")


# ---- chat -------------------------------------------------------------------------


def _openai_client(s: Settings, timeout: float) -> Any:
    import openai

    ctx_ssl = s.ssl_context()
    return openai.OpenAI(
        base_url=s.url + "/v1",
        api_key=s.key or "no-key",
        http_client=openai.DefaultHttpxClient(verify=ctx_ssl) if ctx_ssl is not None else None,
        # The gateway holds a request for a cold model itself; retries would only
        # hide an unreachable daemon for longer.
        max_retries=0,
        timeout=timeout,
    )


def _stream_answer(stream: Any, first: Any) -> None:
    """Write the streamed text to standard output; ``first()`` at the first chunk."""
    wrote = ""
    for chunk in stream:
        first()
        for choice in chunk.choices:
            text = choice.delta.content if choice.delta else None
            if text:
                click.echo(text, nl=False)
                wrote = text
    first()
    if not wrote.endswith("\n"):
        click.echo()


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
@click.option("-q", "--quiet", is_flag=True, help="No progress on standard error.")
@click.pass_context
def chat(
    ctx: click.Context,
    model: str,
    prompt: str | None,
    system: str | None,
    max_tokens: int,
    temperature: float | None,
    timeout: float,
    quiet: bool,
) -> None:
    """Send PROMPT (or standard input) to MODEL; stream the answer.

    Goes through the gateway with the openai client, as your own code would.
    A model that is not running is started first (the gateway holds the
    request): its steps show on standard error until the first word arrives;
    the answer alone goes to standard output.

    \b
    Examples:
      llmgw chat tiny "Hello"
      echo "Summarise: ..." | llmgw chat tiny --max-tokens 100
      llmgw chat tiny -q --temperature 0 "2+2=" > answer.txt
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
    entry = find_model(run(fetch_status(s)), model)
    watcher = None
    if entry.get("state") != "ready" and not quiet:
        click.echo(
            f"{entry.get('name')} is not running: the gateway holds your request while "
            "Slurm starts it (Ctrl-C stops waiting; the start goes on).",
            err=True,
        )
        watcher = Watcher(s, str(entry.get("name")), live=sys.stderr.isatty())
        watcher.start(entry)
    client = _openai_client(s, timeout)
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
        _stream_answer(stream, watcher.stop if watcher else lambda: None)
    except openai.APIConnectionError as exc:
        cause = exc.__cause__ or exc
        raise click.ClickException(
            f"cannot reach the llmgw daemon at {s.url}: {cause}{s.unreachable_hint()}"
        ) from None
    except openai.APIStatusError as exc:
        raise click.ClickException(f"{_api_message(exc)} (HTTP {exc.status_code})") from None
    except KeyboardInterrupt:
        click.echo(err=True)
        sys.exit(130)
    finally:
        if watcher is not None:
            watcher.stop()


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
    # "project": what a daemon before the word "account" called it.
    account = data.get("account", data.get("project"))
    if by == "user":
        return f"user {data.get('user')} (all keys)"
    if by == "account":
        return f"account {account} (every key charged to it)"
    who = f"key {data.get('key_id')} ({data.get('user')}"
    return who + (f", account {account})" if account else ")")


def _usage_table(rows: list[dict[str, Any]], total: dict[str, int]) -> str:
    cols = ("requests", "prompt_tokens", "completion_tokens", "total_tokens")
    return table(
        ("MODEL", "REQUESTS", "PROMPT TOKENS", "COMPLETION TOKENS", "TOTAL TOKENS"),
        [(r.get("model"), *(r.get(c) for c in cols)) for r in rows]
        + [("total", *(total[c] for c in cols))],
    )


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
    """Your token usage by model, with totals.

    Counted per API key: --by user sums all your keys, --by account every key
    charged to your key's Slurm account. On a gateway without API keys: the
    gateway's totals. A batch counts each of its requests. --json gives
    since (ISO 8601), models (one row each) and totals.

    \b
    Examples:
      llmgw usage --since 7d
      llmgw usage --by account --chart
      llmgw usage --json | jq .totals.total_tokens
    """
    s = _get(ctx)
    t0 = parse_when(since, time.time())
    if s.key:
        s.guard("your API key")
    reply: DaemonReply = run(
        s.call("GET", "/api/v1/usage", token=s.key, params={"since": f"{t0:.0f}", "by": by})
    )
    if not reply.ok:
        raise click.ClickException(reply.error_message())
    data = reply.data if isinstance(reply.data, dict) else {}
    rows = data.get("models") or []
    total = token_totals(rows)
    if as_json:
        data.pop("project", None)
        print_json({**data, "since": iso_time(t0), "by": by, "totals": total})
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
    click.echo(_usage_table(rows, total))
