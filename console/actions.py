"""The console's actions (POST): create a topic, COMMIT / ROLLBACK a half message, re-send
dead letters.

Each one checks the CSRF token (403 otherwise), then wants ``confirm=yes``: without it
(a browser without JavaScript, whose button could not ask) the answer is a page that asks
and posts the same form again with it.  What was done is logged by the console
(``txmq.console``, with the operator's address) and shown once on the page the browser is
sent back to.
"""

from __future__ import annotations

import logging
from typing import Literal
from urllib.parse import urlencode

from starlette.datastructures import FormData
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import RedirectResponse, Response

from txmq.console.security import FIELD, check_csrf
from txmq.console.web import page, state_of

__all__ = ["create_topic", "dlq_resend", "end_transaction"]

log = logging.getLogger("txmq.console")


async def _form(request: Request) -> FormData:
    form = await request.form()
    check_csrf(request, form, state_of(request).secret)
    return form


def _text(form: FormData, name: str, *, required: bool = True) -> str:
    value = form.get(name, "")
    if not isinstance(value, str):
        raise HTTPException(400, f"{name} must be text")
    if required and not value.strip():
        raise HTTPException(400, f"{name} is missing")
    return value.strip()


def _int(form: FormData, name: str) -> int:
    try:
        return int(_text(form, name))
    except ValueError:
        raise HTTPException(400, f"{name} must be a number") from None


def _confirm(request: Request, form: FormData, question: str) -> Response | None:
    """None when the form says ``confirm=yes``; else the page that asks."""
    if form.get("confirm") == "yes":
        return None
    fields = [(k, v) for k, v in form.multi_items() if k not in (FIELD, "confirm")]
    return page(
        request,
        "confirm",
        {"question": question, "action": request.url.path, "fields": fields},
    )


def _done(request: Request, to: str, kind: str, text: str, **query: str) -> Response:
    key = state_of(request).flash(kind, text)
    return RedirectResponse(f"{to}?{urlencode({**query, 'flash': key})}", status_code=303)


def _who(request: Request) -> str:
    return request.client.host if request.client else "?"


async def create_topic(request: Request) -> Response:
    form = await _form(request)
    topic = _text(form, "topic")
    queues = _int(form, "queues")
    if not 1 <= queues <= 1024:
        raise HTTPException(400, "queues must be 1 to 1024")
    asked = _confirm(request, form, f"Create topic {topic!r} with {queues} queue(s)?")
    if asked is not None:
        return asked
    info = await (await state_of(request).client()).create_topic(topic, queues)
    log.warning("operator %s: created topic %r (%d queues)", _who(request), topic, queues)
    return _done(request, "/topic", "ok", f"topic {topic} has {info.queue_nums} queue(s)",
                 name=topic)  # fmt: skip


async def end_transaction(request: Request) -> Response:
    form = await _form(request)
    state_text = _text(form, "state")
    if state_text not in ("COMMIT", "ROLLBACK"):
        raise HTTPException(400, "state must be COMMIT or ROLLBACK")
    decision: Literal["COMMIT", "ROLLBACK"] = "COMMIT" if state_text == "COMMIT" else "ROLLBACK"
    group = _text(form, "group")
    offset = _int(form, "offset")
    msg_id = _text(form, "msg_id")
    broker = _text(form, "broker", required=False) or None
    asked = _confirm(
        request,
        form,
        f"{decision} the half message {msg_id} of producer group {group!r}? This cannot be undone.",
    )
    if asked is not None:
        return asked
    client = await state_of(request).client()
    ended = await client.end_transaction(
        group=group, transaction_offset=offset, msg_id=msg_id, state=decision, broker=broker
    )
    log.warning(
        "operator %s: %s for half message %s (group %s, offset %d%s): %s%s",
        _who(request),
        decision,
        msg_id,
        group,
        offset,
        f", broker {broker}" if broker else "",
        ended.result,
        f" ({ended.resolution})" if ended.resolution else "",
    )
    if ended.result == "ALREADY_RESOLVED":
        text = (
            f"{msg_id} was not changed: the broker holds it as already resolved "
            f"({ended.resolution or '?'})"
        )
        return _done(request, "/transactions", "warn", text)
    return _done(request, "/transactions", "ok", f"{msg_id}: {ended.result}")


async def dlq_resend(request: Request) -> Response:
    form = await _form(request)
    group = _text(form, "group")
    every = form.get("all") == "yes"
    msg_id = "" if every else _text(form, "msg_id")
    broker = _text(form, "broker", required=False) or None
    what = "every dead letter" if every else f"dead letter {msg_id}"
    asked = _confirm(request, form, f"Re-send {what} of group {group!r} to %RETRY%{group}?")
    if asked is not None:
        return asked
    client = await state_of(request).client()
    resent = await client.dlq_resend(group, None if every else [msg_id], broker=broker)
    log.warning("operator %s: re-sent %s of group %s: %d", _who(request), what, group, resent)
    kind = "ok" if resent else "warn"
    return _done(request, "/dlq", kind, f"re-sent {resent} message(s) to %RETRY%{group}",
                 group=group)  # fmt: skip
