"""Text that leaves xmem for a place with rules of its own: one function per rule, no other module cleans text.

Two sinks, two rules, because they break on different characters:
- a line for people (`one_line`): the filter's message and refusal that `slurm/cli_filter.lua` prints on sbatch's
  terminal, the CLI's last `xmem-slurm VERB: ...` line and its `--json` "message", the deferred steps' stderr,
  the not-modelled line quoting the program's output, a plot's title. It must stay one line: a user's exception
  text may hold newlines or terminal escapes, so every run of whitespace and control characters is one space.
  Where the text can be a user's 1 MB message, a limit cuts it, with a mark so nobody takes it for the whole.
- a value inside the job comment's `xmem:key=value;key=value` token and the `XMEM_*` variables (`comment_value`):
  the token ends at whitespace, its pairs split at `;`, sbatch's `--export` splits at commas and reads quotes, so
  exactly those characters (and control characters, backslashes, and `%` itself) are percent-encoded (RFC 3986's
  `%XX` of each UTF-8 byte); `comment_text` decodes it, so every reader gets the text exactly as it was written.
And one rule for numbers read back from text a user can write (a job comment, a variable): `ascii_whole_number`.
Pure text: no I/O.
"""

from __future__ import annotations

import re
from urllib.parse import unquote

CUT_MARK = " [... cut]"
# The longest line the filter prints (`slurm.contract.MESSAGE_MAX_CHARS`), so that its reason travels whole; Slurm
# shows the comment whole, so a longer value is cut.
COMMENT_VALUE_MAX_CHARS = 600

_LINE_BREAKERS = re.compile(r"[\s\x00-\x1f\x7f]+")
# What the token and --export cannot hold (unicode whitespace and C1 controls included); all else passes as it is.
_COMMENT_UNSAFE = re.compile(r"[\s\x00-\x1f\x7f-\x9f,;\"'\\%]")
_ASCII_DIGITS = re.compile(r"[0-9]+")
WHOLE_NUMBER_MAX_DIGITS = 20  # any count of bytes, seconds or ids xmem reads fits in 20 digits (2**64 has 20)


def one_line(text: object, limit: int | None = None) -> str:
    """`text` as one line for people: each run of whitespace or control characters one space, no spaces at the
    ends; longer than `limit` characters, cut to `limit` with `CUT_MARK` at the end."""
    line = _LINE_BREAKERS.sub(" ", str(text)).strip()
    if limit is None or len(line) <= limit:
        return line
    return line[:limit - len(CUT_MARK)].rstrip() + CUT_MARK


def comment_value(value: object, limit: int = COMMENT_VALUE_MAX_CHARS) -> str:
    """`value` as one value of the comment's `xmem:` token or of an `XMEM_*` variable: at most `limit` characters
    of it (cut with `CUT_MARK`), each character the token or --export cannot hold percent-encoded."""
    text = str(value)
    if len(text) > limit:
        text = text[:limit - len(CUT_MARK)].rstrip() + CUT_MARK
    return _COMMENT_UNSAFE.sub(_percent_encoded, text)


def _percent_encoded(match: re.Match) -> str:
    return "".join(f"%{byte:02X}" for byte in match.group().encode("utf-8", "surrogatepass"))


def comment_text(value: str) -> str:
    """A value `comment_value` wrote, decoded: the text as it was (the one reader of the comment and XMEM_*)."""
    return unquote(value, errors="replace")


def ascii_whole_number(text: str | None, max_digits: int = WHOLE_NUMBER_MAX_DIGITS) -> int | None:
    """`text` as a whole number when it is ASCII digits only, at most `max_digits` of them; else None.

    The one test for numbers in text a user wrote: `str.isdigit()` also takes `²` (which `int()` then refuses) and
    other scripts' digits (`int("٣")` is 3), and `int()` refuses more than 4300 digits. No sign, no spaces."""
    if text is None or len(text) > max_digits or not _ASCII_DIGITS.fullmatch(text):
        return None
    return int(text)


__all__ = ["COMMENT_VALUE_MAX_CHARS", "CUT_MARK", "WHOLE_NUMBER_MAX_DIGITS", "ascii_whole_number", "comment_text",
           "comment_value", "one_line"]
