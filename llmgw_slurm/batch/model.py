"""Batch API objects, their state machine, and the check of an input file.

Pure: no I/O, the clock passed in. OpenAI's batch states, in the order a
batch moves through them::

    validating ─► failed                      (the input file was refused; nothing ran)
        │
        ▼
    in_progress ─► finalizing ─► completed   (every request answered, or failed)
        │   │
        │   └─► cancelling ─► cancelled       (POST /cancel: jobs cancelled, results kept)
        └─► expired                          (completion_window passed; results kept)

A batch whose job ended without finishing and without being cancelled is
failed too, with an error that says how far it got.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from llmgw_slurm.accounting.quota import NOTHING, Ask

__all__ = [
    "ENDPOINTS",
    "BatchError",
    "BatchRecord",
    "BatchStatus",
    "Checked",
    "FileRecord",
    "check_input",
    "transition",
]

# What a batch line may ask for: the endpoints the gateway serves.
ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings")
# The errors list of a refused file is cut here: a million bad lines must not
# make a million-entry answer (OpenAI cuts it too).
MAX_ERRORS = 100


class BatchStatus(enum.Enum):
    VALIDATING = "validating"
    FAILED = "failed"
    IN_PROGRESS = "in_progress"
    FINALIZING = "finalizing"
    COMPLETED = "completed"
    EXPIRED = "expired"
    CANCELLING = "cancelling"
    CANCELLED = "cancelled"

    @property
    def is_final(self) -> bool:
        return self in (
            BatchStatus.FAILED,
            BatchStatus.COMPLETED,
            BatchStatus.EXPIRED,
            BatchStatus.CANCELLED,
        )


# status -> the statuses it may move to; anything else is a bug in the caller.
_MOVES: Mapping[BatchStatus, frozenset[BatchStatus]] = {
    BatchStatus.VALIDATING: frozenset(
        {BatchStatus.FAILED, BatchStatus.IN_PROGRESS, BatchStatus.CANCELLING}
    ),
    BatchStatus.IN_PROGRESS: frozenset(
        {
            BatchStatus.FINALIZING,
            BatchStatus.CANCELLING,
            BatchStatus.EXPIRED,
            BatchStatus.FAILED,
        }
    ),
    BatchStatus.FINALIZING: frozenset(
        {BatchStatus.COMPLETED, BatchStatus.FAILED, BatchStatus.EXPIRED}
    ),
    BatchStatus.CANCELLING: frozenset({BatchStatus.CANCELLED}),
}
# The timestamp field each status sets when entered (OpenAI's names).
_STAMPS: Mapping[BatchStatus, str] = {
    BatchStatus.IN_PROGRESS: "in_progress_at",
    BatchStatus.FINALIZING: "finalizing_at",
    BatchStatus.COMPLETED: "completed_at",
    BatchStatus.FAILED: "failed_at",
    BatchStatus.EXPIRED: "expired_at",
    BatchStatus.CANCELLING: "cancelling_at",
    BatchStatus.CANCELLED: "cancelled_at",
}


@dataclass(frozen=True)
class BatchError:
    """One entry of a batch's ``errors`` list (``line`` 1-based, None for the whole file)."""

    code: str
    message: str
    line: int | None = None
    param: str | None = None


@dataclass(frozen=True)
class FileRecord:
    """A ``/v1/files`` object as stored beside its bytes."""

    id: str
    owner: str
    filename: str
    purpose: str
    bytes: int
    created_at: int

    def to_api(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "file",
            "bytes": self.bytes,
            "created_at": self.created_at,
            "filename": self.filename,
            "purpose": self.purpose,
            "status": "processed",
            "status_details": None,
            "expires_at": None,
        }


