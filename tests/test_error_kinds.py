"""`xmem.error_kinds`: every kind of failure is one enum member with its exit code; the exit-code table, README's
copy of it and the tracer's errors all take their kinds and codes from it."""

import json
import re
from pathlib import Path

import pytest

from xmem.cli.exit_codes import EXIT_CODES, EXIT_OK
from xmem.error_kinds import TRACER_KINDS, ErrorKind
from xmem.trace.errors import TraceError

README = Path(__file__).resolve().parents[1] / "README.md"


def readme_kind_codes() -> dict[str, int]:
    """{kind: exit code} as README's exit-code table lists them (`| 5 | `user_error` | ... |`)."""
    codes = {}
    for code, kinds in re.findall(r"^\| (\d+) \| ([^|]*) \|", README.read_text(), re.MULTILINE):
        codes.update({kind: int(code) for kind in re.findall(r"`(\w+)`", kinds)})
    return codes


def test_every_kind_has_an_exit_code_the_table_explains():
    explained = {row.code for row in EXIT_CODES if row.meaning}
    for kind in ErrorKind:
        assert kind.exit_code != EXIT_OK and kind.exit_code in explained, kind
    assert all(row.kinds for row in EXIT_CODES if row.code != EXIT_OK), "a code no kind exits with"


def test_readmes_table_and_the_enum_agree():
    assert readme_kind_codes() == {kind.value: kind.exit_code for kind in ErrorKind}


def test_crashed_has_its_own_code():
    assert ErrorKind.CRASHED.exit_code == 13
    assert [k for k in ErrorKind if k.exit_code == 13] == [ErrorKind.CRASHED]


def test_the_tracers_kinds_are_members_and_only_internal_exits_1():
    assert set(TRACER_KINDS) <= set(ErrorKind)
    assert [k for k in TRACER_KINDS if k.exit_code == 1] == [ErrorKind.INTERNAL]


def test_a_trace_error_holds_its_kind_as_the_enum_and_writes_its_name():
    error = TraceError("crashed", "killed by SIGSEGV")
    assert error.kind is ErrorKind.CRASHED and error.kind == "crashed"
    assert json.dumps({"error": error.kind}) == '{"error": "crashed"}'
    assert str(error) == "crashed: killed by SIGSEGV"


def test_a_trace_error_refuses_a_kind_the_tracer_does_not_have():
    with pytest.raises(AssertionError):
        TraceError("no_fit", "the command line's kind, not the tracer's")
