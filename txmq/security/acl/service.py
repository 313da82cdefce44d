"""The users-and-rules requests a server with an ACL file answers (the broker and the name
server route them alike): each change is written to the file, which is then in force."""

from __future__ import annotations

from collections.abc import Callable

from txmq.protocol.rpc import Call, Router
from txmq.protocol.settings import SettingsError
from txmq.protocol.wire import (
    AclRule,
    AclUser,
    AclUsers,
    AddAclRule,
    DeleteAclRule,
    DeleteUser,
    GetUser,
    ListUsers,
    UpdateUser,
)
from txmq.protocol.wire.errors import BadRequest
from txmq.security.acl.guard import Guard
from txmq.security.acl.policy import CLUSTER, Acl, Rule, User

__all__ = ["AclService", "user_row"]


def user_row(user: User) -> AclUser:
    """What a server says of a user (never its secret)."""
    return AclUser(
        name=user.name,
        super=user.super_user,
        rules=[AclRule(**r.as_dict()) for r in user.rules],
    )


class AclService:
    """Answers users-and-rules requests; without an ACL file each says access control is
    off here."""

    def __init__(self, guard: Guard | None, who: str) -> None:
        self.guard = guard
        self.who = who

    def route(self, router: Router) -> None:
        router.route(UpdateUser, self.update_user)
        router.route(DeleteUser, self.delete_user)
        router.route(ListUsers, self.list_users)
        router.route(GetUser, self.get_user)
        router.route(AddAclRule, self.add_rule)
        router.route(DeleteAclRule, self.delete_rule)

    def _guard(self) -> Guard:
        if self.guard is None:
            raise BadRequest(
                f"access control is off on {self.who}: start it with --acl FILE to manage users"
            )
        self.guard.reload()  # a change made to the file by hand is not lost
        return self.guard

    def _change(self, name: str, change: Acl) -> AclUser:
        guard = self._guard()
        guard.replace(change)
        user = change.users.get(name)
        return user_row(user) if user is not None else AclUser(name=name)

    def _apply(self, name: str, how: str, make: Callable[[Acl], Acl]) -> AclUser:
        try:
            acl = make(self._guard().acl)
        except SettingsError as exc:
            raise BadRequest(f"{how}: {exc}") from None
        return self._change(name, acl)

    def update_user(self, req: UpdateUser, call: Call) -> AclUser:
        def make(acl: Acl) -> Acl:
            if req.create and req.name in acl.users:
                raise SettingsError(f"user {req.name!r} exists already")
            if not req.create and req.name not in acl.users:
                raise SettingsError(f"no user {req.name!r}")
            return acl.with_user(req.name, req.secret_key, super_user=req.super)

        return self._apply(req.name, "UpdateUser", make)

    def delete_user(self, req: DeleteUser, call: Call) -> AclUser:
        if call.user is not None and call.user.name == req.name:
            raise BadRequest(f"DeleteUser: {req.name!r} may not delete itself")
        return self._apply(req.name, "DeleteUser", lambda acl: acl.without_user(req.name))

    def get_user(self, req: GetUser, call: Call) -> AclUser:
        """Who signed the request (or, for the cluster's admin, any user)."""
        guard = self._guard()
        me = call.user
        if me is None:  # pragma: no cover - a guarded router always puts the user there
            raise BadRequest("GetUser: the request is not signed")
        name = req.name or me.name
        if name != me.name:
            guard.require(me, "admin", CLUSTER, "GetUser", call.conn)
        user = guard.acl.users.get(name)
        if user is None:
            raise BadRequest(f"GetUser: no user {name!r}")
        return user_row(user)

    def list_users(self, req: ListUsers, call: Call) -> AclUsers:
        acl = self._guard().acl
        names = [req.name] if req.name else sorted(acl.users)
        missing = [n for n in names if n not in acl.users]
        if missing:
            raise BadRequest(f"ListUsers: no user {missing[0]!r}")
        return AclUsers(users=[user_row(acl.users[n]) for n in names])

    def add_rule(self, req: AddAclRule, call: Call) -> AclUser:
        rule = req.rule

        def make(acl: Acl) -> Acl:
            raw: dict[str, object] = {
                "resource": rule.resource,
                "actions": rule.actions,
                "decision": rule.decision,
            }
            if rule.sources:
                raw["sources"] = rule.sources
            return acl.with_rule(req.user, Rule.parse(raw, "AddAclRule"))

        return self._apply(req.user, "AddAclRule", make)

    def delete_rule(self, req: DeleteAclRule, call: Call) -> AclUser:
        return self._apply(
            req.user, "DeleteAclRule", lambda acl: acl.without_rule(req.user, req.resource)
        )
