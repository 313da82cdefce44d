"""``txmq admin user`` and ``txmq admin acl``: the users of servers started with an ACL file
(their access keys, secret keys and whether they are super users) and their rules — on one
broker, or on every broker and name server of a cluster (each reads its own file).

Secrets never come from the command line (``ps`` shows it): a new secret key is generated
and printed once, or read from stdin (``--secret-stdin``); the command's own credentials
come from the environment or the configuration file."""

from __future__ import annotations

import argparse
import getpass
import json
import secrets
import sys
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, TypeVar

from txmq.cli.options import CommandError, SubParsers, add_command, endpoints
from txmq.cli.tables import table

if TYPE_CHECKING:
    from txmq.admin.client import AdminClient
    from txmq.protocol.wire import AclRule, AclUser

__all__ = ["add_acl", "rule_text", "run_acl"]

T = TypeVar("T")

CREDENTIALS = (
    "The command signs its requests as the user named by TXMQ_ACCESS_KEY and\n"
    "TXMQ_SECRET_KEY (or the [client] table of $TXMQ_CONFIG), never by an option that\n"
    "'ps' would show: a super user, or one with the admin right on cluster. Through\n"
    "name servers (--namesrv) a change is made on every broker (masters and slaves)\n"
    "and every name server given, as each reads its own ACL file."
)
RESOURCE_HELP = "topic:NAME, topic:PREFIX*, group:NAME, group:PREFIX*, cluster or *"


def _about(text: str) -> str:
    return f"{text}\n\n{CREDENTIALS}"


def add_acl(asub: SubParsers) -> None:
    """``txmq admin user create | update | delete | list`` and ``txmq admin acl add |
    delete | list``."""
    _add_user(asub)
    _add_rules(asub)


def _add_user(asub: SubParsers) -> None:
    u = add_command(
        asub,
        "user",
        help="users of servers with access control: create, change, delete, list",
        description=_about(
            "The users of brokers and name servers started with an ACL file: each user is an\n"
            "access key (its name) with a secret key, a super user (may do everything) or\n"
            "not, and rules ('txmq admin acl')."
        ),
        examples="  TXMQ_ACCESS_KEY=ops TXMQ_SECRET_KEY=... txmq admin user create orders-service\n"
        "  txmq admin user create ops2 --super --secret-stdin < secret.txt\n"
        "  txmq admin user update orders-service --new-secret\n"
        "  txmq admin user list --namesrv 127.0.0.1:9876 --json\n"
        "  txmq admin user delete orders-service",
    )
    usub = u.add_subparsers(dest="user_cmd", required=True, metavar="COMMAND")
    cr = add_command(
        usub,
        "create",
        help="create a user (its secret key generated and shown once, or read from stdin)",
        description=_about(
            "Create user NAME (its access key: letters, digits and _ . @ -). Its secret key\n"
            "is generated and printed once (keep it: it is not shown again), or read from\n"
            "the first line of stdin with --secret-stdin (at least 8 characters)."
        ),
        examples="  txmq admin user create orders-service\n"
        "  txmq admin user create ops2 --super\n"
        "  printf '%s\\n' \"$SECRET\" | txmq admin user create billing --secret-stdin",
    )
    cr.add_argument("name", metavar="NAME", help="the user's name (its access key)")
    cr.add_argument("--super", action="store_true", help="a super user: may do everything")
    cr.add_argument(
        "--secret-stdin", action="store_true", help="read the secret key from stdin (one line)"
    )
    up = add_command(
        usub,
        "update",
        help="change a user's secret key or whether it is a super user",
        description=_about(
            "Change user NAME: make it a super user or not (--super / --no-super), give it a\n"
            "new secret key, generated and printed once (--new-secret) or read from stdin\n"
            "(--secret-stdin). Its requests signed with the old key are refused at once."
        ),
        examples="  txmq admin user update orders-service --new-secret\n"
        "  txmq admin user update ops2 --no-super\n"
        "  txmq admin user update billing --secret-stdin < new-secret.txt",
    )
    up.add_argument("name", metavar="NAME", help="the user's name (its access key)")
    up.add_argument(
        "--super",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="make it a super user (--no-super: not)",
    )
    secret = up.add_mutually_exclusive_group()
    secret.add_argument(
        "--new-secret", action="store_true", help="generate a new secret key (printed once)"
    )
    secret.add_argument(
        "--secret-stdin", action="store_true", help="read the new secret key from stdin"
    )
    de = add_command(
        usub,
        "delete",
        help="delete a user (its requests are refused at once)",
        description=_about("Delete user NAME and its rules. A user may not delete itself."),
        examples="  txmq admin user delete orders-service",
    )
    de.add_argument("name", metavar="NAME", help="the user's name (its access key)")
    ls = add_command(
        usub,
        "list",
        help="list users with their rules (never their secret keys)",
        description=_about(
            "List every user (or NAME) with whether it is a super user and its rules, never\n"
            "a secret key. Through name servers every server is asked; the first one's\n"
            "answer is shown, and servers whose files differ are named in a warning."
        ),
        examples="  txmq admin user list\n  txmq admin user list orders-service --json",
    )
    ls.add_argument("name", metavar="NAME", nargs="?", help="only this user")


