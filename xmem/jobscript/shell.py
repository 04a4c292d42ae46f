"""A small static reader of POSIX/bash shell text: tokens with line numbers, and parameter expansion.

Owns: splitting script text into words and operators (quotes, escapes, comments, line continuations, redirections,
here-documents skipped), and expanding `$VAR`, `${VAR}`, `${VAR:-default}`, `$1`, `"$@"`, `$*`, `$#` and `~` against
a known variable table. It never runs anything: a command substitution, arithmetic or a variable whose value is only
known at run time makes the word *unknown*, and callers report it instead of guessing.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

# Operators, longest first so that `&&` wins over `&`.
_OPERATORS = ("<<-", "<<<", "&>>", "&&", "||", ";;", "|&", "<<", ">>", ">&", "<&", "&>", ">|", "<>",
              ";", "&", "|", "(", ")", "<", ">", "\n")
_OPERATOR_STARTS = frozenset(op[0] for op in _OPERATORS)
_PLAIN_RUN = re.compile(r"[^\s'\"\\$`<>&|;()]+")  # characters with no special meaning outside quotes
REDIRECTIONS = frozenset({"<<<", "&>>", ">>", ">&", "<&", "&>", ">|", "<>", "<", ">"})
HEREDOCS = frozenset({"<<", "<<-"})
SEPARATORS = frozenset({"\n", ";", "&", "&&", "||", "|", "|&", ";;", "(", ")"})


class ShellSyntaxError(ValueError):
    def __init__(self, line_no: int, reason: str):
        super().__init__(reason)
        self.line_no = line_no
        self.reason = reason


@dataclass(frozen=True)
class Part:
    """A piece of a word. kind: "lit" (literal text), "var" (parameter expansion; text is the inside of `${...}`
    or the name), "dyn" (command substitution / arithmetic: unknowable statically). quoted: inside "..." or '...'."""

    kind: str
    text: str
    quoted: bool


@dataclass(frozen=True)
class Word:
    parts: tuple[Part, ...]
    line_no: int

    @property
    def literal(self) -> str | None:
        """The word's text when it has no expansion at all (keywords, assignments' names)."""
        if all(p.kind == "lit" for p in self.parts):
            return "".join(p.text for p in self.parts)
        return None

    @property
    def source(self) -> str:
        return "".join(p.text if p.kind == "lit" else f"${{{p.text}}}" if p.kind == "var" else "$(...)"
                       for p in self.parts)


@dataclass(frozen=True)
class Op:
    text: str
    line_no: int


Token = Word | Op


def tokenize(text: str, first_line: int = 1) -> list[Token]:
    """Split shell text into words and operators. Here-document bodies are skipped; `\\`-newline joins lines."""
    return _Lexer(text, first_line).run()


class _Lexer:
    def __init__(self, text: str, first_line: int):
        self.text = text
        self.pos = 0
        self.line_no = first_line
        self.tokens: list[Token] = []
        self.parts: list[Part] = []
        self.word_line = first_line
        self.in_word = False
        self.pending_heredocs: list[tuple[str, bool]] = []

    def run(self) -> list[Token]:
        while self.pos < len(self.text):
            ch = self.text[self.pos]
            if ch == "\\" and self._peek(1) == "\n":
                self.pos += 2
                self.line_no += 1
            elif ch in " \t\r":
                self._end_word()
                self.pos += 1
            elif ch == "#" and not self.in_word:
                end = self.text.find("\n", self.pos)
                self.pos = len(self.text) if end < 0 else end
            elif ch == "'":
                self._single_quoted()
            elif ch == '"':
                self._double_quoted()
            elif ch == "\\":
                self._literal(self._peek(1), quoted=True)
                self.pos += 2
            elif ch in "$`":
                self._expansion(quoted=False)
            elif ch in _OPERATOR_STARTS and self._operator_here():
                continue
            else:
                run = _PLAIN_RUN.match(self.text, self.pos)
                end = run.end() if run else self.pos + 1
                self._literal(self.text[self.pos:end], quoted=False)
                self.pos = end
        self._end_word()
        if self.pending_heredocs:
            raise ShellSyntaxError(self.line_no, "here-document without its end marker")
        return self.tokens

    def _peek(self, offset: int) -> str:
        index = self.pos + offset
        return self.text[index] if index < len(self.text) else ""

    def _literal(self, text: str, quoted: bool) -> None:
        self._start_word()
        if self.parts and self.parts[-1].kind == "lit" and self.parts[-1].quoted == quoted:
            self.parts[-1] = Part("lit", self.parts[-1].text + text, quoted)
        else:
            self.parts.append(Part("lit", text, quoted))

    def _start_word(self) -> None:
        if not self.in_word:
            self.in_word = True
            self.word_line = self.line_no

    def _end_word(self) -> None:
        if self.in_word:
            self.tokens.append(Word(tuple(self.parts), self.word_line))
        self.parts = []
        self.in_word = False

    def _operator_here(self) -> bool:
        for op in _OPERATORS:
            if self.text.startswith(op, self.pos):
                break
        else:
            return False
        # `2>&1`: a word of digits right before a redirection is its file descriptor, not an argument.
        if op in REDIRECTIONS | HEREDOCS and self.in_word and all(
                p.kind == "lit" and not p.quoted and p.text.isdigit() for p in self.parts):
            self.parts = []
            self.in_word = False
        self._end_word()
        self.tokens.append(Op(op, self.line_no))
        self.pos += len(op)
        if op in HEREDOCS:
            self._heredoc_marker(strip_tabs=op == "<<-")
        if op == "\n":
            self.line_no += 1
            self._skip_heredoc_bodies()
        return True

    def _heredoc_marker(self, strip_tabs: bool) -> None:
        while self._peek(0) in " \t":
            self.pos += 1
        start = self.pos
        while self.pos < len(self.text) and self.text[self.pos] not in " \t\n;&|<>()":
            self.pos += 1
        marker = self.text[start:self.pos].replace("'", "").replace('"', "").replace("\\", "")
        if not marker:
            raise ShellSyntaxError(self.line_no, "here-document without a marker word")
        self.pending_heredocs.append((marker, strip_tabs))

    def _skip_heredoc_bodies(self) -> None:
        """Called at the start of the line after `<<MARKER`: the body runs up to the line equal to MARKER."""
        while self.pending_heredocs:
            marker, strip_tabs = self.pending_heredocs.pop(0)
            while True:
                if self.pos >= len(self.text):
                    raise ShellSyntaxError(self.line_no, f"here-document not closed by {marker!r}")
                end = self.text.find("\n", self.pos)
                end = len(self.text) if end < 0 else end
                line = self.text[self.pos:end]
                self.pos = end + 1
                self.line_no += 1
                if (line.lstrip("\t") if strip_tabs else line) == marker:
                    break

    def _single_quoted(self) -> None:
        end = self.text.find("'", self.pos + 1)
        if end < 0:
            raise ShellSyntaxError(self.line_no, "unterminated single quote")
        body = self.text[self.pos + 1:end]
        self._start_word()
        self.parts.append(Part("lit", body, True))
        self.line_no += body.count("\n")
        self.pos = end + 1

    def _double_quoted(self) -> None:
        self._start_word()
        self.parts.append(Part("lit", "", True))  # keeps "" a (empty) word
        self.pos += 1
        while True:
            if self.pos >= len(self.text):
                raise ShellSyntaxError(self.line_no, "unterminated double quote")
            ch = self.text[self.pos]
            if ch == '"':
                self.pos += 1
                return
            if ch == "\\" and self._peek(1) in '$`"\\\n':
                if self._peek(1) == "\n":
                    self.line_no += 1
                else:
                    self._literal(self._peek(1), quoted=True)
                self.pos += 2
            elif ch in "$`":
                self._expansion(quoted=True)
            else:
                if ch == "\n":
                    self.line_no += 1
                self._literal(ch, quoted=True)
                self.pos += 1

    def _expansion(self, quoted: bool) -> None:
        self._start_word()
        text, nxt = self.text, self._peek(1)
        if text[self.pos] == "`":
            end = text.find("`", self.pos + 1)
            if end < 0:
                raise ShellSyntaxError(self.line_no, "unterminated backquote")
            self._add(Part("dyn", text[self.pos:end + 1], quoted), end + 1)
        elif nxt == "(":
            end = self._matching(self.pos + 1, "(", ")")
            self._add(Part("dyn", text[self.pos:end + 1], quoted), end + 1)
        elif nxt == "{":
            end = self._matching(self.pos + 1, "{", "}")
            self._add(Part("var", text[self.pos + 2:end], quoted), end + 1)
        elif nxt and (nxt.isalpha() or nxt == "_"):
            end = self.pos + 1
            while end < len(text) and (text[end].isalnum() or text[end] == "_"):
                end += 1
            self._add(Part("var", text[self.pos + 1:end], quoted), end)
        elif nxt and (nxt.isdigit() or nxt in "@*#?$!-"):
            self._add(Part("var", nxt, quoted), self.pos + 2)
        else:
            self._literal("$", quoted)
            self.pos += 1

    def _add(self, part: Part, new_pos: int) -> None:
        self.parts.append(part)
        self.line_no += part.text.count("\n")
        self.pos = new_pos

    def _matching(self, start: int, opening: str, closing: str) -> int:
        depth = 0
        quote = ""
        for index in range(start, len(self.text)):
            ch = self.text[index]
            if quote:
                if ch == quote:
                    quote = ""
            elif ch in "'\"":
                quote = ch
            elif ch == opening:
                depth += 1
            elif ch == closing:
                depth -= 1
                if depth == 0:
                    return index
        raise ShellSyntaxError(self.line_no, f"unterminated ${opening}")


class Unknown(Exception):
    """A word's value depends on something only known when the job runs."""

    def __init__(self, what: str):
        super().__init__(what)
        self.what = what


