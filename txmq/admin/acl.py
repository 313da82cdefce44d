"""Users and their access rules, a part of :class:`txmq.admin.client.AdminClient`: create, change
and delete users (an access key and its secret key), give them rules and take rules away,
list them — on every server that reads an ACL file.

Each broker and each name server started with an ACL file keeps its own copy, so a change
goes to all of them: given one broker directly, to that broker; given name servers, to
every broker of every broker set (masters and slaves alike) and to every name server of
this client.  A change that fails somewhere raises, saying where it was done and where
not (make it again: creating a user that exists already is refused, changing it is not).
Only a super user (or a user with ``admin`` on ``cluster``) may ask; the client signs with
its own credentials (``access_key=``/``secret_key=``, or ``$TXMQ_ACCESS_KEY`` /
``$TXMQ_SECRET_KEY``).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence

import msgspec

from txmq.admin.fanout import BrokerAddress, ClusterClient, failure
from txmq.protocol.wire import (
    MASTER_ID,
    AclRule,
    AclUser,
    AclUsers,
    AddAclRule,
    DeleteAclRule,
    DeleteUser,
    ListUsers,
    Request,
    UpdateUser,
)
from txmq.security.credentials import Credentials

__all__ = ["AclAdmin", "AclTarget"]

log = logging.getLogger("txmq.admin")

#: the broker id an :class:`AclTarget` that is a name server has
NAMESRV_ID = -1


class AclTarget(BrokerAddress):
    """A server whose ACL file a change goes to: a broker (``broker_name`` says which set
    and, for a slave, its broker id) or a name server (``broker_id`` -1)."""

    __slots__ = ()

    @property
    def is_namesrv(self) -> bool:
        return self.broker_id == NAMESRV_ID

    def __str__(self) -> str:
        if self.is_namesrv or not self.broker_name:
            return self.broker_name or self.address
        return f"{self.broker_name} ({self.address})"


class AclAdmin(ClusterClient):
    """Users and rules, for :class:`txmq.admin.client.AdminClient`."""

    async def acl_targets(self) -> list[AclTarget]:
        """The servers a user or rule change goes to: the broker given directly; or every
        broker the name servers know (each broker set's master, then its slaves), then
        every name server of this client."""
        if self.direct is not None:
            return [AclTarget("", "", MASTER_ID, self.direct)]
        info = await self.cluster_info()
        out: list[AclTarget] = []
        for b in sorted(info.brokers, key=lambda b: (b.cluster, b.broker_name)):
            for broker_id, address in sorted(b.addresses.items()):
                label = (
                    b.broker_name
                    if broker_id == MASTER_ID
                    else f"{b.broker_name} slave {broker_id}"
                )
                out.append(AclTarget(b.cluster, label, broker_id, address))
        if not out:
            log.warning("the name servers know no broker: users are changed on them alone")
        out += [AclTarget("", f"name server {a}", NAMESRV_ID, a) for a in self.namesrv]
        once: dict[str, AclTarget] = {}
        for t in out:
            once.setdefault(t.address, t)
        return list(once.values())

    # -- users ----------------------------------------------------------------------------

    async def create_user(self, name: str, secret_key: str, *, super_user: bool = False) -> AclUser:
        """Create user ``name`` (its access key) with ``secret_key`` (at least 8
        characters); ``super_user``: it may do everything, managing users included.  A
        user of that name must not exist yet (on any server)."""
        Credentials(name, secret_key)  # ValueError (SettingsError) before asking anyone
        request = UpdateUser(name=name, secret_key=secret_key, super=super_user, create=True)
        return await self._change(request, f"user {name!r} created")

    async def update_user(
        self, name: str, *, secret_key: str | None = None, super_user: bool | None = None
    ) -> AclUser:
        """Change user ``name``'s secret key and/or whether it is a super user (None: as
        it is)."""
        if secret_key is None and super_user is None:
            raise ValueError(f"nothing to change for user {name!r}: a secret key or super_user")
        if secret_key is not None:
            Credentials(name, secret_key)
        request = UpdateUser(name=name, secret_key=secret_key, super=super_user)
        return await self._change(request, f"user {name!r} updated")

    async def delete_user(self, name: str) -> AclUser:
        """Delete user ``name``: its requests are refused at once (AuthenticationFailed).
        A user may not delete itself.  The answer names the deleted user."""
        return await self._change(DeleteUser(name=name), f"user {name!r} deleted")

    async def users(self, name: str | None = None) -> list[AclUser]:
        """Every user (or only ``name``) with its rules, never a secret key, by name.
        Every server is asked; the first one's answer is returned, and servers that answer
        differently (their ACL files differ) are logged as a warning."""
        targets = await self.acl_targets()
        request = ListUsers(name=name or "")
        answers, errors = await self._gather(targets, lambda t: self.ask(t, request))
        if not answers:
            raise failure([(targets[i], errors[i]) for i in sorted(errors)])
        for i in sorted(errors):
            log.warning("%s did not list its users: %s", targets[i], errors[i])
        found: list[tuple[BrokerAddress, AclUsers]] = [
            (targets[i], answers[i]) for i in sorted(answers)
        ]
        _warn_if_different(found, "users")
        return list(found[0][1].users)

    # -- rules ----------------------------------------------------------------------------

    async def add_rule(
        self,
        user: str,
        resource: str,
        actions: Iterable[str],
        *,
        deny: bool = False,
        sources: Iterable[str] = (),
    ) -> AclUser:
        """Give ``user`` a rule: ``actions`` (``pub``, ``sub``, ``admin``, ``all``) on
        ``resource`` (``topic:NAME``, ``topic:PREFIX*``, ``group:NAME``, ``group:PREFIX*``,
        ``cluster`` or ``*``) allowed (``deny``: denied), from any address or only from
        ``sources`` (addresses or networks like ``10.0.0.0/8``).  It replaces the user's
        rule of the same resource and decision."""
        # the servers check the rule (and answer BadRequest saying what is wrong with it)
        rule = AclRule(
            resource=resource.strip(),
            actions=list(actions),
            decision="deny" if deny else "allow",
            sources=list(sources),
        )
        request = AddAclRule(user=user, rule=rule)
        return await self._change(request, f"rule on {rule.resource} given to {user!r}")

    async def delete_rule(self, user: str, resource: str) -> AclUser:
        """Take ``user``'s rules on ``resource`` away (allow and deny alike)."""
        request = DeleteAclRule(user=user, resource=resource.strip())
        return await self._change(request, f"rules on {resource.strip()} of {user!r} deleted")

    # -- helpers --------------------------------------------------------------------------

    async def _change(self, request: Request[AclUser], done: str) -> AclUser:
        """``request`` made on every target; the user as the first target has it after."""
        targets = await self.acl_targets()
        found = await self._all_or_raise(targets, lambda t: self.ask(t, request), done)
        _warn_if_different(found, "user")
        return found[0][1]


def _warn_if_different(
    found: Sequence[tuple[BrokerAddress, AclUser | AclUsers]], what: str
) -> None:
    """Log which servers answer differently from the first (their ACL files differ)."""
    if len(found) < 2:
        return
    first_target, first = found[0]
    encoded = msgspec.json.encode(first)
    differ = [str(t) for t, answer in found[1:] if msgspec.json.encode(answer) != encoded]
    if differ:
        log.warning(
            "the servers' ACL files differ: what %s say(s) of the %s is not what %s says "
            "(each server reads its own file)",
            ", ".join(differ),
            what,
            first_target,
        )
