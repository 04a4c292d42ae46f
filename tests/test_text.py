"""The two text rules: a line for people (`one_line`) and a value in the job comment's token (`comment_value`)."""

import pytest

from xmem.slurm.stamp import JobStamp, add_to_comment, comment_fields
from xmem.text import CUT_MARK, comment_text, comment_value, one_line


@pytest.mark.parametrize("text, line", [
    ("RuntimeError: CUDA out of memory.\nTried to allocate 2 GiB", "RuntimeError: CUDA out of memory. Tried to "
                                                                     "allocate 2 GiB"),
    ("  two  spaces\t\tand tabs \r\n", "two spaces and tabs"),
    ("a terminal escape \x1b[31mred\x1b[0m and a \x00 NUL", "a terminal escape [31mred [0m and a NUL"),
    ("a line separator\u2028and a \x85 next line", "a line separator and a next line"),
    (ValueError("an exception's text"), "an exception's text"),
    ("", ""),
])
def test_a_line_for_people_is_one_line_without_control_characters(text, line):
    assert one_line(text) == line


def test_a_long_line_is_cut_to_its_limit_with_a_mark_and_a_short_one_kept_whole():
    long = one_line("RuntimeError: " + "x" * 1_000_000, 600)
    assert len(long) == 600 and long.startswith("RuntimeError: xxx") and long.endswith(CUT_MARK)
    assert one_line("x" * 600, 600) == "x" * 600
    assert one_line("word " * 10, 20) == "word word" + CUT_MARK  # cut at a space: no space before the mark
    assert len(one_line("y" * 10_000)) == 10_000  # no limit: the CLI's line and --json message stay whole


@pytest.mark.parametrize("value, written", [
    ("no command of the job used CUDA", "no+command+of+the+job+used+CUDA"),
    ("gpu:a100:1,mps:10", "gpu:a100:1+mps:10"),
    ("a;b=c", "a+b=c"),  # `=` stays: a pair splits at its first one
    ('say "hi", \'x\'\\\n\ty', "say+hi+x+y"),
    ("nul\x00bell\x07", "nul+bell+"),
    (7 * 2**30, str(7 * 2**30)),
])
def test_a_comment_value_holds_no_separator_of_the_token_or_of_export(value, written):
    assert comment_value(value) == written


def test_a_comment_value_is_short_and_reads_back_as_words():
    assert len(comment_value("why " * 1000)) == 200 and len(comment_value("x" * 50, limit=10)) == 10
    assert comment_text(comment_value("kept the user's  request: no CUDA")) == "kept the user s request: no CUDA"


def test_a_hostile_value_keeps_the_comment_token_whole_and_readable():
    stamp = JobStamp(peak_bytes=1, gpu_type="a100 ;x=1", request="gpu:1,mps:10", action="keep")
    why = comment_value('a;b c,"d')
    comment = add_to_comment("my run", stamp, f"why={why}")
    assert comment.startswith("my run xmem:") and len(comment.split()) == 3
    assert comment_fields(comment) == {"peak": "1", "type": "a100+x=1", "req": "gpu:1+mps:10", "act": "keep",
                                       "why": "a+b+c+d"}
    assert all("," not in v and ";" not in v for v in stamp.env().values())