def _add_rules(asub: SubParsers) -> None:
    a = add_command(
        asub,
        "acl",
        help="users' rules: what each may do on which topics and groups",
        description=_about(
            "A user's rules: ACTIONs (pub: send, sub: consume, admin: operators' changes,\n"
            "all) on a RESOURCE (topic:NAME, topic:PREFIX*, group:NAME, group:PREFIX*,\n"
            "cluster or *), allowed or denied, from any address or only from some\n"
            "(--source). The most specific resource wins; at the same one a deny wins; no\n"
            "rule: denied."
        ),
        examples="  txmq admin acl add orders-service topic:orders pub\n"
        "  txmq admin acl add billing 'topic:orders-*' sub --source 10.0.0.0/8\n"
        "  txmq admin acl add billing group:billing sub\n"
        "  txmq admin acl add billing topic:orders-audit all --deny\n"
        "  txmq admin acl list billing\n"
        "  txmq admin acl delete billing 'topic:orders-*'",
    )
    asub2 = a.add_subparsers(dest="acl_cmd", required=True, metavar="COMMAND")
    ad = add_command(
        asub2,
        "add",
        help="give a user a rule",
        description=_about(
            "Give USER a rule: ACTIONs (pub, sub, admin, all) on RESOURCE (topic:NAME,\n"
            "topic:PREFIX*, group:NAME, group:PREFIX*, cluster or *), allowed (--deny:\n"
            "denied), from anywhere or only from --source addresses or networks. It\n"
            "replaces USER's rule on the same RESOURCE with the same decision. In force at\n"
            "once."
        ),
        examples="  txmq admin acl add orders-service topic:orders pub\n"
        "  txmq admin acl add billing 'group:billing*' sub --source 10.0.0.0/8 "
        "--source 192.168.1.7\n"
        "  txmq admin acl add intern '*' all --deny",
    )
    ad.add_argument("user", metavar="USER")
    ad.add_argument("resource", metavar="RESOURCE", help=RESOURCE_HELP)
    ad.add_argument("actions", metavar="ACTION", nargs="+", help="pub, sub, admin or all")
    ad.add_argument("--deny", action="store_true", help="a rule that denies")
    ad.add_argument(
        "--source",
        action="append",
        default=[],
        metavar="CIDR",
        help="only from this address or network (repeat for several)",
    )
    de = add_command(
        asub2,
        "delete",
        help="take a user's rules on a resource away",
        description=_about("Take USER's rules on RESOURCE away (allow and deny alike)."),
        examples="  txmq admin acl delete orders-service topic:orders",
    )
    de.add_argument("user", metavar="USER")
    de.add_argument("resource", metavar="RESOURCE", help=RESOURCE_HELP)
    ls = add_command(
        asub2,
        "list",
        help="list users' rules",
        description=_about(
            "List every user's rules (or USER's), one line each. --json: one object per rule\n"
            "with its user."
        ),
        examples="  txmq admin acl list\n  txmq admin acl list billing --json",
    )
    ls.add_argument("user", metavar="USER", nargs="?", help="only this user")


