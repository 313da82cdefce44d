"""How a ``txmq`` command ends when cut short (:mod:`txmq.cli.endings`): quietly when stdout's
reader has gone or on Ctrl-C; a broken pipe of anything else (a connection) stays an error."""

from __future__ import annotations

import os

import pytest

from txmq.cli.endings import INTERRUPTED, PIPE_CLOSED, reader_gone, to_the_end


def fails(exc: BaseException) -> int:
    raise exc


def test_a_broken_pipe_is_quiet_only_when_stdout_has_lost_its_reader(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    read, write = os.pipe()
    with os.fdopen(write, "w") as out:
        monkeypatch.setattr("sys.stdout", out)  # (in the test: pytest sets it per phase)
        assert not reader_gone(BrokenPipeError())  # a connection's: said as an error
        with pytest.raises(BrokenPipeError):
            to_the_end(lambda: fails(BrokenPipeError()))
        os.close(read)  # `| head` has read its lines
        assert reader_gone(BrokenPipeError())
        assert reader_gone(BaseExceptionGroup("relay", [BrokenPipeError(), BrokenPipeError()]))
        assert not reader_gone(BaseExceptionGroup("relay", [BrokenPipeError(), ValueError()]))
        assert not reader_gone(ConnectionResetError())
        out.write("a line nobody reads\n")
        assert to_the_end(lambda: 0) == PIPE_CLOSED  # its final flush fails, quietly
        out.write("more\n")
        out.flush()  # stdout now goes nowhere, as the interpreter's last flush will


def test_ctrl_c_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert to_the_end(lambda: fails(KeyboardInterrupt())) == INTERRUPTED == 130
    assert capsys.readouterr().err == "txmq: interrupted\n"
