"""The console's actions (POST): create or delete a topic, COMMIT / ROLLBACK / RECHECK a
half message (an operator's decision, with a reason), re-send dead letters, reset a
consumer group's offsets to a time.

Each one checks the CSRF token (403 otherwise), then wants ``confirm=yes``: without it
(a browser without JavaScript, whose button could not ask) the answer is a page that asks
and posts the same form again with it.  Deleting a topic wants the topic's name instead,
typed by the operator (``typed``: a click is not enough); anything else deletes nothing
and asks again.  What the brokers refuse (a user's missing right, with ``--login``) is an
error page of one line, as for every page.  What was done is logged by the console
(``txmq.console``, with the operator's address, and with ``--login`` its user) and shown
once on the page the browser is sent back to.
"""

from __future__ import annotations

import logging
from datetime import UTC, datetime
from urllib.parse import urlencode

from starlette.datastructures import FormData
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import RedirectResponse, Response

from txmq.console.security import FIELD, check_csrf
from txmq.console.web import client_of, page, session_of, state_of
from txmq.protocol.message import is_system_topic

__all__ = ["create_topic", "decide_transaction", "delete_topic", "dlq_resend", "reset_offsets"]

log = logging.getLogger("txmq.console")


async def read_form(request: Request) -> FormData:
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


def text_field(form: FormData, name: str, *, required: bool = True) -> str:
    """A form's text field, stripped (400 when required and empty)."""
    return _text(form, name, required=required)


def int_field(form: FormData, name: str) -> int:
    try:
        return int(_text(form, name))
    except ValueError:
        raise HTTPException(400, f"{name} must be a number") from None


def confirm(request: Request, form: FormData, question: str) -> Response | None:
    """None when the form says ``confirm=yes``; else the page that asks."""
    return None if form.get("confirm") == "yes" else _ask(request, form, question)


def ask_with_reason(
    request: Request, form: FormData, question: str, label: str, *, missing: bool = False
) -> Response:
    """The page that asks ``question`` and a reason (its field labelled ``label``), and
    posts the form again with ``confirm=yes``."""
    return _ask(request, form, question, reason=True, missing=missing, label=label)


def _ask(
    request: Request,
    form: FormData,
    question: str,
    *,
    reason: bool = False,
    missing: bool = False,
    label: str = "Reason (recorded by the broker with your decision)",
    typed: str = "",
    wrong: str = "",
    cancel: str = "/cluster",
) -> Response:
    """The page that asks ``question`` and posts the form again with ``confirm=yes``
    (``reason``: and with a reason the operator types; ``missing``: it was left empty;
    ``typed``: and with this text typed again by the operator, ``wrong``: what was typed
    instead, said in one line, the answer a 400)."""
    skip = {FIELD, "confirm"} | ({"reason"} if reason else set()) | ({"typed"} if typed else set())
    fields = [(k, v) for k, v in form.multi_items() if k not in skip]
    return page(
        request,
        "confirm",
        {
            "question": question,
            "action": request.url.path,
            "fields": fields,
            "reason": reason,
            "reason_label": label,
            "reason_missing": missing,
            "typed": typed,
            "typed_wrong": wrong,
            "cancel": cancel,
        },
        status=400 if wrong else 200,
    )


def done(request: Request, to: str, kind: str, text: str, **query: str) -> Response:
    key = state_of(request).flash(kind, text)
    return RedirectResponse(f"{to}?{urlencode({**query, 'flash': key})}", status_code=303)


def who(request: Request) -> str:
    """Who acts: the client's address (and with --login the user, ``bob@10.0.0.7``)."""
    host = request.client.host if request.client else "?"
    session = session_of(request)
    return f"{session.user}@{host}" if session is not None else host


async def create_topic(request: Request) -> Response:
    form = await read_form(request)
    topic = _text(form, "topic")
    queues = int_field(form, "queues")
    if not 1 <= queues <= 1024:
        raise HTTPException(400, "queues must be 1 to 1024")
    asked = confirm(request, form, f"Create topic {topic!r} with {queues} queue(s)?")
    if asked is not None:
        return asked
    info = await (await client_of(request)).create_topic(topic, queues)
    log.warning("operator %s: created topic %r (%d queues)", who(request), topic, queues)
    return done(request, "/topic", "ok", f"topic {topic} has {info.queue_nums} queue(s)",
                 name=topic)  # fmt: skip


async def delete_topic(request: Request) -> Response:
    """Delete a topic from every broker set holding it — what ``txmq admin topic delete``
    does, through the same admin call — once the operator has typed its name (``typed``).
    A system topic is refused before the brokers are asked, by the check they make
    themselves (:func:`~txmq.protocol.message.is_system_topic`)."""
    form = await read_form(request)
    topic = _text(form, "topic")
    if is_system_topic(topic):
        raise HTTPException(
            400, f"{topic} is a system topic: the brokers need it, it cannot be deleted"
        )
    typed = _text(form, "typed", required=False)
    if typed != topic:
        question = (
            f"Delete topic {topic!r} from every broker set holding it? Its queues and "
            "messages are dropped, and the consumer groups' offsets of it. This cannot be "
            "undone."
        )
        return _ask(request, form, question, typed=topic, wrong=typed, cancel="/topics")
    client = await client_of(request)
    # where it is (a topic no broker holds: 404), for the operator; then the admin call
    sets = sorted({q.broker_name for q in await client.topic_stats(topic)} - {""})
    await client.delete_topic(topic)
    where = f" from {', '.join(sets)}" if sets else ""
    log.warning("operator %s: deleted topic %r%s", who(request), topic, where)
    return done(request, "/topics", "ok", f"topic {topic} deleted{where}")