Lookup = Callable[[str], "str | None"]


def expand(word: Word, lookup: Lookup, positional: list[str], script_name: str = "") -> list[str]:
    """Expand one word into zero or more fields, as bash would with the given variables.

    `lookup(name)` returns the value, None for unset, or raises `Unknown`. Unquoted expansions are split on
    whitespace; `"$@"` gives one field per argument. Globs are left as written."""
    fields: list[str] = []
    current: list[str] = []
    have_field = False  # a quoted part makes a field even when empty ("")
    for index, part in enumerate(word.parts):
        if part.kind == "lit":
            text = part.text
            if index == 0 and not part.quoted and (text == "~" or text.startswith("~/")):
                home = lookup("HOME")
                text = (home or "~") + text[1:]
            current.append(text)
            have_field = have_field or part.quoted or bool(text)
            continue
        if part.kind == "dyn":
            raise Unknown(f"{part.text} (command output)")
        if part.text == "@" and part.quoted:
            current = _spread(positional, fields, current)
            have_field = have_field or bool(positional)
            continue
        value = _parameter(part.text, lookup, positional, script_name)
        if part.quoted or isinstance(value, _Quoted):
            current.append(value)
            have_field = True
            continue
        pieces = value.split()
        if value[:1].isspace() and (current or have_field):
            fields.append("".join(current))
            current, have_field = [], False
        current = _spread(pieces, fields, current)
        have_field = have_field or bool(pieces)
        if value[-1:].isspace() and pieces:
            fields.append("".join(current))
            current, have_field = [], False
    if current or have_field:
        fields.append("".join(current))
    return fields


