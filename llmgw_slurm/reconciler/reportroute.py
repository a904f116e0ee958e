"""The internal API's route for signed reports, replicas' and batch jobs' alike.

A report's signature is checked (:mod:`.reports`) before anything is done
with it, and the answer is signed back with the same secret, bound to the
report's nonce (:func:`llmgw_slurm.auth.secrets.reply_signature`): the agent acts
on a ``drain`` only when that signature checks, so a listener on the
daemon's port while it is down, or anyone rewriting the plain-HTTP answer on
the way, is ignored. Only answers to verified reports are signed: signing
the answer to a forged one would sign whatever nonce its sender chose.

What a handler did not foresee is logged and counted
(:class:`llmgw_slurm.guard.faults.Faults`) and answered 500: the agent sends
the report again, the daemon carries on. A report whose nonce could not be
journalled is answered 503, and sent again too.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from aiohttp import web

from llmgw_slurm.auth.secrets import REPLY_HEADER, REPORT_SCHEME, parse_report_auth, reply_signature
from llmgw_slurm.base.errors import ReportNotRecorded
from llmgw_slurm.guard.faults import Faults

__all__ = ["read_signed", "report_route"]

# What a report does: (id, Authorization, the body's bytes, the body) -> the answer.
# Raises PermissionError (401) on a bad signature, ReportNotRecorded (503).
Handle = Callable[[str, str, bytes, Mapping[str, Any]], dict[str, Any]]


def report_route(
    id_key: str, handle: Handle, secret_of: Callable[[str], str], faults: Faults
) -> Callable[[web.Request], Awaitable[web.Response]]:
    """An aiohttp handler for ``POST .../{id_key}/report``; ``secret_of(id)`` signs answers."""

    async def report(request: web.Request) -> web.Response:
        rid = request.match_info[id_key]
        signed = await read_signed(request)
        if isinstance(signed, web.Response):
            return signed
        auth, raw, body = signed
        try:
            answer = handle(rid, auth, raw, body)
        except PermissionError as err:
            return _error(401, str(err))
        except ReportNotRecorded as err:
            return _signed(503, {"ok": False, "error": str(err)}, rid, auth, secret_of)
        except Exception as err:
            faults.record("report", err)
            return _error(500, "the daemon failed on this report (logged); send it again")
        return _signed(200, answer, rid, auth, secret_of)

    return report


async def read_signed(request: web.Request) -> tuple[str, bytes, dict[str, Any]] | web.Response:
    """A signed request's ``Authorization``, its body's exact bytes and the body parsed;
    or the answer (401, 400) when it carries no signature or no JSON object. The
    signature itself is the verifier's to check (``ReportVerifier.verify``): reports
    and an agent's spans alike."""
    auth = request.headers.get("Authorization", "")
    if not auth.startswith(REPORT_SCHEME + " "):
        # A bearer secret included: one copied off the network could be replayed.
        return _error(401, f"missing signature ({REPORT_SCHEME})")
    raw = await request.read()
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError):  # RecursionError: "[[[[..." nested too deep
        return _error(400, "body is not JSON")
    if not isinstance(body, dict):
        return _error(400, "body must be an object")
    return auth, raw, body


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"ok": False, "error": message}, status=status)


def _signed(
    status: int, answer: Mapping[str, Any], rid: str, auth: str, secret_of: Callable[[str], str]
) -> web.Response:
    raw = json.dumps(answer, separators=(",", ":")).encode()
    parsed = parse_report_auth(auth)
    assert parsed is not None, "only a verified report's answer is signed"
    sig = reply_signature(secret_of(rid), rid, parsed[1], status, raw)
    headers = {REPLY_HEADER: sig}
    if status == 503:
        headers["Retry-After"] = "1"
    return web.Response(status=status, body=raw, content_type="application/json", headers=headers)
