"""``llmgw batch``: the Batch API from the shell (docs/batch.md).

    llmgw batch submit FILE.jsonl [--model M]   # upload and create; prints the batch id
    llmgw batch status ID [--watch]             # state and a progress bar
    llmgw batch list
    llmgw batch cancel ID
    llmgw batch download ID [-o FILE] [--errors]

Through the official openai client, as the researcher's own code would; the
server is checked to be the daemon before the key goes out (the ``llmgw``
group's settings, as for ``chat``).
"""

from __future__ import annotations

import io
import json
import ssl
import sys
import time
from pathlib import Path
from typing import Any, Protocol

import click

from llmgw_slurm.cli.common import table

__all__ = ["SETTINGS_KEY", "batch"]

# Where the ``llmgw`` group leaves a function that reads its settings (ctx.meta).
SETTINGS_KEY = "llmgw.settings"

_ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings")
_FINAL = ("completed", "failed", "expired", "cancelled")


class _Settings(Protocol):
    url: str
    key: str | None

    def ssl_context(self) -> ssl.SSLContext | None: ...
    def guard(self, what: str) -> None: ...


def _client(ctx: click.Context) -> Any:
    import openai

    s: _Settings = ctx.meta[SETTINGS_KEY]()
    s.guard("your API key and files" if s.key else "your files")
    ctx_ssl = s.ssl_context()
    return openai.OpenAI(
        base_url=s.url + "/v1",
        api_key=s.key or "no-key",
        http_client=openai.DefaultHttpxClient(verify=ctx_ssl) if ctx_ssl is not None else None,
        max_retries=0,
        timeout=600,
    )


def _call(fn: Any, *args: Any, **kwargs: Any) -> Any:
    """One API call; its refusal or an unreachable daemon as a one-line error."""
    import openai

    try:
        return fn(*args, **kwargs)
    except openai.APIConnectionError as exc:
        cause = exc.__cause__ or exc
        raise click.ClickException(f"cannot reach the llmgw daemon: {cause}") from None
    except openai.APIStatusError as exc:
        body = exc.body if isinstance(exc.body, dict) else {}
        err = body.get("error", body) if isinstance(body, dict) else {}
        msg = err.get("message") if isinstance(err, dict) else None
        raise click.ClickException(f"{msg or exc.message} (HTTP {exc.status_code})") from None


@click.group()
@click.pass_context
def batch(ctx: click.Context) -> None:
    """Many requests as one Slurm job (OpenAI's Batch API)."""


def _with_model(path: Path, model: str | None) -> bytes:
    """The file's bytes, ``body.model`` set to ``model`` where a line has none."""
    data = path.read_bytes()
    if model is None:
        return data
    out = io.BytesIO()
    for n, raw in enumerate(data.splitlines(keepends=True), start=1):
        try:
            line = json.loads(raw)
        except ValueError:
            raise click.ClickException(f"{path}:{n}: not valid JSON") from None
        if isinstance(line, dict) and isinstance(line.get("body"), dict):
            line["body"].setdefault("model", model)
        out.write(json.dumps(line).encode() + b"\n")
    return out.getvalue()


@batch.command()
@click.argument("file", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--model", help="Fill in body.model on lines that have none.")
@click.option("--endpoint", type=click.Choice(_ENDPOINTS), default=_ENDPOINTS[0], show_default=True)
@click.option("--window", default="24h", show_default=True, help="The completion window.")
@click.pass_context
def submit(ctx: click.Context, file: Path, model: str | None, endpoint: str, window: str) -> None:
    """Upload FILE (JSONL, one request a line) and start a batch over it."""
    c = _client(ctx)
    data = _with_model(file, model)
    f = _call(c.files.create, file=(file.name, io.BytesIO(data)), purpose="batch")
    b = _call(c.batches.create, input_file_id=f.id, endpoint=endpoint, completion_window=window)
    click.echo(b.id)
    _show(b)
    if b.status == "failed":
        sys.exit(1)


def _bar(done: int, total: int, width: int = 30) -> str:
    filled = width * done // total if total else 0
    return "[" + "#" * filled + "." * (width - filled) + "]"


def _show(b: Any) -> None:
    counts = b.request_counts
    total = counts.total if counts else 0
    done = (counts.completed + counts.failed) if counts else 0
    line = f"{b.status}"
    if total:
        line += f" {_bar(done, total)} {done}/{total}"
        if counts.failed:
            line += f" ({counts.failed} failed)"
    click.echo(line)
    if b.errors and b.errors.data:
        for e in b.errors.data:
            where = f"line {e.line}: " if e.line else ""
            click.echo(f"  {where}{e.message} ({e.code})")
    for name, fid in (("output", b.output_file_id), ("errors", b.error_file_id)):
        if fid:
            click.echo(f"  {name}: {fid}")


@batch.command()
@click.argument("batch_id")
@click.option("--watch", is_flag=True, help="Refresh until the batch ends.")
@click.pass_context
def status(ctx: click.Context, batch_id: str, watch: bool) -> None:
    """A batch's state and progress."""
    c = _client(ctx)
    b = _call(c.batches.retrieve, batch_id)
    while watch and b.status not in _FINAL:
        _show(b)
        time.sleep(5)
        b = _call(c.batches.retrieve, batch_id)
    _show(b)


@batch.command("list")
@click.pass_context
def list_(ctx: click.Context) -> None:
    """Your batches, newest first."""
    c = _client(ctx)
    page = _call(c.batches.list, limit=100)
    rows = []
    for b in page.data:
        counts = b.request_counts
        progress = f"{counts.completed + counts.failed}/{counts.total}" if counts else ""
        created = time.strftime("%Y-%m-%d %H:%M", time.localtime(b.created_at))
        rows.append((b.id, b.status, progress, created))
    click.echo(table(("BATCH", "STATUS", "DONE", "CREATED"), rows) if rows else "no batches")


@batch.command()
@click.argument("batch_id")
@click.pass_context
def cancel(ctx: click.Context, batch_id: str) -> None:
    """Cancel a batch; what it answered so far is kept."""
    c = _client(ctx)
    _show(_call(c.batches.cancel, batch_id))


@batch.command()
@click.argument("batch_id")
@click.option("-o", "--output", type=click.Path(dir_okay=False, path_type=Path), default=None)
@click.option("--errors", is_flag=True, help="The error file instead of the output.")
@click.pass_context
def download(ctx: click.Context, batch_id: str, output: Path | None, errors: bool) -> None:
    """Write a batch's output (or error) file to -o FILE or standard output."""
    c = _client(ctx)
    b = _call(c.batches.retrieve, batch_id)
    fid = b.error_file_id if errors else b.output_file_id
    if not fid:
        what = "error" if errors else "output"
        raise click.ClickException(f"batch {batch_id} ({b.status}) has no {what} file yet")
    data = _call(c.files.content, fid).read()
    if output is None:
        sys.stdout.buffer.write(data)
    else:
        output.write_bytes(data)
        click.echo(f"{len(data.splitlines())} lines to {output}", err=True)
