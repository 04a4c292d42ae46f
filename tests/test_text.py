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
    ("no command of the job used CUDA", "no%20command%20of%20the%20job%20used%20CUDA"),
    ("gpu:a100:1,mps:10", "gpu:a100:1%2Cmps:10"),
    ("a;b=c", "a%3Bb=c"),  # `=` stays: a pair splits at its first one
    ('say "hi", \'x\'\\\n\ty', "say%20%22hi%22%2C%20%27x%27%5C%0A%09y"),
    ("nul\x00bell\x07", "nul%00bell%07"),
    ("100% + 256 MiB", "100%25%20+%20256%20MiB"),  # `+` passes: it is no space here
    ("ünïcode 中文\u2028", "ünïcode%20中文%E2%80%A8"),  # letters pass; unicode whitespace is encoded
    (7 * 2**30, str(7 * 2**30)),
])
def test_a_comment_value_percent_encodes_exactly_what_the_token_or_export_cannot_hold(value, written):
    assert comment_value(value) == written


@pytest.mark.parametrize("line", [
    "needs 7.9 GiB + 256 MiB -> --gres=mps:40",
    "kept the user's request, as asked; 100% of a=b",
    'a "quoted" word, a \\ backslash, %41 and %zz and a lone %',
    "ünïcode: 中文, emoji 🚀, NBSP\u00a0and\u2028separator",
    "+;=,'\"%",
])
def test_a_comment_value_reads_back_exactly_as_written(line):
    assert comment_text(comment_value(line)) == line


def test_a_comment_value_is_cut_to_its_limit_with_a_mark():
    assert comment_text(comment_value("why " * 1000)).endswith(CUT_MARK)
    assert len(comment_text(comment_value("why " * 1000))) <= 600
    assert comment_text(comment_value("x" * 50, limit=10)) == "x" * (10 - len(CUT_MARK)) + CUT_MARK


def test_a_hostile_value_keeps_the_comment_token_whole_and_readable():
    stamp = JobStamp(peak_bytes=1, gpu_type="a100 ;x=1", request="gpu:1,mps:10", action="keep")
    why = comment_value('a;b c,"d')
    comment = add_to_comment("my run", stamp, f"why={why}")
    assert comment.startswith("my run xmem:") and len(comment.split()) == 3
    assert comment_fields(comment) == {"peak": "1", "type": "a100%20%3Bx=1", "req": "gpu:1%2Cmps:10",
                                       "act": "keep", "why": "a%3Bb%20c%2C%22d"}
    assert JobStamp.from_comment(comment) == stamp  # read back decoded
    assert all("," not in v and ";" not in v for v in stamp.env().values())
