"""Where ``llmgw`` finds the gateway and the user's key: options, environment, config file.

Below the commands (researcher.py, login.py), which all read them through
:func:`_get`.
"""

from __future__ import annotations

import os
import ssl
from dataclasses import dataclass
from pathlib import Path

import click
import yaml

from llmgw_slurm.cli.common import DaemonReply, call_daemon

__all__ = [
    "DEFAULT_URL",
    "Settings",
    "_get",
    "_read_config",
    "_settings",
    "base_url",
    "config_path",
]

DEFAULT_URL = "http://127.0.0.1:8000"


def base_url(url: str) -> str:
    """The gateway's address without a trailing ``/`` or ``/v1``.

    ``llmgw models`` prints the OpenAI endpoint (``.../v1``), which is what an
    OpenAI client's ``base_url`` takes; either form works wherever llmgw takes
    the gateway (``--url``, ``LLMGW_URL``, ``url:``), and llmgw adds ``/v1`` itself.
    """
    url = url.rstrip("/")
    if url.endswith("/v1"):
        url = url[: -len("/v1")].rstrip("/")
    return url


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

    def unreachable_hint(self) -> str:
        """What to add when the gateway cannot be reached: where its address came from."""
        if self.source != "the default":
            return f" (the address is from {self.source})"
        return (
            f" ({self.url} is llmgw's default; give your site's gateway with "
            "`export LLMGW_URL=https://HOST:PORT`, --url, or url: in "
            f"{config_path()})"
        )

    async def call(
        self,
        method: str,
        path: str,
        *,
        token: str | None = None,
        body: object = None,
        params: dict[str, str] | None = None,
    ) -> DaemonReply:
        """One request to the gateway's own API, verified as these settings say."""
        return await call_daemon(
            method,
            self.url,
            path,
            token=token,
            body=body,
            params=params,
            ssl=self.ssl_context(),
            hint=self.unreachable_hint(),
        )

    def guard(self, what: str) -> None:
        """Refuse (ClickException) unless the server can prove it is the daemon."""
        from llmgw_slurm.auth.identity import DEFAULT_INFO, verify_url
        from llmgw_slurm.base.errors import UnverifiedServerError

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
        url=base_url(url),
        key=key or file.get("api_key"),
        source=source,
        ca_file=ca_file or file.get("ca_file"),
    )


def _get(ctx: click.Context) -> Settings:
    root = ctx.find_root()
    if root.obj is None:
        # Shell completion parses the options (--url, LLMGW_URL included) but runs no
        # group callback: read them where click left them.
        p = root.params
        root.obj = (p.get("url"), p.get("key"), p.get("ca_file"))
    url, key, ca_file = root.obj
    return _settings(url, key, ca_file)