# -- running ------------------------------------------------------------------------------


def run_acl(args: argparse.Namespace) -> int:
    """``txmq admin user ...`` or ``txmq admin acl ...``."""
    if args.admin_cmd == "user":
        return _run_user(args)
    return _run_rules(args)


def _run(args: argparse.Namespace, do: Callable[[AdminClient], Awaitable[T]]) -> T:
    """``do`` with an admin client of ``args``' endpoints; refusals said with a hint."""
    import anyio

    from txmq.admin.client import AdminClient
    from txmq.protocol.wire.errors import AuthenticationFailed, NoPermission

    where = endpoints(args)

    async def ask() -> T:
        async with AdminClient(where["address"], namesrv=where["namesrv"]) as admin:
            return await do(admin)

    try:
        return anyio.run(ask)
    except AuthenticationFailed as exc:
        raise CommandError(
            f"{exc} (this command signs as TXMQ_ACCESS_KEY / TXMQ_SECRET_KEY, or the "
            "[client] table of $TXMQ_CONFIG: a super user's)"
        ) from None
    except NoPermission as exc:
        raise CommandError(
            f"{exc} (managing users needs a super user, or the admin right on cluster)"
        ) from None


def _run_user(args: argparse.Namespace) -> int:
    cmd, name = args.user_cmd, args.name
    if cmd == "list":
        _print_users(_run(args, lambda admin: admin.users(name)), args.json, args.wide)
        return 0
    if cmd == "delete":
        deleted = _run(args, lambda admin: admin.delete_user(name))
        _done(args, deleted, f"user {deleted.name} deleted", show=False)
        return 0
    generated = (cmd == "create" and not args.secret_stdin) or (cmd == "update" and args.new_secret)
    secret: str | None = None
    if args.secret_stdin:
        secret = _secret_from_stdin()
    elif generated:
        secret = secrets.token_urlsafe(24)
    if cmd == "create":
        assert secret is not None
        key = secret
        user = _run(args, lambda admin: admin.create_user(name, key, super_user=args.super))
        said = f"user {user.name} created" + (" (a super user)" if user.super else "")
    else:
        if secret is None and args.super is None:
            raise CommandError(
                "nothing to change: give --super, --no-super, --new-secret or --secret-stdin"
            )
        user = _run(
            args, lambda admin: admin.update_user(name, secret_key=secret, super_user=args.super)
        )
        changes = [] if secret is None else ["new secret key"]
        if args.super is not None:
            changes.append("a super user" if user.super else "not a super user")
        said = f"user {user.name} updated: {', '.join(changes)}"
    _done(args, user, said, secret if generated else None)
    return 0


