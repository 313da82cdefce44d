"""Users and their policies (RocketMQ's ACL 2.0 model), and the file they live in.

The file is TOML; each user is a table with its secret key, whether it is a super user,
and its rules::

    [users.orders-service]
    secret_key = "orders-secret-1"
    rules = [
      { resource = "topic:orders", actions = ["pub"] },
      { resource = "topic:orders-*", actions = ["sub"], sources = ["10.0.0.0/8"] },
      { resource = "group:billing", actions = ["sub"] },
      { resource = "topic:orders-audit", actions = ["all"], decision = "deny" },
    ]

    [users.ops]
    secret_key = "ops-secret-123"
    super = true

A resource is ``topic:NAME``, ``group:NAME`` (a trailing ``*`` makes either a prefix;
``topic:*`` is every topic), ``cluster`` (the broker itself: listing every topic and group,
runtime information, registering brokers) or ``*`` (everything).  Actions: ``pub``
(send), ``sub`` (consume), ``admin`` (operators' changes) and ``all``.  ``sources`` limits a
rule to client addresses (networks); ``decision`` is ``allow`` (default) or ``deny``.

Deciding: of the rules that match the resource, the action and the client's address, the
most specific resource wins (an exact name over a longer prefix over a shorter one over
``*``); at the same specificity a deny wins.  No rule: denied.  A super user may do
everything.  A retry or dead-letter topic (``%RETRY%g``, ``%DLQ%g``) is its group's
resource ``group:g``; system topics are the ``cluster``'s.
"""

from __future__ import annotations

import functools
import ipaddress
import json
import os
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from functools import cached_property
from pathlib import Path
from typing import Any, Literal, NamedTuple

from txmq.protocol.message import is_system_topic
from txmq.protocol.settings import SettingsError
from txmq.security.credentials import ACCESS_KEY_RULE, Credentials

__all__ = [
    "ACTIONS",
    "Acl",
    "Resource",
    "Rule",
    "User",
    "parse_resource",
    "topic_resource",
]

Action = Literal["pub", "sub", "admin"]
ACTIONS: tuple[str, ...] = ("pub", "sub", "admin", "all")
_KINDS = ("topic", "group")
_RETRY = "%RETRY%"
_DLQ = "%DLQ%"
Network = ipaddress.IPv4Network | ipaddress.IPv6Network


class Resource(NamedTuple):
    """What a request touches: ``kind`` is topic, group or cluster (a tuple: hashed and
    compared in C, as the guard's cache keys are on every request)."""

    kind: str
    name: str = ""

    def __str__(self) -> str:
        return self.kind if self.kind == "cluster" else f"{self.kind}:{self.name}"


CLUSTER = Resource("cluster")


@functools.lru_cache(maxsize=4096)
def topic_resource(topic: str) -> Resource:
    """The resource a topic is: its group's for retry and dead-letter topics, the
    cluster's for system topics."""
    if topic.startswith(_RETRY):
        return Resource("group", topic[len(_RETRY) :])
    if topic.startswith(_DLQ):
        return Resource("group", topic[len(_DLQ) :])
    if is_system_topic(topic):
        return CLUSTER
    return Resource("topic", topic)


@dataclass(frozen=True, slots=True)
class Pattern:
    """A rule's resource: ``*``, ``cluster``, ``KIND:NAME``, ``KIND:PREFIX*``."""

    text: str
    kind: str  # "*": any kind
    name: str  # the name or prefix
    prefix: bool

    def specificity(self, res: Resource) -> int:
        """How specifically this pattern names ``res`` (-1: it does not)."""
        if self.kind == "*":
            return 0
        if self.kind != res.kind:
            return -1
        if self.kind == "cluster":
            return 1 << 20
        if self.prefix:
            return 1 + len(self.name) if res.name.startswith(self.name) else -1
        return 1 << 20 if res.name == self.name else -1


def parse_resource(text: str) -> Pattern:
    """A rule's resource, or SettingsError saying what a resource looks like."""
    text = text.strip()
    if text == "*":
        return Pattern(text, "*", "", True)
    if text == "cluster":
        return Pattern(text, "cluster", "", False)
    kind, sep, name = text.partition(":")
    if not sep or kind not in _KINDS or not name or "*" in name[:-1]:
        raise SettingsError(
            f"resource {text!r} is not topic:NAME, topic:PREFIX*, group:NAME, group:PREFIX*, "
            "cluster or *"
        )
    if name.endswith("*"):
        return Pattern(text, kind, name[:-1], True)
    return Pattern(text, kind, name, False)