def _spread(words: list[str], fields: list[str], current: list[str]) -> list[str]:
    """Add `words` to the field being built: the first joins it, each next one closes it and starts a new one.
    Returns the field being built now."""
    for n, word in enumerate(words):
        if n:
            fields.append("".join(current))
            current = []
        current.append(word)
    return current


def _parameter(expr: str, lookup: Lookup, positional: list[str], script_name: str) -> str:
    if expr.isdigit():
        n = int(expr)
        if n == 0:
            return script_name
        return positional[n - 1] if n <= len(positional) else ""
    if expr in ("@", "*"):
        return " ".join(positional)
    if expr == "#":
        return str(len(positional))
    if expr in ("?", "$", "!", "-") or expr.startswith("#") or expr.startswith("!"):
        raise Unknown(f"${{{expr}}}")
    name, op, default = _split_default(expr)
    if not (name.replace("_", "a").isalnum()):
        raise Unknown(f"${{{expr}}}")
    value = _parameter(name, lookup, positional, script_name) if name.isdigit() else lookup(name)
    if op in (":-", ":=") and not value or op in ("-", "=") and value is None:
        words = [t for t in tokenize(default) if isinstance(t, Word)]
        text = " ".join(field for w in words for field in expand(w, lookup, positional, script_name))
        # `${X-"a b"}`: quotes inside the default keep it one field even where the expansion is unquoted
        return _Quoted(text) if any(p.quoted for w in words for p in w.parts) else text
    if op in (":-", ":=", "-", "="):
        return value or ""
    if op:
        raise Unknown(f"${{{expr}}}")
    return value or ""


class _Quoted(str):
    """A parameter's value that is not split into fields."""


def _split_default(expr: str) -> tuple[str, str, str]:
    for index, ch in enumerate(expr):
        if not (ch.isalnum() or ch == "_"):
            rest = expr[index:]
            for op in (":-", ":=", "-", "="):
                if rest.startswith(op):
                    return expr[:index], op, rest[len(op):]
            return expr[:index], rest, ""
    return expr, "", ""
