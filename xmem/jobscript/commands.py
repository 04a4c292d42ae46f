"""Find the training command(s) of a batch script by a static read of its shell text.

Owns: following `cd`/`pushd`, `export`/assignments/`unset`, `source X/bin/activate` and `conda activate`, command
wrappers (`exec`, `time`, `nohup`, `env`, `stdbuf`), `srun`, and the commands that start Python, read through
the one launcher grammar (`xmem.launchers`: `python`, `torchrun`, `accelerate launch`, `deepspeed`; one rank is
estimated, in its launcher's world), and Python programs run directly (`trl sft`, `tune run`: a file with a python
shebang, looked up on the script's PATH). Whatever a static read cannot settle (a launcher inside a loop or
conditional, an argument that needs command output, an unsupported launcher) becomes a `Problem` naming the line:
never a guess.
"""

from __future__ import annotations

import copy
import os
import posixpath
from collections.abc import Mapping
from dataclasses import dataclass, field

from xmem.jobscript.shell import REDIRECTIONS, SEPARATORS, Op, Part, Token, Unknown, Word, expand
from xmem.launchers import LAUNCHER_NAMES, LaunchError, Target, console_script_python, gpus_per_node, is_python, \
    launcher_variables, parse_launch, shebang_python, SRUN_LONG_FLAGS, SRUN_SHORT_WITH_VALUE


@dataclass(frozen=True)
class Problem:
    """Something in the script xmem could not understand, with the line it is on (0: the script as a whole)."""

    line_no: int
    line: str
    reason: str

    def __str__(self) -> str:
        where = f"line {self.line_no}: " if self.line_no else ""
        return f"{where}{self.reason}" + (f"  [{self.line.strip()}]" if self.line.strip() else "")


@dataclass(frozen=True)
class TrainCommand:
    """One training process to estimate: `argv` as `run_trace` takes it (`["python", "train.py", ...]` or
    `["python", "-m", "pkg.train", ...]`), the working directory, the environment the script adds, the interpreter
    (None: the default one), the launcher that started it and how many ranks per node it starts."""

    argv: tuple[str, ...]
    cwd: str | None
    env: Mapping[str, str] = field(default_factory=dict)
    python: str | None = None
    launcher: str = "python"
    ranks: int | None = None
    line_no: int = 0

    def to_json(self) -> dict:
        return {"argv": list(self.argv), "cwd": self.cwd, "env": dict(self.env), "python": self.python,
                "launcher": self.launcher, "ranks": self.ranks, "line_no": self.line_no}


class Opaque:
    """A word whose value is only known when the job runs."""

    def __init__(self, source: str, what: str):
        self.source = source
        self.what = what


Item = str | Opaque

_SHELLS = {"sh", "bash", "dash", "zsh", "ksh"}  # a wrapper script's interpreters
_WRAPPERS = {"exec", "time", "nohup", "command", "builtin", "nice", "ionice", "taskset", "numactl", "stdbuf"}
_TEXT_COMMANDS = {"echo", "printf", "which", "type", "whereis", "module", "ml", "pip", "pip3", "hash", "alias",
                  "conda", "mamba", "micromamba", "nvidia-smi", "cat", "tee", "grep", "read"}
_UNSUPPORTED_LAUNCHERS = {"mpirun", "mpiexec", "horovodrun", "singularity", "apptainer", "docker",
                          "podman", "enroot", "charliecloud", "parallel", "xargs"}
_NOT_TRAINING_MODULES = {"pip", "venv", "ensurepip", "site", "json.tool", "http.server", "pytest",
                         "torch.utils.collect_env", "sysconfig", "platform"}
_SRUN_SHORT_VALUE, _SRUN_LONG_FLAGS = SRUN_SHORT_WITH_VALUE, SRUN_LONG_FLAGS
_BLOCK_OPENERS = {"if", "while", "until", "for", "case", "select", "{"}
_BLOCK_CLOSERS = {"fi", "done", "esac", "}"}
_BLOCK_CONTINUATIONS = {"then", "do", "else", "elif", "!"}