@dataclass(frozen=True, slots=True)
class Rule:
    resource: Pattern
    actions: frozenset[str]
    allow: bool = True
    sources: tuple[Network, ...] = ()

    def covers(self, action: str, source: str) -> bool:
        if action not in self.actions:
            return False
        if not self.sources:
            return True
        try:
            addr = ipaddress.ip_address(source)
        except ValueError:
            return False  # an address we cannot read matches no range
        return any(addr in net for net in self.sources)

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"resource": self.resource.text}
        out["actions"] = sorted(self.actions) if len(self.actions) < 3 else ["all"]
        if not self.allow:
            out["decision"] = "deny"
        if self.sources:
            out["sources"] = [str(n) for n in self.sources]
        return out

    @classmethod
    def parse(cls, raw: Any, where: str) -> Rule:
        if not isinstance(raw, Mapping):
            raise SettingsError(f"{where}: a rule is a table with resource and actions")
        unknown = set(raw) - {"resource", "actions", "decision", "sources"}
        if unknown:
            raise SettingsError(f"{where}: unknown key(s) {sorted(unknown)} in a rule")
        resource = raw.get("resource")
        if not isinstance(resource, str):
            raise SettingsError(f'{where}: a rule needs resource = "topic:NAME" (or group:…)')
        try:
            pattern = parse_resource(resource)
        except SettingsError as exc:
            raise SettingsError(f"{where}: {exc}") from None
        actions = raw.get("actions")
        if isinstance(actions, str):
            actions = [actions]
        if not isinstance(actions, list) or not actions:
            raise SettingsError(f"{where}: rule {resource!r} needs actions (pub, sub, admin, all)")
        bad = [a for a in actions if a not in ACTIONS]
        if bad:
            raise SettingsError(
                f"{where}: rule {resource!r}: unknown action(s) {bad} (pub, sub, admin, all)"
            )
        expanded = {"pub", "sub", "admin"} if "all" in actions else set(actions)
        decision = raw.get("decision", "allow")
        if decision not in ("allow", "deny"):
            raise SettingsError(f"{where}: rule {resource!r}: decision is allow or deny")
        sources_raw = raw.get("sources", [])
        if isinstance(sources_raw, str):
            sources_raw = [sources_raw]
        sources: list[Network] = []
        for src in sources_raw:
            try:
                sources.append(ipaddress.ip_network(str(src), strict=False))
            except ValueError:
                raise SettingsError(
                    f"{where}: rule {resource!r}: source {src!r} is not an address or a "
                    "network like 10.0.0.0/8"
                ) from None
        return cls(pattern, frozenset(expanded), decision == "allow", tuple(sources))


@dataclass(frozen=True)
class User:
    name: str
    secret_key: str = field(repr=False)
    super_user: bool = False
    rules: tuple[Rule, ...] = ()

    @cached_property
    def secret(self) -> bytes:
        return self.secret_key.encode()

    def may(self, action: str, res: Resource, source: str) -> bool:
        """Whether this user may do ``action`` on ``res`` from address ``source``."""
        if self.super_user:
            return True
        best = -1
        allowed = False
        for rule in self.rules:
            spec = rule.resource.specificity(res)
            if spec < best or spec < 0 or not rule.covers(action, source):
                continue
            if spec > best:
                best, allowed = spec, rule.allow
            elif not rule.allow:
                allowed = False
        return allowed

    def as_dict(self, *, secret: bool = True) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if secret:
            out["secret_key"] = self.secret_key
        if self.super_user:
            out["super"] = True
        if self.rules:
            out["rules"] = [r.as_dict() for r in self.rules]
        return out


