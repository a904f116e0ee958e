"""Admission: whether a request may go to a model, and how: a plan, or the refusal.

The checks, in the order they apply (each refusal is the client's answer):

1. the key (401), when the gateway has keys;
2. the body: a JSON object (400) naming a model (400), or an upload's model field;
3. the model: known and allowed to the key (404, the same for both, so that
   nobody learns what exists);
4. the endpoint: one the model serves (400); ``stream`` a boolean (400);
5. a ``previous_response_id``: the replica that holds it (400 when it cannot);
6. the quota: the most it may spend is held (``quota.Reservation``) and, let
   in, its answer will tell the limits as they stood (429 over a limit).

No I/O and no waiting: the forwarder (``forward``) does the rest. The body
for the engine is made here too: the model's own name for an alias, and a
stream asks for its usage (taken out again on the way back when the client
did not ask), so that it can be counted.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

from llmgw_slurm.accounting.quota import NOTHING, Ask, QuotaBook, Refusal, Reservation, ask_of
from llmgw_slurm.auth.access import AccessGuard
from llmgw_slurm.auth.keys import KeyRecord, KeyRing
from llmgw_slurm.router import balance
from llmgw_slurm.router._body import with_fields
from llmgw_slurm.router.answers import Reply, error
from llmgw_slurm.router.directory import Endpoint, ModelDirectory, ModelRouting
from llmgw_slurm.router.surface import STREAM_USAGE_ENDPOINTS, ResponseHomes, not_stored_message

__all__ = ["Admission", "Plan"]

# A model the directory says nothing about: every endpoint, least outstanding.
_ANY_ROUTING = ModelRouting()


class Plan(NamedTuple):
    """A request let in: where it goes and what it sends (a tuple: made once a request)."""

    endpoint: str
    model: str
    key: KeyRecord | None
    body: bytes  # for an upload, its start (the form up to the model field)
    stream: bool = False
    strip_usage: bool = False  # the usage chunk the gateway asked for, not the client
    prefix: str | None = None  # the key of the model's prefix routing
    pinned: Endpoint | None = None  # the replica that holds a previous response
    ask: Ask = NOTHING  # the most it may spend, for the quotas
    # Once let in: the tokens the quotas hold for it (settled or released by
    # its tally, once), and the x-ratelimit-* headers as the limits stood then.
    hold: Reservation | None = None
    limits: Mapping[str, str] | None = None


class Admission:
    """The checks above, against the gateway's keys, directory, access rules and quotas."""

    def __init__(
        self, directory: ModelDirectory, keys: KeyRing | None, quota: QuotaBook | None,
        access: AccessGuard, responses: ResponseHomes,
    ) -> None:
        self.directory, self.keys, self.quota = directory, keys, quota
        self.access, self.responses = access, responses
        self._rules = getattr(directory, "access", None)
        self._routing = getattr(directory, "routing", None)

    def key(self, headers: Mapping[str, str]) -> KeyRecord | Reply | None:
        """The request's key (None without keys), or the 401."""
        if self.keys is None:
            return None
        scheme, _, token = headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            return error(
                401, "No API key: send 'Authorization: Bearer <key>' (ask the admin for a key).",
                "authentication_error", "missing_api_key",
            )
        rec = self.keys.lookup(token.strip())
        if rec is None:
            return error(401, "The API key is not valid or was revoked.",
                         "authentication_error", "invalid_api_key")
        return rec

    def may_use(self, model: str, key: KeyRecord | None) -> bool:
        """Whether ``key`` may use ``model`` by the catalog's access rules."""
        return self._rules is None or self.access.allows(self._rules(model), key)

    def routing(self, model: str) -> ModelRouting:
        got = self._routing(model) if self._routing is not None else None
        return got if isinstance(got, ModelRouting) else _ANY_ROUTING

    def json(self, key: KeyRecord | None, endpoint: str, raw: bytes) -> Plan | Reply:
        """A JSON request's plan, or its refusal."""
        obj = _parse_body(raw)
        if isinstance(obj, Reply):
            return obj
        model = self.model(obj["model"], key, endpoint)
        if isinstance(model, Reply):
            return model
        prepared = _upstream_body(raw, obj, model, endpoint)
        if isinstance(prepared, Reply):
            return prepared
        pinned = self._pinned(model, obj, key) if endpoint == "responses" else None
        if isinstance(pinned, Reply):
            return pinned
        routing = self.routing(model)
        prefix = None
        if routing.policy == "prefix":
            prefix = balance.prefix_key(obj, routing.prefix_chars)
        body, stream, strip = prepared
        ask = NOTHING
        if self.quota is not None and key is not None:
            ask = ask_of(obj, endpoint, routing.context_length,
                         self.quota.config.default_max_tokens)
        return self.let_in(Plan(endpoint, model, key, body, stream, strip, prefix, pinned, ask))

    def model(self, name: str, key: KeyRecord | None, endpoint: str) -> str | Reply:
        """The catalog name of the model a request names, if the key may use it
        for ``endpoint``; else its 404 (the same for a model it may not use) or 400."""
        model = self.directory.resolve(name)
        if model is not None and not self.may_use(model, key):
            self.access.refused(model, key)
            model = None
        if model is None:
            known = self.known_names(key)
            return error(404, f"The model '{name}' does not exist. Known models: {known}.",
                         "invalid_request_error", "model_not_found")
        served = self.routing(model).endpoints
        if served is not None and endpoint not in served:
            return error(400, f"Model '{model}' does not serve {endpoint} (it serves: "
                         f"{', '.join(sorted(served)) or 'none'}).",
                         "invalid_request_error", "endpoint_not_served")
        return model

    def let_in(self, plan: Plan) -> Plan | Reply:
        """The quota's word last: let in, what it may spend held, or its 429."""
        if self.quota is None or plan.key is None:
            return plan
        got = self.quota.reserve(plan.key, plan.ask)
        if isinstance(got, Refusal):
            return self.refused(got)
        return plan._replace(hold=got, limits=got.headers)

    @staticmethod
    def refused(got: Refusal) -> Reply:
        """The quota's 429."""
        headers = {**got.headers, "Retry-After": str(got.retry_after)}
        return error(429, got.message, got.type, got.code, headers)

    def known_names(self, key: KeyRecord | None) -> str:
        parts = [m.name + (f" (aliases: {', '.join(m.aliases)})" if m.aliases else "")
                 for m in self.directory.models() if self.may_use(m.name, key)]
        return "; ".join(parts) or "none"

    def visible(self, headers: Mapping[str, str]) -> Callable[[str], bool]:
        """The models the request's key (or no key) may use, for routes that list them."""
        key = self.key(headers)
        key = key if isinstance(key, KeyRecord) else None
        return lambda model: self.may_use(model, key)

    def _pinned(
        self, model: str, obj: dict[str, Any], key: KeyRecord | None
    ) -> Endpoint | Reply | None:
        """The replica holding ``previous_response_id``, or the 400 saying it cannot be had."""
        prev = obj.get("previous_response_id")
        if not isinstance(prev, str):
            return None
        home = self.responses.get(prev)
        # Another key's response reads as one never seen: ids tell nothing.
        if home is None or home.owner != (key.key_id if key is not None else ""):
            return error(400, f"Previous response '{prev}' is not known to this gateway: it was "
                         "not made through it, or before its last restart. Send the whole "
                         "conversation as input instead.", "invalid_request_error",
                         "previous_response_not_found")
        if home.model != model:
            return error(400, f"Previous response '{prev}' was made by model '{home.model}', "
                         f"not '{model}'.", "invalid_request_error",
                         "previous_response_other_model")
        if self.routing(model).stores_responses is False:
            return error(400, not_stored_message(prev, model), "invalid_request_error",
                         "previous_response_not_stored")
        for e in self.directory.endpoints(model):
            if e.replica_id == home.replica_id and e.epoch == home.epoch:
                return e
        return error(400, f"Previous response '{prev}' was held by replica {home.replica_id} "
                     f"of model '{model}', which has stopped since, and its stored responses "
                     "with it. Send the whole conversation as input instead.",
                     "invalid_request_error", "previous_response_gone")


