"""RocketMQ 5's gRPC request signature (txmq.security.acl.grpc_auth): what it accepts, what it
refuses and why, and the status codes both sides map it to."""

from __future__ import annotations

import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from rocketmq.grpc_protocol import definition_pb2 as pb

from txmq.protocol.grpc_convert import code_of, error_of
from txmq.protocol.wire.errors import AuthenticationFailed, NoPermission
from txmq.security.acl.grpc_auth import authenticate, grpc_peer, verify
from txmq.security.acl.guard import Guard
from txmq.security.credentials import Credentials
from txmq.security.signing import authorization, signed_metadata

ALICE = Credentials("alice", "alice-secret")
WINDOW_MS = 60_000


def secret_of(access_key: str) -> bytes | None:
    return ALICE.secret if access_key == "alice" else None


def check(metadata: object, clock: float | None = None) -> str:
    return verify(
        metadata,  # type: ignore[arg-type]
        secret_of,
        window_ms=WINDOW_MS,
        what="SendMessage (gRPC)",
        clock=(lambda: clock) if clock is not None else time.time,
    )


@pytest.fixture
def india(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """This process's local time is UTC+05:30 (no daylight saving) for the test."""
    monkeypatch.setenv("TZ", "Asia/Kolkata")
    time.tzset()
    yield
    monkeypatch.undo()
    time.tzset()


def test_a_fresh_signature_is_accepted_in_utc_and_in_local_time(india: None) -> None:
    assert check(signed_metadata(ALICE)) == "alice"
    # the official Python client: local time with a literal Z
    local = datetime.now().strftime("%Y%m%dT%H%M%SZ")
    assert check([("x-mq-date-time", local), ("authorization", authorization(ALICE, local))])
    # bytes values and the official client's other headers are fine
    md = [(k, v.encode()) for k, v in signed_metadata(ALICE)] + [("x-mq-client-id", "c")]
    assert check(md) == "alice"


def test_a_time_outside_the_window_of_both_readings_is_refused(india: None) -> None:
    now = datetime.now(UTC)
    assert check(signed_metadata(ALICE, now - timedelta(seconds=59))) == "alice"
    with pytest.raises(AuthenticationFailed, match=r"s before this server's clock") as info:
        check(signed_metadata(ALICE, now - timedelta(seconds=90)))
    assert "(read as UTC or as local time; allowed: 60 s)" in str(info.value)
    with pytest.raises(AuthenticationFailed, match=r"s after this server's clock"):
        check(signed_metadata(ALICE, now + timedelta(seconds=90)))
    # an hour off both readings (a client in another time zone)
    with pytest.raises(AuthenticationFailed, match=r"signed at .*local time"):
        check(signed_metadata(ALICE, now + timedelta(hours=1)))
    # a fixed clock: the signed second itself and the window's edges
    at = datetime(2025, 1, 2, 3, 4, 5, tzinfo=UTC)
    md = signed_metadata(ALICE, at)
    assert check(md, clock=at.timestamp() + 60.9) == "alice"
    assert check(md, clock=at.timestamp() - 60) == "alice"
    with pytest.raises(AuthenticationFailed, match=r"62\.0 s before"):
        check(md, clock=at.timestamp() + 62)


@pytest.mark.parametrize(
    ("metadata", "cause"),
    [
        ([], "SendMessage (gRPC) is not signed: this server requires credentials"),
        (
            # the official client without credentials signs with an empty access key
            [
                ("authorization", "MQv2-HMAC-SHA1 Credential=, SignedHeaders=x, Signature=ab"),
                ("x-mq-date-time", "20250102T030405Z"),
            ],
            "is not signed",
        ),
        ([("authorization", "AWS4 Credential=alice")], "unknown signature algorithm 'AWS4'"),
        ([("authorization", "MQv2-HMAC-SHA1 Signature=ab")], "authorization header is malformed"),
        (
            [("authorization", authorization(ALICE, "20250102T030405Z"))],
            "the x-mq-date-time header is missing",
        ),
        (
            [
                ("authorization", authorization(Credentials("eve", "eve-secret"), "t")),
                ("x-mq-date-time", "t"),
            ],
            "unknown access key 'eve'",
        ),
        (
            [
                ("authorization", authorization(Credentials("alice", "not-alices"), "t")),
                ("x-mq-date-time", "t"),
            ],
            "the signature of 'alice' does not match",
        ),
        (
            [("authorization", authorization(ALICE, "t")), ("x-mq-date-time", "t")],
            "the x-mq-date-time header 't' is not a date-time",
        ),
        (
            [
                ("authorization", authorization(ALICE, "t") + "é"),
                ("x-mq-date-time", "t"),
            ],
            "does not match",
        ),
    ],
)
def test_refusals_say_why(metadata: list[tuple[str, str]], cause: str) -> None:
    with pytest.raises(AuthenticationFailed, match=cause.replace("(", r"\(").replace(")", r"\)")):
        check(metadata)


def test_peer_names_and_the_guard_counting_refusals(tmp_path: Path) -> None:
    assert grpc_peer("ipv4:127.0.0.1:5555").name == "127.0.0.1:5555"
    assert grpc_peer("ipv6:%5B::1%5D:5555").name == "[::1]:5555"
    assert grpc_peer("ipv6:[::1]:5555").name == "[::1]:5555"
    acl = tmp_path / "acl.toml"
    acl.write_text('[users.alice]\nsecret_key = "alice-secret"\n')
    guard = Guard(acl)
    peer = grpc_peer("ipv4:10.0.0.7:4000")
    assert authenticate(guard, signed_metadata(ALICE), peer, "QueryRoute (gRPC)").name == "alice"
    with pytest.raises(AuthenticationFailed, match="QueryRoute \\(gRPC\\) is not signed"):
        authenticate(guard, [], peer, "QueryRoute (gRPC)")
    assert guard.refused == {"authentication": 1, "permission": 0}


def test_status_codes_both_ways() -> None:
    assert code_of(AuthenticationFailed("x")) == pb.UNAUTHORIZED
    assert code_of(NoPermission("x")) == pb.FORBIDDEN
    assert isinstance(error_of(pb.Status(code=pb.UNAUTHORIZED, message="m")), AuthenticationFailed)
    assert isinstance(error_of(pb.Status(code=pb.FORBIDDEN, message="m")), NoPermission)
