"""``llmgw batch``: the Batch API from the shell (docs/batch.md).

    llmgw batch submit FILE.jsonl [--model M]   # upload and create; prints the batch id alone
    llmgw batch status ID [--watch]             # state and a progress bar
    llmgw batch list
    llmgw batch cancel ID
    llmgw batch delete ID                       # a finished batch, and the files it wrote
    llmgw batch download ID [-o FILE] [--errors]

Through the official openai client, as the researcher's own code would; the
server is checked to be the daemon before the key goes out (the ``llmgw``
group's settings, as for ``chat``). Every command that prints a batch takes
``--json`` (the Batch API's own object); what a script captures goes to
standard output, progress and notes to standard error.
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

from llmgw_slurm.cli.common import print_json, table

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
    def unreachable_hint(self) -> str: ...


def _client(ctx: click.Context) -> Any:
    import openai

    s: _Settings = ctx.meta[SETTINGS_KEY]()
    s.guard("your API key and files" if s.key else "your files")
    ctx_ssl = s.ssl_context()
    client = openai.OpenAI(
        base_url=s.url + "/v1",
        api_key=s.key or "no-key",
        http_client=openai.DefaultHttpxClient(verify=ctx_ssl) if ctx_ssl is not None else None,
        max_retries=0,
        timeout=600,
    )
    ctx.meta["llmgw.batch.hint"] = s.unreachable_hint()
    return client


def _call(fn: Any, *args: Any, **kwargs: Any) -> Any:
    """One API call; its refusal or an unreachable daemon as a one-line error."""
    import openai

    try:
        return fn(*args, **kwargs)
    except openai.APIConnectionError as exc:
        cause = exc.__cause__ or exc
        hint = click.get_current_context().meta.get("llmgw.batch.hint", "")
        raise click.ClickException(f"cannot reach the llmgw daemon: {cause}{hint}") from None
    except openai.APIStatusError as exc:
        body = exc.body if isinstance(exc.body, dict) else {}
        err = body.get("error", body) if isinstance(body, dict) else {}
        msg = err.get("message") if isinstance(err, dict) else None
        raise click.ClickException(f"{msg or exc.message} (HTTP {exc.status_code})") from None


@click.group()
@click.pass_context
def batch(ctx: click.Context) -> None:
    """Many requests as one Slurm job (OpenAI's Batch API).

    \b
    Examples:
      B=$(llmgw batch submit prompts.jsonl --model tiny)
      llmgw batch status "$B" --watch && llmgw batch download "$B" -o answers.jsonl
      llmgw batch list --json | jq -r '.[] | select(.status == "failed") | .id'
    """


def _with_model(path: Path, model: str | None) -> bytes:
    """The file's bytes, ``body.model`` set to ``model`` where a line has none.

    Without ``model``, a line that names none is a usage error here, before
    anything is uploaded: the batch would fail with one identical error per line.
    """
    data = path.read_bytes()
    out = io.BytesIO()
    for n, raw in enumerate(data.splitlines(keepends=True), start=1):
        if not raw.strip():
            continue
        try:
            line = json.loads(raw)
        except ValueError:
            raise click.ClickException(f"{path}:{n}: not valid JSON") from None
        body = line.get("body") if isinstance(line, dict) else None
        if isinstance(body, dict) and not body.get("model"):
            if model is None:
                raise click.UsageError(
                    f"{path}:{n}: the request names no model (body.model): give --model M "
                    "for every line without one (llmgw models lists them)"
                )
            body["model"] = model
        out.write(json.dumps(line).encode() + b"\n")
    return out.getvalue() if model is not None else data


def _bar(done: int, total: int, width: int = 30) -> str:
    filled = width * done // total if total else 0
    return "[" + "#" * filled + "." * (width - filled) + "]"


def _progress(b: Any) -> str:
    counts = b.request_counts
    total = counts.total if counts else 0
    done = (counts.completed + counts.failed) if counts else 0
    line = f"{b.status}"
    if total:
        line += f" {_bar(done, total)} {done}/{total}"
        if counts.failed:
            line += f" ({counts.failed} failed)"
    return line


def _show(b: Any, err: bool = False) -> None:
    click.echo(_progress(b), err=err)
    if b.errors and b.errors.data:
        for e in b.errors.data:
            where = f"line {e.line}: " if e.line else ""
            click.echo(f"  {where}{e.message} ({e.code})", err=err)
    for name, fid in (("output", b.output_file_id), ("errors", b.error_file_id)):
        if fid:
            click.echo(f"  {name}: {fid}", err=err)


def _batch_json(b: Any) -> dict[str, Any]:
    data: dict[str, Any] = b.model_dump(mode="json")
    return data


@batch.command()
@click.argument("file", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--model", help="Fill in body.model on lines that have none.")
@click.option("--endpoint", type=click.Choice(_ENDPOINTS), default=_ENDPOINTS[0], show_default=True)
@click.option("--window", default="24h", show_default=True, help="The completion window.")
@click.option("--json", "as_json", is_flag=True, help="Print the batch as JSON.")
@click.pass_context
def submit(
    ctx: click.Context, file: Path, model: str | None, endpoint: str, window: str, as_json: bool
) -> None:
    """Upload FILE (JSONL) and start a batch over it.

    Standard output gets the batch id alone (or, with --json, the batch), so
    that B=$(llmgw batch submit ...) captures it; its state goes to standard
    error. Exit 1 when the batch was refused or failed at once (bad lines).

    \b
    Examples:
      B=$(llmgw batch submit prompts.jsonl --model tiny)
      llmgw batch submit prompts.jsonl --json | jq -r .id
    """
    data = _with_model(file, model)
    c = _client(ctx)
    f = _call(c.files.create, file=(file.name, io.BytesIO(data)), purpose="batch")
    b = _call(c.batches.create, input_file_id=f.id, endpoint=endpoint, completion_window=window)
    if as_json:
        print_json(_batch_json(b))
    else:
        click.echo(b.id)
    _show(b, err=True)
    if b.status == "failed":
        sys.exit(1)


def _watch(c: Any, batch_id: str, b: Any) -> Any:
    """Refresh until the batch ends, a line on standard error each time it moves."""
    last = ""
    while b.status not in _FINAL:
        shown = _progress(b)
        if shown != last:
            click.echo(f"{time.strftime('%H:%M:%S')} {shown}", err=True)
            last = shown
        time.sleep(5)
        b = _call(c.batches.retrieve, batch_id)
    return b


@batch.command()
@click.argument("batch_id")
@click.option(
    "--watch", is_flag=True, help="Refresh until the batch ends; exit 1 unless completed."
)
@click.option("--json", "as_json", is_flag=True, help="Print the batch as JSON.")
@click.pass_context
def status(ctx: click.Context, batch_id: str, watch: bool, as_json: bool) -> None:
    """Show a batch's state and progress.

    With --watch, it waits for the batch to end, printing each change on
    standard error, and exits 0 if it completed, 1 if it failed, expired or
    was cancelled, 130 on Ctrl-C (the batch goes on).

    \b
    Examples:
      llmgw batch status "$B"
      llmgw batch status "$B" --watch && llmgw batch download "$B" -o out.jsonl
      llmgw batch status "$B" --json | jq .request_counts
    """
    c = _client(ctx)
    b = _call(c.batches.retrieve, batch_id)
    if watch:
        try:
            b = _watch(c, batch_id, b)
        except KeyboardInterrupt:
            click.echo(
                f"\nStopped watching; batch {batch_id} goes on "
                f"(llmgw batch status {batch_id}).",
                err=True,
            )
            sys.exit(130)
    if as_json:
        print_json(_batch_json(b))
    else:
        _show(b)
    if watch and b.status != "completed":
        click.echo(f"Error: batch {batch_id} ended {b.status}", err=True)
        sys.exit(1)


@batch.command("list")
@click.option("--json", "as_json", is_flag=True, help="Print the batches as JSON.")
@click.pass_context
def list_(ctx: click.Context, as_json: bool) -> None:
    """List your batches, newest first.

    \b
    Examples:
      llmgw batch list
      llmgw batch list --json | jq -r '.[] | select(.status == "completed") | .id'
    """
    c = _client(ctx)
    page = _call(c.batches.list, limit=100)
    if as_json:
        print_json([_batch_json(b) for b in page.data])
        return
    rows = []
    for b in page.data:
        counts = b.request_counts
        progress = f"{counts.completed + counts.failed}/{counts.total}" if counts else ""
        created = time.strftime("%Y-%m-%d %H:%M", time.localtime(b.created_at))
        rows.append((b.id, b.status, progress, created))
    click.echo(table(("BATCH", "STATUS", "DONE", "CREATED"), rows) if rows else "no batches")


@batch.command()
@click.argument("batch_id")
@click.option("--json", "as_json", is_flag=True, help="Print the batch as JSON.")
@click.pass_context
def cancel(ctx: click.Context, batch_id: str, as_json: bool) -> None:
    """Cancel a running batch; its answers so far are kept.

    \b
    Example:
      llmgw batch cancel "$B"
    """
    c = _client(ctx)
    b = _call(c.batches.cancel, batch_id)
    if as_json:
        print_json(_batch_json(b))
    else:
        _show(b)


@batch.command()
@click.argument("batch_ids", metavar="BATCH_ID...", nargs=-1, required=True)
@click.pass_context
def delete(ctx: click.Context, batch_ids: tuple[str, ...]) -> None:
    """Delete finished batches and the files they wrote.

    The batch leaves `llmgw batch list`; its output and error files go with
    it, its input file stays (`DELETE /v1/files/ID` removes that). A running
    batch is cancelled first (`llmgw batch cancel`).

    \b
    Examples:
      llmgw batch delete "$B"
      llmgw batch list --json | jq -r '.[] | select(.status == "failed") | .id' \\
        | xargs -r llmgw batch delete
    """
    c = _client(ctx)
    for bid in batch_ids:
        _call(c.delete, f"/batches/{bid}", cast_to=object)
        click.echo(f"deleted {bid}", err=True)


def _write_out(output: Path, data: bytes) -> None:
    try:
        output.write_bytes(data)
    except OSError as exc:
        if not output.parent.is_dir():
            why = f"the folder {output.parent} does not exist"
        else:
            why = (exc.strerror or str(exc)).lower()
        raise click.ClickException(f"cannot write {output}: {why}") from None


@batch.command()
@click.argument("batch_id")
@click.option("-o", "--output", type=click.Path(dir_okay=False, path_type=Path), default=None)
@click.option("--errors", is_flag=True, help="The error file instead of the output.")
@click.pass_context
def download(ctx: click.Context, batch_id: str, output: Path | None, errors: bool) -> None:
    """Write a batch's output (or errors) to -o FILE or stdout.

    A finished batch without errors has an empty error file: --errors writes
    nothing and exits 0. Exit 1 while the batch has not written the file yet.

    \b
    Examples:
      llmgw batch download "$B" -o answers.jsonl
      llmgw batch download "$B" | jq -r .response.body.choices[0].message.content
      llmgw batch download "$B" --errors | jq -r .error.message
    """
    c = _client(ctx)
    b = _call(c.batches.retrieve, batch_id)
    fid = b.error_file_id if errors else b.output_file_id
    what = "error" if errors else "output"
    if fid:
        data = _call(c.files.content, fid).read()
    elif b.status in _FINAL and (errors or b.status != "completed"):
        # Nothing to write: a clean batch has no errors; a failed one no output.
        data = b""
        click.echo(f"batch {batch_id} ({b.status}) has no {what} lines", err=True)
    else:
        raise click.ClickException(
            f"batch {batch_id} ({b.status}) has no {what} file yet: wait with "
            f"`llmgw batch status {batch_id} --watch`"
        )
    if output is None:
        sys.stdout.buffer.write(data)
        sys.stdout.buffer.flush()
    else:
        _write_out(output, data)
        click.echo(f"{len(data.splitlines())} lines to {output}", err=True)