@dataclass
class ShellState:
    """What a static read knows at a point of the script."""

    base_env: Mapping[str, str]
    positional: list[str]
    script_name: str
    cwd: str | None
    shell_vars: dict[str, str] = field(default_factory=dict)
    exported: set[str] = field(default_factory=set)
    unset: set[str] = field(default_factory=set)
    dynamic: dict[str, str] = field(default_factory=dict)  # name -> why its value is unknown
    env_changes: dict[str, str] = field(default_factory=dict)
    python: str | None = None
    cwd_unknown: str | None = None  # why the working directory is unknown

    def lookup(self, name: str) -> str | None:
        if name in self.dynamic:
            raise Unknown(f"${name} ({self.dynamic[name]})")
        if name in self.shell_vars:
            return self.shell_vars[name]
        if name in self.unset:
            return None
        value = self.base_env.get(name)
        if value is None and (name in RUNTIME_ONLY or name.startswith("SLURM_")):
            raise Unknown(f"${name} (set when the job runs)")
        return value

    def assign(self, name: str, value: str | Opaque) -> None:
        self.unset.discard(name)
        if isinstance(value, Opaque):
            self.dynamic[name] = value.what
            self.shell_vars.pop(name, None)
            self.env_changes.pop(name, None)
            return
        self.dynamic.pop(name, None)
        self.shell_vars[name] = value
        if name in self.exported or name in self.base_env:
            self.env_changes[name] = value  # an exported variable's new value reaches child processes

    def export(self, name: str) -> None:
        self.exported.add(name)
        if name in self.shell_vars:
            self.env_changes[name] = self.shell_vars[name]


# Variables Slurm (or the node) sets when the job runs, whose value no static read can know.
RUNTIME_ONLY = {"CUDA_VISIBLE_DEVICES", "HOSTNAME", "RANDOM", "PPID", "BASHPID", "TMPDIR"}