@dataclass(frozen=True)
class Acl:
    """Every user (by access key) and its rules; what an ACL file holds."""

    users: Mapping[str, User] = field(default_factory=dict)

    def user(self, access_key: str) -> User | None:
        return self.users.get(access_key)

    # -- changes (each gives a new Acl) ---------------------------------------------------

    def with_user(
        self, name: str, secret_key: str | None = None, *, super_user: bool | None = None
    ) -> Acl:
        """``name`` created (it needs a secret key) or changed."""
        old = self.users.get(name)
        if old is None:
            if not secret_key:
                raise SettingsError(f"user {name!r} is new: it needs a secret key")
            Credentials(name, secret_key)  # the same rules as a client's
            user = User(name, secret_key, bool(super_user))
        else:
            if secret_key is not None:
                Credentials(name, secret_key)
            user = replace(
                old,
                secret_key=old.secret_key if secret_key is None else secret_key,
                super_user=old.super_user if super_user is None else super_user,
            )
        return Acl({**self.users, name: user})

    def without_user(self, name: str) -> Acl:
        self._need(name)
        return Acl({k: v for k, v in self.users.items() if k != name})

    def with_rule(self, name: str, rule: Rule) -> Acl:
        """``rule`` added to ``name``'s (replacing a rule of the same resource and
        decision)."""
        user = self._need(name)
        rules = [
            r for r in user.rules if (r.resource.text, r.allow) != (rule.resource.text, rule.allow)
        ]
        return Acl({**self.users, name: replace(user, rules=(*rules, rule))})

    def without_rule(self, name: str, resource: str) -> Acl:
        user = self._need(name)
        text = parse_resource(resource).text
        rules = tuple(r for r in user.rules if r.resource.text != text)
        if len(rules) == len(user.rules):
            raise SettingsError(f"user {name!r} has no rule on {text!r}")
        return Acl({**self.users, name: replace(user, rules=rules)})

    def _need(self, name: str) -> User:
        user = self.users.get(name)
        if user is None:
            raise SettingsError(f"no user {name!r}")
        return user

    # -- the file -------------------------------------------------------------------------

    @classmethod
    def parse(cls, doc: Mapping[str, Any], where: str) -> Acl:
        unknown = set(doc) - {"users"}
        if unknown:
            raise SettingsError(f"{where}: unknown table(s) {sorted(unknown)} (only [users.NAME])")
        raw_users = doc.get("users", {})
        if not isinstance(raw_users, Mapping):
            raise SettingsError(f"{where}: users is a table of [users.NAME] tables")
        users: dict[str, User] = {}
        for name, raw in raw_users.items():
            at = f"{where} [users.{name}]"
            if not ACCESS_KEY_RULE.fullmatch(name):
                raise SettingsError(
                    f"{at}: a user name (its access key) is 1-64 letters, digits and _ . @ -"
                )
            if not isinstance(raw, Mapping):
                raise SettingsError(f"{at}: not a table")
            unknown = set(raw) - {"secret_key", "super", "rules"}
            if unknown:
                raise SettingsError(f"{at}: unknown key(s) {sorted(unknown)}")
            secret = raw.get("secret_key")
            if not isinstance(secret, str) or len(secret) < 8:
                raise SettingsError(f"{at}: secret_key must be a string of at least 8 characters")
            sup = raw.get("super", False)
            if not isinstance(sup, bool):
                raise SettingsError(f"{at}: super is true or false")
            rules_raw = raw.get("rules", [])
            if not isinstance(rules_raw, list):
                raise SettingsError(f"{at}: rules is a list of {{ resource = …, actions = […] }}")
            rules = tuple(Rule.parse(r, at) for r in rules_raw)
            users[name] = User(name, secret, sup, rules)
        return cls(users)

    @classmethod
    def load(cls, path: Path) -> Acl:
        """The ACL in ``path`` (SettingsError naming the file and what is wrong)."""
        try:
            with path.open("rb") as fh:
                doc = tomllib.load(fh)
        except OSError as exc:
            raise SettingsError(f"cannot read the ACL file {path}: {exc.strerror or exc}") from None
        except tomllib.TOMLDecodeError as exc:
            raise SettingsError(f"the ACL file {path} is not valid TOML: {exc}") from None
        return cls.parse(doc, str(path))

    def dumps(self) -> str:
        """The ACL as the file's TOML."""
        lines = [
            "# txmq access control: users (access key = the table's name) and their rules.",
            "# The broker and the name server read it again when it changes.",
        ]
        for name in sorted(self.users):
            user = self.users[name]
            lines += ["", f"[users.{_key(name)}]", f"secret_key = {_str(user.secret_key)}"]
            if user.super_user:
                lines.append("super = true")
            if user.rules:
                lines.append("rules = [")
                lines += [f"  {_inline(r.as_dict())}," for r in user.rules]
                lines.append("]")
        return "\n".join(lines) + "\n"

    def save(self, path: Path) -> None:
        """Write the file atomically, readable by its owner only (it holds secrets)."""
        tmp = path.with_name(f".{path.name}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(self.dumps())
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)


def _str(text: str) -> str:
    # a JSON string is a TOML basic string (the same escapes)
    return json.dumps(text, ensure_ascii=False)


def _key(name: str) -> str:
    return name if all(c.isalnum() or c in "_-" for c in name) else _str(name)


def _inline(values: Mapping[str, Any]) -> str:
    parts = []
    for k, v in values.items():
        if isinstance(v, list):
            text = "[" + ", ".join(_str(x) for x in v) + "]"
        else:
            text = _str(v)
        parts.append(f"{k} = {text}")
    return "{ " + ", ".join(parts) + " }"
