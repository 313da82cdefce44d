"""The configuration reference and the sample ``docs/txmq.toml`` are made from the settings
classes (``docs/hooks/config_reference.py``): every key has a description, every settings
class and every server flag is in them, the sample is current, parses, and holds every key
at its default (issue 31, items 1 and 2); an unknown key names the keys close to it."""

from __future__ import annotations

import ast
import dataclasses
import importlib.util
import re
import sys
import tomllib
from pathlib import Path
from types import ModuleType

import pytest

from tests.conftest import ROOT
from txmq.broker.state.config import BrokerConfig
from txmq.protocol.settings import SettingsError, load_settings


def _generator() -> ModuleType:
    path = ROOT / "docs" / "hooks" / "config_reference.py"
    spec = importlib.util.spec_from_file_location("txmq_docs_config_reference", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


gen = _generator()


def test_every_settings_key_has_a_description() -> None:
    """A key without a ``#:`` comment above its declaration fails here, naming it."""
    missing = [
        f"[{table.section}] {key.name} ({table.cls.__module__}.{table.cls.__qualname__})"
        for table in gen.TABLES
        for key in gen.keys(table)
        if len(key.description) < 10
    ]
    assert missing == [], "give these settings a '#:' comment where they are declared"
    assert len(gen.keys(gen.TABLES[0])) >= 56  # the broker's


def test_every_settings_class_is_in_the_reference() -> None:
    """Every ``load_settings(..., section=..., env_prefix=...)`` of the package is a table
    of the reference, with the same environment prefix."""
    used: set[tuple[str, str]] = set()
    for path in (ROOT / "txmq").rglob("*.py"):
        text = path.read_text()
        if "load_settings(" not in text or path.name == "settings.py":
            continue
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "load_settings":
                kw = {k.arg: k.value for k in node.keywords}
                section, prefix = kw["section"], kw["env_prefix"]
                assert isinstance(section, ast.Constant) and isinstance(prefix, ast.Constant)
                used.add((str(section.value), str(prefix.value)))
    assert used == {(t.section, t.env_prefix) for t in gen.TABLES}


def test_every_flag_of_a_server_command_sets_a_key() -> None:
    """The flags the reference names are the commands' own, and every option of
    ``txmq broker|namesrv|controller|proxy start`` (but --config, --ready-file, --log-level)
    is a key's."""
    for table in gen.TABLES:
        if not table.command:
            continue
        fields = {f.name for f in dataclasses.fields(table.cls)}
        flags = gen.flags(table.command)
        assert set(flags) <= fields, (table.section, set(flags) - fields)
        # the proxy listens on its gRPC port only, and checks no ACL of its own
        own = {"grpc_port", "namesrv"} if table.section == "proxy" else {"port", "acl_file"}
        assert {"host", "tls_cert"} | own <= set(flags)
    assert gen.flags(("broker", "start"))["ha_master_address"] == "--ha-master"
    assert gen.flags(("broker", "start"))["auto_create_topic"] == "--no-auto-create-topic"


def test_rocketmq_names_are_read_from_the_descriptions() -> None:
    broker = {k.name: k for k in gen.keys(gen.TABLES[0])}
    assert broker["cluster"].rocketmq == "brokerClusterName"
    assert broker["timer_max_delay_s"].rocketmq == "timerMaxDelaySec"  # RocketMQ 5's
    assert broker["idle_timeout_s"].rocketmq == "serverChannelMaxIdleTimeSeconds"  # a base's
    assert broker["dedupe_window_s"].rocketmq is None
    assert broker["port"].env == "TXMQ_BROKER_PORT" and broker["port"].flag == "--port"


def test_the_reference_has_a_row_per_key() -> None:
    text = gen.markdown()
    for table in gen.TABLES:
        assert f"`[{table.section}]`" in text
        for key in gen.keys(table):
            row = f"| {gen._code(key.name)}<br>{gen._code(key.env)}"
            assert row in text, key.name


def _uncommented(sample: str) -> str:
    """The sample with every ``# key = value`` line made a setting."""
    return re.sub(r"^# (\w+ = .*)$", r"\1", sample, flags=re.MULTILINE)


def test_the_sample_toml_is_current_parses_and_holds_every_key(tmp_path: Path) -> None:
    sample = (ROOT / "docs" / "txmq.toml").read_text()
    assert sample == gen.sample_toml(), "run: python docs/hooks/config_reference.py"
    assert tomllib.loads(sample) == {t.section: {} for t in gen.TABLES}  # all commented out
    every = tomllib.loads(_uncommented(sample))
    file = tmp_path / "txmq.toml"
    file.write_text(_uncommented(sample))
    for table in gen.TABLES:
        fields = [f.name for f in dataclasses.fields(table.cls)]
        assert sorted(every[table.section]) == sorted(fields), table.section
        # each value is the default, as a user who uncomments a line reads it
        loaded = load_settings(
            table.cls, file=file, section=table.section, env_prefix=table.env_prefix, env={}
        )
        assert loaded == table.cls(), table.section


def test_an_unknown_key_names_the_keys_close_to_it(tmp_path: Path) -> None:
    file = tmp_path / "broker.toml"
    file.write_text("[broker]\nprot = 1\n")
    with pytest.raises(SettingsError) as caught:
        BrokerConfig.load(file, env={})
    said = str(caught.value)
    assert said.endswith("unknown key 'prot' in [broker]: did you mean 'port'?"), said
    file.write_text("[broker]\ntransaction_check = 1\n")
    with pytest.raises(SettingsError, match="did you mean 'transaction_check_max' or") as caught:
        BrokerConfig.load(file, env={})
    assert str(caught.value).count("'") <= 8  # the close ones only, three at most
    file.write_text("[broker]\nzzzz = 1\n")
    with pytest.raises(SettingsError) as caught:
        BrokerConfig.load(file, env={})
    assert "no known key is close; docs/configuration.md lists every key" in str(caught.value)
    assert "dedupe_window_s" not in str(caught.value)  # no list of all 57 keys
    with pytest.raises(SettingsError, match=r"unknown setting 'flsh': did you mean 'flush'\?"):
        BrokerConfig.load(env={}, flsh="sync")
