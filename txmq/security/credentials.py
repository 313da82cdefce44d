"""A user's credentials: an access key (its name) and a secret key (what signs its
requests; RocketMQ's ACL)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from functools import cached_property

from txmq.protocol.settings import SettingsError

__all__ = ["ACCESS_KEY_RULE", "Credentials"]

#: what an access key (a user name) may be made of
ACCESS_KEY_RULE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.@-]{0,63}")


@dataclass(frozen=True)
class Credentials:
    """A user's access key (its name) and secret key (what signs its requests)."""

    access_key: str
    secret_key: str = field(repr=False)

    def __post_init__(self) -> None:
        if not ACCESS_KEY_RULE.fullmatch(self.access_key):
            raise SettingsError(
                f"access key {self.access_key!r} must be 1-64 characters: letters, digits "
                "and _ . @ - (starting with a letter or digit)"
            )
        if len(self.secret_key) < 8:
            raise SettingsError(
                f"the secret key of {self.access_key!r} must be at least 8 characters"
            )

    @cached_property
    def secret(self) -> bytes:
        return self.secret_key.encode()
