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
import os
import ssl
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click
import yaml

from llmgw_slurm import __version__
from llmgw_slurm.cli.common import DaemonReply, call_daemon, parse_when, print_json, run, table
from llmgw_slurm.durations import format_duration

DEFAULT_URL = "http://127.0.0.1:8000"


@dataclass
class Settings:
    url: str
    key: str | None
    source: str  # where the URL came from, for error messages
    # A private CA's certificates (PEM) for an https gateway; None: the system's.
    ca_file: str | None = None

    def ssl_context(self) -> ssl.SSLContext | None:
        if self.ca_file is None:
            return None
        try:
            return ssl.create_default_context(cafile=self.ca_file)
        except (OSError, ssl.SSLError) as exc:
            raise click.ClickException(
                f"cannot load the CA file {self.ca_file} (--ca-file, LLMGW_CA_FILE or "
                f"ca_file:): {exc}; give PEM certificates"
            ) from None

    def guard(self, what: str) -> None:
        """Refuse (ClickException) unless the server can prove it is the daemon."""
        from llmgw_slurm.errors import UnverifiedServerError
        from llmgw_slurm.identity import DEFAULT_INFO, verify_url

        info = Path(os.environ.get("LLMGW_DAEMON_INFO") or DEFAULT_INFO)
        try:
            verify_url(self.url, info, what)
        except UnverifiedServerError as exc:
            raise click.ClickException(str(exc)) from None


def config_path() -> Path:
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "llmgw" / "config.yaml"


def _read_config(path: Path) -> dict[str, str]:
    try:
        text = path.read_text()
    except FileNotFoundError:
        return {}
    except OSError as exc:
        raise click.ClickException(f"cannot read {path}: {exc.strerror}") from None
    except UnicodeDecodeError as exc:
        raise click.ClickException(
            f"{path}: not UTF-8 text (byte {exc.start}); expected YAML with url: and api_key:"
        ) from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark is not None else str(path)
        raise click.ClickException(f"{where}: not valid YAML") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise click.ClickException(f"{path}: expected a mapping with url: and api_key:")
    unknown = sorted(set(data) - {"url", "api_key", "ca_file"})
    if unknown:
        raise click.ClickException(
            f"{path}: unknown setting(s) {', '.join(map(str, unknown))}; "
            "valid: url, api_key, ca_file"
        )
    out: dict[str, str] = {}
    for k in ("url", "api_key", "ca_file"):
        if data.get(k) is not None:
            if not isinstance(data[k], str):
                raise click.ClickException(f"{path}: {k} must be a string")
            out[k] = data[k]
    return out


def _settings(url: str | None, key: str | None, ca_file: str | None = None) -> Settings:
    path = config_path()
    source = "--url or LLMGW_URL" if url else ""
    file = _read_config(path) if not (url and key and ca_file) else {}
    if not url and file.get("url"):
        url, source = file["url"], str(path)
    if not url:
        url, source = DEFAULT_URL, "the default"
    if not url.startswith(("http://", "https://")):
        raise click.ClickException(
            f"daemon URL {url!r} (from {source}) must start with http:// or https://"
        )
    return Settings(
        url=url.rstrip("/"),
        key=key or file.get("api_key"),
        source=source,
        ca_file=ca_file or file.get("ca_file"),
    )


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


def _get(ctx: click.Context) -> Settings:
    url, key, ca_file = ctx.find_root().obj or (None, None, None)
    return _settings(url, key, ca_file)


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
@click.pass_context
def usage(ctx: click.Context, since: str, by: str, as_json: bool) -> None:
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
    if data.get("scope") == "gateway":
        # Keys are off: usage is nobody's in particular, so the daemon gives
        # the gateway's totals.
        who = "the whole gateway (it has no API keys)"
    elif by == "user":
        who = f"user {data.get('user')} (all keys)"
    elif by == "account":
        who = f"account {data.get('project')} (every key charged to it)"
    else:
        who = f"key {data.get('key_id')} ({data.get('user')}"
        who += f", project {data['project']})" if data.get("project") else ")"
    click.echo(f"Usage of {who} since {since}:")
    if not rows:
        click.echo("no requests")
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


# login, logout, keys: in their own module, which adds them to `main` when imported.
from llmgw_slurm.cli import login as _login  # noqa: E402,F401