@dataclass
class Finder:
    """Walks the token stream of a script, one simple command at a time."""

    state: ShellState
    lines: list[str]
    default_ranks: int | None = None
    commands: list[TrainCommand] = field(default_factory=list)
    problems: list[Problem] = field(default_factory=list)
    depth: int = 0

    def run(self, tokens: list[Token]) -> None:
        saved: list[ShellState] = []
        for words, after_or in _simple_commands(tokens):
            if words == "(":  # a subshell: what it changes (cd, variables) is gone after its `)`
                saved.append(copy.deepcopy(self.state))
            elif words == ")":
                if saved:
                    self.state = saved.pop()
            elif after_or:
                self.depth += 1  # `a || b`: b runs only when a fails, which a static read cannot tell
                self._command(words)
                self.depth -= 1
            else:
                self._command(words)

    def problem(self, line_no: int, reason: str) -> None:
        line = self.lines[line_no - 1] if 0 < line_no <= len(self.lines) else ""
        self.problems.append(Problem(line_no, line, reason))

    # -- one simple command -------------------------------------------------------------------------------------
    def _command(self, words: list[Word]) -> None:
        words = self._strip_keywords(words)
        if not words:
            return
        line_no = words[0].line_no
        prefix_env: dict[str, Item] = {}
        while words and _assignment_name(words[0]):
            name, value = self._assignment(words[0])
            prefix_env[name] = value
            words = words[1:]
        if not words:
            for name, value in prefix_env.items():
                self.state.assign(name, self._blocky(value, name))
            return
        if words[0].literal in ("export", "declare", "readonly", "local"):
            items = [self._expand(words[0])] + [self._declaration(w) for w in words[1:]]
        else:
            items = [self._expand(w) for w in words]
        flat = [item for group in items for item in group]
        if not flat:
            return
        self._dispatch(flat, prefix_env, line_no, [w.source for w in words])

    def _strip_keywords(self, words: list[Word]) -> list[Word]:
        while words:
            keyword = words[0].literal
            if keyword == "function":  # `function f {` or `function f() {`: the body's `{` opens the block
                self.depth += sum(1 for w in words if w.literal == "{")
                return []
            if keyword in _BLOCK_OPENERS:
                self.depth += 1
                if keyword in ("for", "case", "select"):
                    return []  # their own words are loop variables and patterns, not commands
                words = words[1:]
            elif keyword in _BLOCK_CLOSERS:
                self.depth = max(0, self.depth - 1)
                words = words[1:]
            elif keyword in _BLOCK_CONTINUATIONS:
                words = words[1:]
            else:
                return words
        return words

    def _blocky(self, value: Item, name: str) -> Item:
        """A variable set inside a loop or conditional may or may not hold that value afterwards."""
        if self.depth and isinstance(value, str):
            return Opaque(name, "set inside a loop or conditional")
        return value

    def _assignment(self, word: Word) -> tuple[str, Item]:
        first = word.parts[0]
        name, _, rest = first.text.partition("=")
        value_word = Word((Part("lit", rest, False), *word.parts[1:]), word.line_no)
        try:
            return name, " ".join(expand(value_word, self.state.lookup, self.state.positional,
                                         self.state.script_name))
        except Unknown as e:
            return name, Opaque(word.source, e.what)

    def _declaration(self, word: Word) -> list[Item]:
        """`export X=$A`: an assignment argument is not split into words (bash's declaration builtins)."""
        if not _assignment_name(word):
            return self._expand(word)
        name, value = self._assignment(word)
        return [value if isinstance(value, Opaque) else f"{name}={value}"]

    def _expand(self, word: Word) -> list[Item]:
        try:
            return list(expand(word, self.state.lookup, self.state.positional, self.state.script_name))
        except Unknown as e:
            return [Opaque(word.source, e.what)]

    def _dispatch(self, items: list[Item], prefix_env: dict[str, Item], line_no: int, sources: list[str]) -> None:
        head = items[0]
        if isinstance(head, Opaque):
            if _mentions_launcher(sources):
                self.problem(line_no, f"the command itself is {head.source}, which depends on {head.what}")
            return
        if self._launch(items, prefix_env, line_no, via=None, ranks=None):
            return
        name = posixpath.basename(head)
        if name in _WRAPPERS or name == "env":
            self._dispatch_wrapped(items, prefix_env, line_no, sources)
        elif name in ("cd", "pushd"):
            self._cd(items[1:], line_no)
        elif name in ("export", "declare", "readonly", "local"):
            self._export(items[1:], line_no, exported=name == "export" or "-x" in items[1:])
        elif name == "unset":
            for item in items[1:]:
                if isinstance(item, str) and not item.startswith("-"):
                    self.state.shell_vars.pop(item, None)
                    self.state.dynamic.pop(item, None)
                    self.state.env_changes.pop(item, None)
                    self.state.unset.add(item)
        elif name in ("source", "."):
            self._source(items[1:], line_no)
        elif name in ("conda", "mamba", "micromamba") and len(items) > 1 and items[1] == "activate":
            self._conda_activate(items[2:], line_no)
        elif name == "srun":
            self._srun(items[1:], prefix_env, line_no, sources)
        elif name in _UNSUPPORTED_LAUNCHERS:
            if _mentions_launcher(sources) or name == "horovodrun":
                self.problem(line_no, f"'{name}' launches the training in a way xmem does not follow")
        elif name not in _TEXT_COMMANDS and _mentions_launcher(sources[1:]):
            self.problem(line_no, f"python is started through '{name}', which xmem does not follow")

    def _dispatch_wrapped(self, items: list[Item], prefix_env: dict[str, Item], line_no: int,
                          sources: list[str]) -> None:
        name = posixpath.basename(str(items[0]))
        rest = items[1:]
        env = dict(prefix_env)
        while rest and isinstance(rest[0], str) and (rest[0].startswith("-") or
                                                      (name == "env" and "=" in rest[0])):
            word = rest.pop(0)
            if name == "env" and "=" in word and not word.startswith("-"):
                key, _, value = word.partition("=")
                env[key] = value
            elif name == "env" and word in ("-u", "--unset") and rest:
                rest.pop(0)
            elif name in ("nice", "numactl", "taskset", "ionice") and word in ("-n", "-c", "-p", "-C", "-m",
                                                                                 "-N") and rest:
                rest.pop(0)
        if name == "taskset" and rest and isinstance(rest[0], str) and rest[0][:1].isdigit():
            rest.pop(0)  # taskset MASK command
        if rest:
            self._dispatch(rest, env, line_no, sources[len(items) - len(rest):] or sources)

    # -- state changes -------------------------------------------------------------------------------------------
    def _cd(self, args: list[Item], line_no: int) -> None:
        args = [a for a in args if not (isinstance(a, str) and a in ("-P", "-L", "--"))]
        target: Item = args[0] if args else (self.state.lookup("HOME") or "~")
        if self.depth:
            self.state.cwd_unknown = f"'cd' on line {line_no} is inside a loop or conditional"
        elif isinstance(target, Opaque):
            self.state.cwd_unknown = f"'cd {target.source}' on line {line_no} depends on {target.what}"
        elif target == "-":
            self.state.cwd_unknown = f"'cd -' on line {line_no}"
        else:
            base = self.state.cwd or ""
            self.state.cwd = posixpath.normpath(posixpath.join(base, target)) if base or target.startswith("/") \
                else target

    def _export(self, args: list[Item], line_no: int, exported: bool = True) -> None:
        for arg in args:
            if isinstance(arg, Opaque):
                name = arg.source.partition("=")[0]
                if name.isidentifier():
                    if exported:
                        self.state.exported.add(name)
                    self.state.assign(name, arg)
                continue
            if arg.startswith("-"):
                continue
            name, eq, value = arg.partition("=")
            if eq:
                if exported:
                    self.state.exported.add(name)
                self.state.assign(name, self._blocky(value, name))
            elif exported:
                self.state.export(name)

    def _source(self, args: list[Item], line_no: int) -> None:
        if not args:
            return
        path = args[0]
        if isinstance(path, Opaque):
            if path.source.endswith("/bin/activate"):
                self.problem(line_no, f"cannot tell which virtual environment: {path.source} depends on "
                                      f"{path.what}")
            return
        if path.endswith("bin/activate") and len(args) == 1:
            self._activate(posixpath.dirname(posixpath.dirname(self._absolute(path))), line_no)
        elif posixpath.basename(path) == "activate" and len(args) > 1 and isinstance(args[1], str):
            self._conda_activate(args[1:], line_no)  # old conda: `source activate NAME`

    def _activate(self, prefix: str, line_no: int) -> None:
        if self.depth:
            self.problem(line_no, "environment activated inside a loop or conditional: interpreter unknown")
            return
        self.state.python = posixpath.join(prefix, "bin", "python")
        self.state.assign("VIRTUAL_ENV", prefix)
        self.state.export("VIRTUAL_ENV")
        path = self.state.lookup("PATH") or ""
        self.state.assign("PATH", posixpath.join(prefix, "bin") + (":" + path if path else ""))
        self.state.export("PATH")

    def _conda_activate(self, args: list[Item], line_no: int) -> None:
        names = [a for a in args if isinstance(a, Opaque) or not a.startswith("-")]
        if not names or isinstance(names[0], Opaque):
            self.problem(line_no, "cannot tell which conda environment is activated")
            return
        prefix = _conda_prefix(names[0], self.state.base_env)
        if prefix is None:
            self.problem(line_no, f"conda environment '{names[0]}' is not found from here (looked in the envs "
                                  "folders of $CONDA_EXE / $CONDA_PREFIX and ~/.conda/envs)")
            return
        self._activate(prefix, line_no)

    def _absolute(self, path: str) -> str:
        if path.startswith("/") or not self.state.cwd:
            return path
        return posixpath.normpath(posixpath.join(self.state.cwd, path))

    # -- launchers -----------------------------------------------------------------------------------------------
    def _rank_zero_env(self, target: Target) -> dict[str, str]:
        """What the launcher gives the rank estimated (rank 0) on the job's node."""
        return launcher_variables(target, gpus_per_node(target, self.state.base_env))

    def _srun(self, args: list[Item], prefix_env: dict[str, Item], line_no: int, sources: list[str]) -> None:
        options: dict[str, Item | None] = {}
        rest = list(args)
        while rest and isinstance(rest[0], str) and rest[0].startswith("-") and rest[0] != "-":
            arg = rest.pop(0)
            if arg == "--":
                break
            if arg.startswith("--"):
                name, eq, value = arg[2:].partition("=")
                if eq or name in _SRUN_LONG_FLAGS:
                    options[name] = value if eq else None
                elif rest:
                    options[name] = rest.pop(0)
            else:
                letter = arg[1]
                if letter in _SRUN_SHORT_VALUE:
                    options[letter] = arg[2:] if len(arg) > 2 else (rest.pop(0) if rest else None)
        if "multi-prog" in options:
            if _mentions_launcher(sources):
                self.problem(line_no, "srun --multi-prog: the programs are in a separate file xmem does not read")
            return
        if not rest:
            return
        per_node = options.get("ntasks-per-node")
        ntasks = options.get("ntasks", options.get("n"))
        ranks = _rank_count(per_node if per_node is not None else ntasks)
        if ranks is None:
            ranks = self.default_ranks
        if not self._launch(rest, prefix_env, line_no, via="srun", ranks=ranks):
            self._dispatch(rest, prefix_env, line_no, sources[-len(rest):])

    def _launch(self, items: list[Item], prefix_env: dict[str, Item], line_no: int, via: str | None,
                ranks: int | None) -> bool:
        """Record a command that starts a Python program (a python interpreter or a launcher, read by
        `xmem.launchers`); False when `items` is none of these. `via` is an outer launcher (srun) recorded in place of
        the program's own; `ranks` are its processes per node."""
        head = items[0]
        name = posixpath.basename(head) if isinstance(head, str) else ""
        if not is_python(name) and name not in LAUNCHER_NAMES:
            return self._python_file(items, prefix_env, line_no, via, ranks)
        words = [item if isinstance(item, str) else _marked(item, i) for i, item in enumerate(items)]
        opaque = {_marker(i): item for i, item in enumerate(items) if isinstance(item, Opaque)}

        def known(word: str) -> Item:  # a word that holds a value known only at run time is that value
            return next((item for marker, item in opaque.items() if marker in word), word)
        try:
            target = parse_launch(words)
        except LaunchError as error:
            if not is_python(name):  # `python -c`, `python --version`: not a training command
                self.problem(line_no, f"{name}: {error.message}")
            return True
        if target is None:
            return False
        if target.module in _NOT_TRAINING_MODULES:
            return True
        argv = ["python", *map(known, target.child_argv())]
        env = {**prefix_env, **{name: known(value) for name, value in self._rank_zero_env(target).items()}}
        python = self._interpreter(head) if is_python(name) else _sibling_python(head, self.state)
        self._emit(argv, env, line_no, python, via or target.launcher or "python",
                   target.nproc_per_node if target.distributed else ranks)
        return True

    def _python_file(self, items: list[Item], prefix_env: dict[str, Item], line_no: int, via: str | None,
                     ranks: int | None) -> bool:
        """Record a Python program run directly (`trl sft ...`: an environment's console script, or a script with a
        python shebang), found as the shell finds it: the file run by python, on the interpreter beside it that its
        shebang names (`xmem.launchers`, the tracer's rule too), else the script's. Commands the reader reads by
        name (pip, conda, horovodrun) are not training programs even where they are Python."""
        head = items[0]
        if not isinstance(head, str) or posixpath.basename(head) in _TEXT_COMMANDS | _UNSUPPORTED_LAUNCHERS:
            return False
        path = self._program_file(head)
        first_line = _first_line(path) if path else ""
        if path is None or shebang_python(first_line) is None:
            return self._shell_program(items, prefix_env, line_no, via, ranks)
        self._emit(["python", path, *items[1:]], prefix_env, line_no, console_script_python(path, first_line),
                   via or "python", ranks)
        return True

    def _shell_program(self, items: list[Item], prefix_env: dict[str, Item], line_no: int, via: str | None,
                       ranks: int | None) -> bool:
        """Record a shell wrapper that starts the training (`bash train.sh`, `sh -c '...'`, `./run.sh` with a
        shell's shebang), as Megatron, NeMo and DeepSpeed document their launches: it runs as the job runs it and
        every Python process it starts is traced (`xmem.trace.child.launch`). Only one whose text names a Python
        launcher (a wrapper that only prepares data or prints is not the job's training)."""
        head = items[0]
        if not isinstance(head, str):
            return False
        if posixpath.basename(head) in _SHELLS:
            script = next((item for item in items[1:] if not (isinstance(item, str) and item.startswith("-"))), None)
            text = script if "-c" in items[1:2] and isinstance(script, str) else \
                _file_text(self._absolute(script)) if isinstance(script, str) else ""
        else:
            path = self._program_file(head)
            text = _file_text(path) if path else ""
            if not text.startswith("#!") or posixpath.basename(text.split()[0]) not in _SHELLS | {"env"}:
                return False
        if not _mentions_launcher(text.split()):
            return False
        self._emit([head, *items[1:]], prefix_env, line_no, None, via or "shell", ranks)
        return True

    def _program_file(self, program: str) -> str | None:
        """Where the shell finds `program`: a path (from the working directory), or a name on the script's PATH."""
        if "/" in program:
            return self._absolute(program)
        try:
            directories = (self.state.lookup("PATH") or "").split(":")
        except Unknown:
            return None
        found = (posixpath.join(self._absolute(d or "."), program) for d in directories)
        return next((path for path in found if os.path.isfile(path) and os.access(path, os.X_OK)), None)

    def _interpreter(self, head: Item) -> str | None:
        if not isinstance(head, str):
            return None
        if "/" in head:
            return self._absolute(head)
        if self.state.python:
            return self.state.python
        if head in ("python", "python3"):
            return None
        return head  # e.g. python3.11: resolved on PATH by whoever runs it

    def _emit(self, argv: list[Item], prefix_env: dict[str, Item], line_no: int, python: str | None,
              launcher: str, ranks: int | None) -> None:
        if self.depth:
            self.problem(line_no, "training command inside a loop, conditional or function: xmem cannot tell "
                                  "statically whether or how often it runs")
            return
        for item in [*argv, *prefix_env.values()]:
            if isinstance(item, Opaque):
                self.problem(line_no, f"{item.source} depends on {item.what}, only known when the job runs")
                return
        if self.state.cwd_unknown:
            self.problem(line_no, f"working directory unknown: {self.state.cwd_unknown}")
            return
        env = {**self.state.env_changes, **{k: str(v) for k, v in prefix_env.items()}}
        self.commands.append(TrainCommand(
            argv=tuple(str(a) for a in argv), cwd=self.state.cwd, env=env,
            python=python if python is not None else self.state.python, launcher=launcher, ranks=ranks,
            line_no=line_no))


