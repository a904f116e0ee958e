"""Every error llmgw-slurm raises on purpose.

The hierarchy, drawn once::

    LlmgwError                  base; str() is a one-line message meant for a person
    ├── ConfigError             a config or catalog file is wrong (file, line, field, what is valid)
    │   └── ConfigErrors        several ConfigErrors found in one pass, reported together
    ├── SlurmError              a Slurm command failed (command, exit code, stderr)
    │   ├── SlurmUnavailable    the command is missing or timed out: Slurm could not be asked
    │   └── SlurmParseError     the command answered something we could not read
    ├── TemplateError           an sbatch template could not be rendered, or a value was refused
    ├── DatabaseError           the shared PostgreSQL could not be reached or used (database:)
    │   └── SchemaError         its schema is missing, older or newer than this code's
    ├── UnsafePathError         a folder or file that must be the daemon's alone is not
    ├── UnverifiedServerError   a CLI will not send a secret to a server not proven the daemon
    └── ReportNotRecorded       an agent's report could not be journalled: refused, to be retried

Callers that face a person (the CLIs) catch ``LlmgwError`` and print ``str(err)``
without a traceback; anything else escaping is a bug.
"""

from __future__ import annotations

from collections.abc import Sequence


class LlmgwError(Exception):
    """Base of every error raised on purpose by llmgw-slurm."""


class ConfigError(LlmgwError):
    """A config or catalog value is wrong.

    ``file`` and ``line`` say where (line is 1-based, None when unknown),
    ``field`` is the dotted path of the value (``models[2].resources.gpus``).
    """

    def __init__(
        self, message: str, *, file: str | None = None, line: int | None = None, field: str = ""
    ) -> None:
        self.message = message
        self.file = file
        self.line = line
        self.field = field
        super().__init__(self.__str__())

    def __str__(self) -> str:
        where = ""
        if self.file:
            where = self.file if self.line is None else f"{self.file}:{self.line}"
        parts = [p for p in (where, self.field) if p]
        prefix = ": ".join(parts)
        return f"{prefix}: {self.message}" if prefix else self.message


class ConfigErrors(ConfigError):
    """Several config errors found in one pass; ``errors`` holds each."""

    def __init__(self, errors: Sequence[ConfigError]) -> None:
        self.errors = list(errors)
        super().__init__("\n".join(str(e) for e in self.errors))

    def __str__(self) -> str:
        return "\n".join(str(e) for e in self.errors)


class SlurmError(LlmgwError):
    """A Slurm command failed.

    ``command`` is the argument list that was run, ``returncode`` its exit
    status (None when it never ran or was killed on a timeout), ``stderr``
    what it printed on standard error.
    """

    def __init__(
        self,
        message: str,
        *,
        command: Sequence[str] = (),
        returncode: int | None = None,
        stderr: str = "",
    ) -> None:
        self.message = message
        self.command = list(command)
        self.returncode = returncode
        self.stderr = stderr.strip()
        super().__init__(self.__str__())

    def __str__(self) -> str:
        cmd = " ".join(self.command[:1]) or "slurm"
        out = f"{cmd}: {self.message}"
        if self.returncode is not None:
            out += f" (exit {self.returncode})"
        if self.stderr:
            out += f": {self.stderr.splitlines()[-1][:500]}"
        return out


class SlurmUnavailable(SlurmError):
    """Slurm could not be asked: the command is missing, or it timed out."""


class SlurmParseError(SlurmError):
    """A Slurm command answered, but not in a shape we can read."""


class TemplateError(LlmgwError):
    """An sbatch template failed to render, or a value was refused as unsafe."""


class DatabaseError(LlmgwError):
    """The shared database (``database:`` in server.yaml) could not be reached or used;
    the message names the server as configured (never a password) and what to check."""


class SchemaError(DatabaseError):
    """The database's schema is missing, older than this code's (run ``llmgw-admin db
    migrate``), or newer (this llmgw-slurm is older than the one that migrated it)."""


class UnsafePathError(LlmgwError):
    """A folder or file the daemon keeps secrets in (or publishes from) could be changed
    or read by another user; the message names the path and the fix."""


class UnverifiedServerError(LlmgwError):
    """A CLI would send a key, token or prompt to a server that cannot prove it is the
    daemon; the message says why and how to fix it."""


class ReportNotRecorded(LlmgwError):
    """A signed report was not accepted because its nonce could not be journalled.

    Accepting it unjournalled would let a copy of it be replayed after a
    restart; the agent is answered 503 and sends it again (a new nonce).
    """
