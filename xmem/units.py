"""Byte units, written once, and how sizes are written for people.

Owns the GiB and MiB constants and the three size formats the reports use: a table's (`gib_text`, `size_text`) and
a sentence's (`gib_words`, `size_words`: the policy's reasons). Pure text; no other module defines its own.
"""

MIB = 1 << 20
GIB = 1 << 30


def gib_text(nbytes: int) -> str:
    """`8.27 GiB`: sizes to compare side by side, always in GiB with two decimals."""
    return f"{nbytes / GIB:.2f} GiB"


def size_text(nbytes: int, mib_digits: int = 1) -> str:
    """`8.27 GiB` from one GiB up (either sign), else MiB with `mib_digits` decimals (`512.0 MiB`)."""
    return gib_text(nbytes) if abs(nbytes) >= GIB else f"{nbytes / MIB:.{mib_digits}f} MiB"


def gib_words(nbytes: int) -> str:
    """`8 GiB`, `8.27 GiB`, `0.5 GiB`: a size inside a sentence, no trailing zeros."""
    return f"{nbytes / GIB:.2f}".rstrip("0").rstrip(".") + " GiB"


def size_words(nbytes: int) -> str:
    """`gib_words` from one GiB up, else `512 MiB`."""
    return gib_words(nbytes) if nbytes >= GIB else f"{nbytes / MIB:g} MiB"