def _first_line(path: str) -> str:
    try:
        with open(path, "rb") as f:
            return f.readline(512).decode(errors="replace")
    except OSError:
        return ""


def _file_text(path: str, limit: int = 1 << 16) -> str:
    """The first `limit` bytes of a wrapper script, as text ("" when it cannot be read)."""
    try:
        with open(path, "rb") as f:
            return f.read(limit).decode(errors="replace")
    except OSError:
        return ""


def _marker(index: int) -> str:
    return f"\0{index}\0"


def _marked(item: Opaque, index: int) -> str:
    """A word known only at run time, for the launcher grammar: its literal start (`--nproc_per_node=`, so that the
    launcher's option is still read as one, with a value that is no number) and a marker of the word."""
    start = item.source.split("$", 1)[0] if item.source.startswith("-") else ""
    return start + _marker(index)


def _rank_count(value: Item | None) -> int | None:
    """srun's tasks per node when given as a number; a run-time value says nothing (the estimate is per rank)."""
    if isinstance(value, str) and value.isdigit():
        return int(value)
    return None


def _simple_commands(tokens: list[Token]) -> list[tuple[list[Word] | str, bool]]:
    """Group tokens into simple commands, each with whether it follows `||`; redirections and their targets are
    dropped. A subshell's `(` and `)` come through as such."""
    commands: list[tuple[list[Word] | str, bool]] = []
    current: list[Word] = []
    after_or = skip_next = False
    for token in tokens:
        if isinstance(token, Op):
            if token.text in REDIRECTIONS:
                skip_next = True
            elif token.text in SEPARATORS:
                if current:
                    commands.append((current, after_or))
                current = []
                if token.text in ("(", ")"):
                    commands.append((token.text, False))
                after_or = token.text == "||"
            continue
        if skip_next:
            skip_next = False
            continue
        current.append(token)
    if current:
        commands.append((current, after_or))
    return commands