def _parse_body(raw: bytes) -> dict[str, Any] | Reply:
    """The body as a JSON object with a model name in it, or the 400 that says what is wrong."""
    try:
        # UTF-8 only, as OpenAI's API has it (json.loads would also take
        # UTF-16, which the splicing in with_fields does not handle).
        obj = json.loads(raw.decode("utf-8"))
    except ValueError as e:  # UnicodeDecodeError is a ValueError
        return error(400, f"The body is not valid JSON: {e}", "invalid_request_error",
                     "invalid_json")
    except RecursionError:  # a few kilobytes of "[[[[..." exhaust the parser's stack
        return error(400, "The body's JSON is nested too deeply.", "invalid_request_error",
                     "invalid_json")
    if not isinstance(obj, dict):
        return error(400, "The body must be a JSON object.", "invalid_request_error",
                     "invalid_body")
    name = obj.get("model")
    if not isinstance(name, str) or not name:
        return error(400, "The 'model' field is missing; GET /v1/models lists the models.",
                     "invalid_request_error", "missing_model")
    return obj


def _upstream_body(
    raw: bytes, obj: dict[str, Any], model: str, endpoint: str
) -> tuple[bytes, bool, bool] | Reply:
    """The body for the engine, whether it streams, whether to drop the usage chunk."""
    fields: dict[str, Any] = {}
    if obj["model"] != model:
        fields["model"] = model
    stream = obj.get("stream")
    if stream is not None and not isinstance(stream, bool):
        # Engines read "yes" or 1 as true and would stream without the usage the
        # gateway asks for when it sees a stream coming: tokens nobody counts.
        return error(400, "'stream' must be true or false.", "invalid_request_error",
                     "invalid_type")
    strip = False
    if stream and endpoint in STREAM_USAGE_ENDPOINTS:
        so = obj.get("stream_options")
        if so is None or (isinstance(so, dict) and so.get("include_usage") is not True):
            fields["stream_options"] = {**(so or {}), "include_usage": True}
            strip = True
    return (with_fields(raw, fields, obj.keys()) if fields else raw), stream is True, strip