@dataclass(frozen=True)
class BatchRecord:
    """A ``/v1/batches`` object, plus what the daemon keeps to run it."""

    id: str
    owner: str
    endpoint: str
    input_file_id: str
    completion_window: str
    created_at: int
    expires_at: int
    status: BatchStatus = BatchStatus.VALIDATING
    model: str = ""
    total: int = 0
    completed: int = 0
    failed: int = 0
    errors: tuple[BatchError, ...] = ()
    metadata: Mapping[str, str] = field(default_factory=dict)
    output_file_id: str | None = None
    error_file_id: str | None = None
    in_progress_at: int | None = None
    finalizing_at: int | None = None
    completed_at: int | None = None
    failed_at: int | None = None
    expired_at: int | None = None
    cancelling_at: int | None = None
    cancelled_at: int | None = None
    # The Slurm job running it now ("" none yet), how many jobs it has had,
    # and the step the job last reported (for `status`; not OpenAI's).
    job_id: str = ""
    jobs_submitted: int = 0
    note: str = ""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    # The key that created it, for the usage store (its tokens count to that key).
    key_id: str = ""
    project: str = ""
    # The batch's shards: each a task of the batch's job array with its own
    # slice of the input and its own result files (1: one job, no array).
    shards: int = 1
    # The tokens its creator's day and month budgets hold for it until it ends
    # (the most its requests may spend; 0: no quotas), held again after a restart.
    reserved: int = 0
    # The cluster its job runs on ("": the one cluster of a server.yaml without
    # clusters:); its job id means something only there.
    cluster: str = ""
    # What rides on warm replicas answered (all its rides together): its tokens
    # count beside a later job's own, and (a sharded batch) its answers beside the
    # shards'.
    warm_completed: int = 0
    warm_failed: int = 0
    warm_prompt_tokens: int = 0
    warm_completion_tokens: int = 0

    def to_api(self) -> dict[str, Any]:
        stamps = {name: getattr(self, name) for name in _STAMPS.values()}
        errors = None
        if self.errors:
            errors = {
                "object": "list",
                "data": [
                    {"code": e.code, "message": e.message, "param": e.param, "line": e.line}
                    for e in self.errors
                ],
            }
        return {
            "id": self.id,
            "object": "batch",
            "endpoint": self.endpoint,
            "model": self.model or None,
            "errors": errors,
            "input_file_id": self.input_file_id,
            "completion_window": self.completion_window,
            "status": self.status.value,
            "output_file_id": self.output_file_id,
            "error_file_id": self.error_file_id,
            "created_at": self.created_at,
            "expires_at": self.expires_at,
            **stamps,
            "request_counts": {
                "total": self.total,
                "completed": self.completed,
                "failed": self.failed,
            },
            "usage": {
                "input_tokens": self.prompt_tokens,
                "output_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens,
            },
            "metadata": dict(self.metadata) or None,
        }

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["status"] = self.status.value
        data["metadata"] = dict(self.metadata)
        return data

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> BatchRecord:
        values = dict(data)
        values["status"] = BatchStatus(values["status"])
        values["errors"] = tuple(BatchError(**e) for e in values.get("errors", ()))
        return cls(**values)


def transition(batch: BatchRecord, to: BatchStatus, now: float, **changes: Any) -> BatchRecord:
    """``batch`` moved to ``to`` at ``now`` (its timestamp set), with ``changes``.

    Raises ValueError for a move the state machine does not have (a final
    batch never moves again).
    """
    if to not in _MOVES.get(batch.status, frozenset()):
        raise ValueError(f"batch {batch.id}: no move from {batch.status.value} to {to.value}")
    stamp = _STAMPS.get(to)
    if stamp is not None:
        changes[stamp] = int(now)
    return replace(batch, status=to, **changes)


@dataclass(frozen=True)
class Checked:
    """What a valid input file holds: its request count, the one model it asks for,
    and the most its requests may spend together (NOTHING when nobody asked)."""

    total: int
    model: str
    custom_ids: tuple[str, ...]
    ask: Ask = NOTHING