async def decide_transaction(request: Request) -> Response:
    """COMMIT / ROLLBACK a pending or parked half message, or RECHECK parked ones (one, or
    ``all=yes``), as an operator: the broker records the decision with its reason."""
    form = await read_form(request)
    decision = _text(form, "decision")
    if decision not in ("COMMIT", "ROLLBACK", "RECHECK"):
        raise HTTPException(400, "decision must be COMMIT, ROLLBACK or RECHECK")
    every = decision == "RECHECK" and form.get("all") == "yes"
    msg_id = "" if every else _text(form, "msg_id")
    group = _text(form, "group", required=False) or None
    broker = _text(form, "broker", required=False) or None
    reason = _text(form, "reason", required=False)
    what = (
        f"every parked half message{f' of producer group {group!r}' if group else ''}"
        if every
        else f"the half message {msg_id}{f' of producer group {group!r}' if group else ''}"
    )
    question = {
        "COMMIT": f"COMMIT {what}? Its consumers will receive it. This cannot be undone.",
        "ROLLBACK": f"ROLLBACK {what}? It will never be delivered. This cannot be undone.",
        "RECHECK": f"Check {what} back again with its producer group, from the first check?",
    }[decision]
    needs_reason = decision != "RECHECK"
    confirmed = form.get("confirm") == "yes"
    if not confirmed or (needs_reason and not reason):
        missing = confirmed  # confirmed without a reason (a browser that let it pass)
        return _ask(request, form, question, reason=needs_reason, missing=missing)
    client = await client_of(request)
    rows = await client.decide_transaction(
        decision,  # type: ignore[arg-type]
        msg_id=msg_id or None,
        all=every,
        group=group if every else None,
        reason=reason,
        operator=f"console ({who(request)})",
        broker=broker,
    )
    log.warning(
        "operator %s: %s %s: %d half message(s)%s",
        who(request),
        decision,
        what,
        len(rows),
        f" ({reason})" if reason else "",
    )
    if decision == "RECHECK":
        kind = "ok" if rows else "warn"
        return done(request, "/transactions", kind, f"re-checking {len(rows)} half message(s)")
    return done(request, "/transactions", "ok", f"{msg_id}: {decision} recorded")


async def dlq_resend(request: Request) -> Response:
    form = await read_form(request)
    group = _text(form, "group")
    every = form.get("all") == "yes"
    msg_id = "" if every else _text(form, "msg_id")
    broker = _text(form, "broker", required=False) or None
    what = "every dead letter" if every else f"dead letter {msg_id}"
    asked = confirm(request, form, f"Re-send {what} of group {group!r} to %RETRY%{group}?")
    if asked is not None:
        return asked
    client = await client_of(request)
    resent = await client.dlq_resend(group, None if every else [msg_id], broker=broker)
    log.warning("operator %s: re-sent %s of group %s: %d", who(request), what, group, resent)
    kind = "ok" if resent else "warn"
    return done(request, "/dlq", kind, f"re-sent {resent} message(s) to %RETRY%{group}",
                 group=group)  # fmt: skip


async def reset_offsets(request: Request) -> Response:
    form = await read_form(request)
    group = _text(form, "group")
    topic = _text(form, "topic")
    try:  # a datetime-local input: 2026-11-25T10:00 or 2026-11-25T10:00:05, in UTC
        to = datetime.fromisoformat(_text(form, "to"))
    except ValueError:
        raise HTTPException(400, "to must be a date and time (2026-11-25T10:00)") from None
    to = to if to.tzinfo else to.replace(tzinfo=UTC)
    when = to.strftime("%Y-%m-%d %H:%M:%S %Z")
    asked = confirm(
        request,
        form,
        f"Reset the offsets of group {group!r} on topic {topic!r} to {when}? Its consumers "
        "go to the first message stored from then on (again, or skipping the ones before).",
    )
    if asked is not None:
        return asked
    rows = await (await client_of(request)).reset_offsets(group, topic, to)
    moved = sum(1 for r in rows if r.new_offset != r.old_offset)
    log.warning(
        "operator %s: reset offsets of group %s on topic %s to %s: %s",
        who(request),
        group,
        topic,
        when,
        ", ".join(
            f"{r.broker_name + '/' if r.broker_name else ''}{r.queue_id}: "
            f"{r.old_offset} -> {r.new_offset}"
            for r in rows
        ),
    )
    text = f"offsets of {topic} reset to {when}: {moved} of {len(rows)} queue(s) moved"
    return done(request, "/group", "ok", text, group=group)
