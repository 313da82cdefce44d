"""CSRF protection (signed double submit) and the headers every answer carries.

Each browser gets a token in a cookie (``txmq_csrf``: HttpOnly, SameSite=Strict); every
form the console renders carries the same token in a hidden field.  A POST is accepted
only when the field equals the cookie and its signature (HMAC with a secret of this
process) is good: a page of another site can neither read the cookie nor make a token.
Tokens die with the process.

The Content-Security-Policy lets the pages load scripts, styles and images only from the
console itself and no inline script at all: a body or a name that slipped past escaping
still could not run.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets

from starlette.datastructures import FormData
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

__all__ = ["COOKIE", "FIELD", "SecurityHeaders", "check_csrf", "token_for"]

COOKIE = "txmq_csrf"
FIELD = "csrf_token"
HEADERS = [
    (
        b"content-security-policy",
        b"default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
        b"object-src 'none'; base-uri 'none'; frame-ancestors 'none'; form-action 'self'",
    ),
    (b"x-content-type-options", b"nosniff"),
    (b"x-frame-options", b"DENY"),
    (b"referrer-policy", b"same-origin"),
    (b"cache-control", b"no-store"),
]


def _sign(secret: bytes, nonce: str) -> str:
    return hmac.new(secret, nonce.encode(), hashlib.sha256).hexdigest()


def _valid(secret: bytes, token: str) -> bool:
    nonce, _, signature = token.partition(".")
    return bool(nonce) and hmac.compare_digest(signature, _sign(secret, nonce))


def token_for(request: Request, secret: bytes) -> tuple[str, bool]:
    """The browser's token (from its cookie) and False, or a new one and True (to be set
    as the cookie)."""
    token = request.cookies.get(COOKIE, "")
    if token and _valid(secret, token):
        return token, False
    nonce = secrets.token_urlsafe(24)
    return f"{nonce}.{_sign(secret, nonce)}", True


def check_csrf(request: Request, form: FormData, secret: bytes) -> None:
    """Raise 403 unless the form's token equals the cookie's and is this process's."""
    cookie = request.cookies.get(COOKIE, "")
    field = form.get(FIELD)
    if not (
        isinstance(field, str)
        and cookie
        and hmac.compare_digest(field, cookie)
        and _valid(secret, cookie)
    ):
        raise HTTPException(
            403,
            "the form's CSRF token is missing or wrong (reload the page and try again)",
        )


class SecurityHeaders:
    """Adds :data:`HEADERS` to every HTTP answer."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def sending(message: Message) -> None:
            if message["type"] == "http.response.start":
                names = {name for name, _ in message.get("headers", [])}
                extra = [(k, v) for k, v in HEADERS if k not in names]
                message = {**message, "headers": [*message.get("headers", []), *extra]}
            await send(message)

        await self.app(scope, receive, sending)