def _assignment_name(word: Word) -> str | None:
    first = word.parts[0]
    if first.kind != "lit" or first.quoted or "=" not in first.text:
        return None
    name = first.text.partition("=")[0]
    return name if name.isidentifier() else None


def _mentions_launcher(sources: list[str]) -> bool:
    return any(is_python(posixpath.basename(s)) or posixpath.basename(s) in LAUNCHER_NAMES
               or s.endswith(".py") for s in sources)


def _sibling_python(launcher_path: Item, state: ShellState) -> str | None:
    """`/opt/env/bin/torchrun` runs `/opt/env/bin/python`; a bare `torchrun` runs the active environment's."""
    if isinstance(launcher_path, str) and "/" in launcher_path:
        return posixpath.join(posixpath.dirname(launcher_path), "python")
    return state.python


def _conda_prefix(name: str, env: Mapping[str, str]) -> str | None:
    if "/" in name:
        return name
    bases: list[str] = []
    if env.get("CONDA_EXE"):
        bases.append(posixpath.dirname(posixpath.dirname(env["CONDA_EXE"])))
    prefix = env.get("CONDA_PREFIX")
    if prefix:
        bases.append(prefix.split("/envs/")[0])
    home = env.get("HOME")
    for base in bases:
        if posixpath.basename(base) == name or name == "base":
            return base
    candidates = [posixpath.join(b, "envs", name) for b in bases]
    if home:
        candidates.append(posixpath.join(home, ".conda", "envs", name))
    return next((c for c in candidates if os.path.isdir(c)), None)