def _run_rules(args: argparse.Namespace) -> int:
    from txmq.protocol.settings import SettingsError
    from txmq.protocol.wire import AclRule
    from txmq.security.acl.policy import Rule, parse_resource

    cmd, name = args.acl_cmd, args.user
    if cmd == "list":
        users = _run(args, lambda admin: admin.users(name))
        if args.json:
            rows = [{"user": u.name, **_rule_json(r)} for u in users for r in u.rules]
            print(json.dumps(rows, indent=2))
        else:
            print(table(_rule_rows(users), ["user", "rule"], wide=args.wide))
        return 0
    try:
        if cmd == "add":
            raw: dict[str, Any] = {
                "resource": args.resource,
                "actions": args.actions,
                "decision": "deny" if args.deny else "allow",
            }
            if args.source:
                raw["sources"] = args.source
            rule = Rule.parse(raw, "acl add")  # what is wrong, before asking any server
        else:
            resource = parse_resource(args.resource).text
    except SettingsError as exc:
        raise CommandError(str(exc)) from None
    if cmd == "add":
        text = rule.as_dict()
        user = _run(
            args,
            lambda admin: admin.add_rule(
                name,
                text["resource"],
                text["actions"],
                deny=not rule.allow,
                sources=text.get("sources", ()),
            ),
        )
        wire = AclRule(
            resource=text["resource"],
            actions=text["actions"],
            decision=text.get("decision", "allow"),
            sources=text.get("sources", []),
        )
        _done(args, user, f"user {user.name}: rule added: {rule_text(wire)}")
    else:
        user = _run(args, lambda admin: admin.delete_rule(name, resource))
        _done(args, user, f"user {user.name}: rules on {resource} deleted")
    return 0


# -- input and output ---------------------------------------------------------------------


def _secret_from_stdin() -> str:
    """The first line of stdin (asked for without echo on a terminal)."""
    if sys.stdin.isatty():
        line = getpass.getpass("secret key: ")
    else:
        line = sys.stdin.readline()
    secret = line.rstrip("\r\n")
    if not secret:
        raise CommandError("--secret-stdin: stdin gave no secret key (one line expected)")
    return secret


def _done(
    args: argparse.Namespace,
    user: AclUser,
    said: str,
    secret: str | None = None,
    *,
    show: bool = True,
) -> None:
    """What a change prints: what was done, a generated secret key, and the user now
    (``show``); JSON: the user, and a generated secret key."""
    if args.json:
        out = _user_json(user)
        if secret is not None:
            out["secret_key"] = secret
        print(json.dumps(out, indent=2))
        return
    print(said)
    if secret is not None:
        print(f"secret key: {secret}")
        print(
            "Keep it now: it is not shown again. Clients use it as "
            f"TXMQ_ACCESS_KEY={user.name} TXMQ_SECRET_KEY=<the secret key>."
        )
    if show:
        print(table(_user_rows([user]), ["name", "super", "rules"], wide=args.wide))


def rule_text(rule: AclRule) -> str:
    """A rule as one line: ``allow pub topic:orders (from 10.0.0.0/8)``."""
    text = f"{rule.decision} {','.join(rule.actions)} {rule.resource}"
    return f"{text} (from {', '.join(rule.sources)})" if rule.sources else text


def _rule_json(rule: AclRule) -> dict[str, Any]:
    return {
        "resource": rule.resource,
        "actions": list(rule.actions),
        "decision": rule.decision,
        "sources": list(rule.sources),
    }


def _user_json(user: AclUser) -> dict[str, Any]:
    return {"name": user.name, "super": user.super, "rules": [_rule_json(r) for r in user.rules]}


def _user_rows(users: list[AclUser]) -> list[dict[str, Any]]:
    """A table row per rule; a user's name and super flag on its first row only."""
    rows: list[dict[str, Any]] = []
    for u in users:
        texts = [rule_text(r) for r in u.rules] or ["-"]
        for i, text in enumerate(texts):
            first = i == 0
            rows.append(
                {
                    "name": u.name if first else "",
                    "super": ("yes" if u.super else "no") if first else "",
                    "rules": text,
                }
            )
    return rows


def _rule_rows(users: list[AclUser]) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for u in users:
        texts = [rule_text(r) for r in u.rules]
        if u.super:
            texts.insert(0, "(a super user: may do everything)")
        for i, text in enumerate(texts or ["(no rules)"]):
            rows.append({"user": u.name if i == 0 else "", "rule": text})
    return rows


def _print_users(users: list[AclUser], as_json: bool, wide: bool) -> None:
    if as_json:
        print(json.dumps([_user_json(u) for u in users], indent=2))
    else:
        print(table(_user_rows(users), ["name", "super", "rules"], wide=wide))
