"""The cast of the access-control tests (txmq's protocol and the gRPC endpoint): five users
with their secret keys, and an ACL file of them with the rules a test gives."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from tests.conftest import BrokerProcess
from txmq.security.acl import Acl, Rule

__all__ = ["SECRETS", "as_user", "policy", "secured_broker"]

SECRETS = {
    "alice": "alice-secret",  # publishes
    "bob": "bob-secret-1",  # consumes as group billing
    "carol": "carol-secret",  # a transactional producer
    "mallory": "mallory-secret",  # publishes where carol does, but is not carol
    "ops": "ops-secret-1",  # super user
}


def as_user(name: str) -> dict[str, str]:
    """A client's keyword arguments signing as ``name``."""
    return {"access_key": name, "secret_key": SECRETS[name]}


def policy(rules: Mapping[str, Sequence[tuple[str, str]]]) -> str:
    """The ACL file of the five users (ops a super user), each given ``rules[name]``:
    (resource, "action action ...") pairs."""
    acl = Acl()
    for name, secret in SECRETS.items():
        acl = acl.with_user(name, secret, super_user=name == "ops")
        for resource, actions in rules.get(name, ()):
            rule = Rule.parse({"resource": resource, "actions": actions.split()}, "test")
            acl = acl.with_rule(name, rule)
    return acl.dumps()


def secured_broker(
    broker_process: Callable[..., BrokerProcess],
    folder: Path,
    acl: str,
    env: Mapping[str, str] | None = None,
) -> BrokerProcess:
    """A broker process (started) whose ACL file, ``folder/acl.toml``, is ``acl``."""
    path = folder / "acl.toml"
    path.write_text(acl)
    bp = broker_process()
    bp.env.update({"TXMQ_BROKER_ACL_FILE": str(path), **(env or {})})
    return bp.start()
