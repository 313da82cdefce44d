"""Managing users and their rules (RocketMQ 5's AUTH_* requests): a broker or name server
started with an ACL file changes it and reads it again; only a super user (or one with
``admin`` on the cluster) may ask."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from txmq.protocol.wire.base import Name, Request, Response
from txmq.protocol.wire.codes import RequestCode

__all__ = [
    "AclRule",
    "AclUser",
    "AclUsers",
    "AddAclRule",
    "DeleteAclRule",
    "DeleteUser",
    "GetUser",
    "ListUsers",
    "UpdateUser",
]

#: a user's name is its access key
UserName = Annotated[str, msgspec.Meta(min_length=1, max_length=64)]


class AclRule(Response, frozen=True, kw_only=True, omit_defaults=True):
    """A rule as the file says it (:mod:`txmq.security.acl.policy`)."""

    resource: str
    actions: list[str]
    decision: Literal["allow", "deny"] = "allow"
    sources: list[str] = []


class AclUser(Response, frozen=True, kw_only=True, omit_defaults=True):
    """A user and its rules (never its secret key)."""

    name: str
    super: bool = False
    rules: list[AclRule] = []


class AclUsers(Response, frozen=True, kw_only=True, omit_defaults=True):
    users: list[AclUser]


class UpdateUser(Request[AclUser], frozen=True, kw_only=True, omit_defaults=True):
    """Create a user (``create``: it must be new, and needs a secret key) or change its
    secret key or super flag (what is None stays)."""

    CODE = RequestCode.AUTH_CREATE_USER
    name: UserName
    secret_key: str | None = None
    super: bool | None = None
    create: bool = False


class DeleteUser(Request[AclUser], frozen=True, kw_only=True, omit_defaults=True):
    CODE = RequestCode.AUTH_DELETE_USER
    name: UserName


class GetUser(Request[AclUser], frozen=True, kw_only=True, omit_defaults=True):
    """Who signed this request (``name`` empty or its own): any user may ask of itself
    (a login, ``txmq admin user whoami``); of another user, only an admin of the
    cluster."""

    CODE = RequestCode.AUTH_GET_USER
    name: str = ""


class ListUsers(Request[AclUsers], frozen=True, kw_only=True, omit_defaults=True):
    """Every user (or the one named) with its rules."""

    CODE = RequestCode.AUTH_LIST_USER
    name: str = ""


class AddAclRule(Request[AclUser], frozen=True, kw_only=True, omit_defaults=True):
    """Give ``user`` a rule (replacing its rule on the same resource with the same
    decision)."""

    CODE = RequestCode.AUTH_CREATE_ACL
    user: UserName
    rule: AclRule


class DeleteAclRule(Request[AclUser], frozen=True, kw_only=True, omit_defaults=True):
    """Take ``user``'s rules on ``resource`` away."""

    CODE = RequestCode.AUTH_DELETE_ACL
    user: UserName
    resource: Name