def check_input(
    lines: Iterable[bytes],
    endpoint: str,
    resolve: Callable[[str], str | None],
    max_requests: int,
    ask: Callable[[Mapping[str, Any]], Ask] | None = None,
) -> Checked | list[BatchError]:
    """Every line of a batch input file checked, as OpenAI does at create time.

    ``resolve`` maps a model name or alias to the catalog model a key may use
    (None: unknown or not allowed). Each line must be a JSON object with a
    unique string ``custom_id``, ``method`` POST, ``url`` equal to the batch's
    ``endpoint``, and a ``body`` object whose ``model`` resolves; every line
    must name the same model. Returns the errors (at most MAX_ERRORS, each
    naming its line) or what the file holds; with ``ask`` (a line's body to
    the most it may spend), the sum of every line's.
    """
    errors: list[BatchError] = []
    seen: set[str] = set()
    ids: list[str] = []
    model = ""
    n = 0
    most = NOTHING  # the lines' asks summed
    for n, raw in enumerate(lines, start=1):
        if len(errors) >= MAX_ERRORS:
            break
        if n > max_requests:
            errors.append(
                BatchError(
                    "too_many_requests",
                    f"The file holds more than {max_requests} requests, the most one batch may.",
                    n,
                )
            )
            break
        line, problem = _check_line(raw, n, endpoint)
        if problem is not None:
            errors.append(problem)
            continue
        assert line is not None
        cid, name, body = line
        if ask is not None and not errors:
            most = _plus(most, ask(body))
        if cid in seen:
            errors.append(
                BatchError(
                    "duplicate_custom_id",
                    f"The custom_id {cid!r} is also on an earlier line; each must be unique.",
                    n,
                    "custom_id",
                )
            )
            continue
        seen.add(cid)
        ids.append(cid)
        canonical = _line_model(resolve(name), name, model, n, errors)
        model = canonical or model
    if not errors and not ids:
        errors.append(BatchError("empty_file", "The input file holds no requests."))
    if errors:
        return errors
    return Checked(len(ids), model, tuple(ids), most)


def _line_model(
    canonical: str | None, name: str, model: str, n: int, errors: list[BatchError]
) -> str | None:
    """The catalog model line ``n`` names, or None with its error added: unknown
    (or not the key's), or another than the earlier lines' ``model``."""
    if canonical is None:
        errors.append(
            BatchError(
                "model_not_found",
                f"The model {name!r} does not exist or your key may not use it.",
                n,
                "body.model",
            )
        )
        return None
    if model and canonical != model:
        errors.append(
            BatchError(
                "mismatched_model",
                f"The model {name!r} differs from {model!r} on earlier lines; "
                "a batch runs one model.",
                n,
                "body.model",
            )
        )
        return None
    return canonical


def _plus(a: Ask, b: Ask) -> Ask:
    """Two asks as one: every answer bounded by its own max_tokens only if both are."""
    return Ask(a.prompt + b.prompt, a.answer + b.answer, a.own and b.own)


def _check_line(
    raw: bytes, n: int, endpoint: str
) -> tuple[tuple[str, str, dict[str, Any]] | None, BatchError | None]:
    """(custom_id, model, body) of one line, or the error that names what is wrong with it."""
    try:
        obj = json.loads(raw.decode("utf-8"))
    except (ValueError, RecursionError):
        return None, BatchError("invalid_json_line", "This line is not valid JSON.", n)
    if not isinstance(obj, dict):
        return None, BatchError("invalid_json_line", "This line is not a JSON object.", n)
    cid = obj.get("custom_id")
    if not isinstance(cid, str) or not cid:
        return None, BatchError(
            "missing_required_parameter", "custom_id must be a non-empty string.", n, "custom_id"
        )
    if len(cid) > 512:
        return None, BatchError(
            "invalid_value", "custom_id is longer than 512 characters.", n, "custom_id"
        )
    if obj.get("method") != "POST":
        return None, BatchError("invalid_method", "method must be POST.", n, "method")
    if obj.get("url") != endpoint:
        return None, BatchError(
            "invalid_url",
            f"url is {obj.get('url')!r}; this batch's endpoint is {endpoint!r}, "
            "and every line must use it.",
            n,
            "url",
        )
    body = obj.get("body")
    if not isinstance(body, dict):
        return None, BatchError("missing_required_parameter", "body must be an object.", n, "body")
    name = body.get("model")
    if not isinstance(name, str) or not name:
        return None, BatchError(
            "missing_required_parameter", "body.model must be a model name.", n, "body.model"
        )
    if body.get("stream") is True:
        return None, BatchError("invalid_value", "A batch request cannot stream.", n, "body.stream")
    return (cid, name, body), None
