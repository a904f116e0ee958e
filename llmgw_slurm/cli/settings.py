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

__all__ = ["DEFAULT_URL", "Settings", "_get", "_read_config", "_settings", "config_path"]

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


def _get(ctx: click.Context) -> Settings:
    url, key, ca_file = ctx.find_root().obj or (None, None, None)
    return _settings(url, key, ca_file)
