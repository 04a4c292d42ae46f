"""`#SBATCH` directives: find them the way sbatch does and turn them into an `SbatchRequest`.

Owns: the sbatch option table (Slurm 22.05, `sbatch --help`), directive tokenising (sbatch's `get_argument`),
getopt-style option parsing (short clusters, `--long=value`, `--long value`, unambiguous long prefixes), and GRES /
`--gpus` value parsing. It reads text only: no Slurm call, no file access.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

# Long options that take a value ("=" in sbatch's help), optional value ("[=" in the help) or none.
# From `sbatch --help` of Slurm 22.05.8, plus the documented options the help omits.
_VALUE_OPTIONS = """
account acctg-freq array batch bb bbf begin chdir cluster-constraint clusters comment constraint container
core-spec cores-per-socket cpu-freq cpus-per-gpu cpus-per-task deadline delay-boot dependency distribution error
export-file extra-node-info gid gpu-bind gpu-freq gpus gpus-per-node gpus-per-socket gpus-per-task gres gres-flags
hint input job-name licenses mail-type mail-user mcs-label mem mem-bind mem-per-cpu mem-per-gpu mincpus network
nodefile nodelist nodes ntasks ntasks-per-core ntasks-per-gpu ntasks-per-node ntasks-per-socket open-mode output
partition power prefer priority profile qos reservation signal sockets-per-node switches thread-spec
threads-per-core time time-min tmp tres-per-task uid wckey exclude cpu-bind
""".split()
_OPTIONAL_VALUE_OPTIONS = "export nice propagate exclusive wrap kill-on-invalid-dep requeue-exit".split()
_FLAG_OPTIONS = """
contiguous get-user-env help hold ignore-pbs no-kill no-requeue overcommit oversubscribe parsable quiet reboot
requeue spread-job test-only use-min-nodes usage verbose version wait x11
""".split()

# sbatch's short options and the long option each stands for.
_SHORT_OPTIONS = {
    "a": "array", "A": "account", "b": "begin", "B": "extra-node-info", "c": "cpus-per-task", "C": "constraint",
    "d": "dependency", "D": "chdir", "e": "error", "F": "nodefile", "G": "gpus", "h": "help", "H": "hold",
    "i": "input", "J": "job-name", "k": "no-kill", "L": "licenses", "m": "distribution", "M": "clusters",
    "n": "ntasks", "N": "nodes", "o": "output", "O": "overcommit", "p": "partition", "q": "qos", "Q": "quiet",
    "s": "oversubscribe", "S": "core-spec", "t": "time", "v": "verbose", "V": "version", "w": "nodelist",
    "W": "wait", "x": "exclude",
}
_ALL_LONG = (*_VALUE_OPTIONS, *_OPTIONAL_VALUE_OPTIONS, *_FLAG_OPTIONS)

MAGIC = "#SBATCH"
GPU_GRES_NAMES = ("gpu", "mps", "shard")


class DirectiveError(ValueError):
    """A directive sbatch itself would reject (unknown option, missing value)."""


@dataclass(frozen=True)
class GresItem:
    """One generic resource request: `gpu:a100:2` -> name "gpu", type "a100", count 2."""

    name: str
    type: str | None
    count: int

    def __str__(self) -> str:
        return ":".join(p for p in (self.name, self.type, str(self.count)) if p)


@dataclass(frozen=True)
class SbatchRequest:
    """What the job asks Slurm for: the options xmem acts on, parsed, and every option as given (`raw`).

    `raw` holds `(long option name, value or None, line number)`; line 0 means the sbatch command line, -1 an
    SBATCH_* environment variable.
    """

    partition: str | None = None
    gres: tuple[GresItem, ...] = ()
    gpus: str | None = None
    gpus_per_node: str | None = None
    gpus_per_task: str | None = None
    constraint: str | None = None
    account: str | None = None
    nodes: str | None = None
    ntasks: int | None = None
    ntasks_per_node: int | None = None
    job_name: str | None = None
    chdir: str | None = None
    array: str | None = None  # --array's task list as written (`0-15:4%2`): see array_task_ids
    raw: tuple[tuple[str, str | None, int], ...] = ()

    @property
    def gpu_items(self) -> tuple[GresItem, ...]:
        """Every GPU-ish request, whatever option it came through, as GRES items."""
        items = [g for g in self.gres if g.name in GPU_GRES_NAMES]
        for value in (self.gpus, self.gpus_per_node, self.gpus_per_task):
            if value:
                items.extend(parse_gpus(value))
        return tuple(items)

    @property
    def wants_gpu(self) -> bool:
        return any(item.count > 0 for item in self.gpu_items)

    @property
    def is_generic_gpu_request(self) -> bool:
        """A plain `gpu` request with a count only (`--gres=gpu:1`, `-G 2`): no type, no MPS/shard choice."""
        items = [i for i in self.gpu_items if i.count > 0]
        return bool(items) and all(i.name == "gpu" and i.type is None for i in items)

    @property
    def explicit_type(self) -> str | None:
        """The GPU type the user named (`gpu:a100:1`, `--gpus=h100:1`, `mps:a100:30`), if any."""
        return next((i.type for i in self.gpu_items if i.type and i.count > 0), None)

    @property
    def gpu_count(self) -> int:
        """Whole GPUs wanted per node (at least 1 once a GPU is wanted); MPS/shard requests count as one GPU."""
        gpus = sum(i.count for i in self.gpu_items if i.name == "gpu")
        if gpus == 0 and self.wants_gpu:
            return 1
        return gpus

    @property
    def tasks_per_node(self) -> int:
        """The most tasks one node may run: --ntasks-per-node, else all of --ntasks on one node unless --nodes
        spreads them (sbatch may place them all together when it does not)."""
        if self.ntasks_per_node:
            return self.ntasks_per_node
        nodes = int(self.nodes) if self.nodes and self.nodes.isdigit() and int(self.nodes) > 0 else 1
        return -(-(self.ntasks or 1) // nodes)

    @property
    def gpus_on_node(self) -> int:
        """Whole GPUs one node gives the job (what its programs see): a per-task request counts once per task the
        node runs."""
        if self.gpus_per_task:
            return max(1, sum(i.count for i in parse_gpus(self.gpus_per_task))) * self.tasks_per_node
        return self.gpu_count

    def to_json(self) -> dict:
        return {
            "partition": self.partition, "gres": [str(g) for g in self.gres], "gpus": self.gpus,
            "gpus_per_node": self.gpus_per_node, "gpus_per_task": self.gpus_per_task,
            "constraint": self.constraint, "account": self.account, "nodes": self.nodes, "ntasks": self.ntasks,
            "ntasks_per_node": self.ntasks_per_node, "job_name": self.job_name, "chdir": self.chdir,
            "wants_gpu": self.wants_gpu, "generic_gpu_request": self.is_generic_gpu_request,
            "explicit_type": self.explicit_type,
            "raw": [list(r) for r in self.raw],
        }


@dataclass(frozen=True)
class Directive:
    option: str
    value: str | None
    line_no: int


@dataclass
class DirectiveScan:
    directives: list[Directive] = field(default_factory=list)
    errors: list[tuple[int, str, str]] = field(default_factory=list)  # (line_no, line, reason)


def scan_directives(lines: list[str]) -> DirectiveScan:
    """Read `#SBATCH` lines as sbatch does: from the top until the first line that is not a comment or blank."""
    scan = DirectiveScan()
    for index, line in enumerate(lines):
        line_no = index + 1
        if line.startswith(MAGIC) and (len(line) == len(MAGIC) or line[len(MAGIC)].isspace()):
            try:
                args = directive_arguments(line[len(MAGIC):])
                scan.directives.extend(Directive(o, v, line_no) for o, v in parse_options(args))
            except DirectiveError as e:
                scan.errors.append((line_no, line, str(e)))
        elif line.lstrip().startswith("#") or not line.strip():
            continue
        else:
            break  # sbatch stops at the first command: later #SBATCH lines are comments
    return scan


def directive_arguments(text: str) -> list[str]:
    """Split a directive's text into arguments like sbatch's `get_argument`: whitespace separates, double quotes
    group, a backslash escapes, and an unquoted `#` starts a comment."""
    args: list[str] = []
    current: list[str] | None = None  # characters of the argument being built; appended to, never copied
    quoted = escaped = False
    for ch in text:
        if escaped:
            current.append(ch)  # type: ignore[union-attr]  # the backslash started the argument
            escaped = False
        elif ch == "\\":
            escaped = True
            current = [] if current is None else current
        elif ch == '"':
            quoted = not quoted
            current = [] if current is None else current
        elif not quoted and ch == "#":
            break
        elif not quoted and ch.isspace():
            if current is not None:
                args.append("".join(current))
                current = None
        else:
            current = [] if current is None else current
            current.append(ch)
    if quoted:
        raise DirectiveError("unterminated double quote")
    if current is not None:
        args.append("".join(current))
    return args


def parse_options(args: list[str]) -> Iterable[tuple[str, str | None]]:
    """getopt_long over sbatch's table: yields (long name, value or None). Non-options are ignored, as sbatch
    ignores them in a directive (it would take them as the script otherwise)."""
    out: list[tuple[str, str | None]] = []
    i = 0
    while i < len(args):
        arg = args[i]
        i += 1
        if arg.startswith("--") and len(arg) > 2:
            name, eq, value = arg[2:].partition("=")
            name = _resolve_long(name)
            if name in _FLAG_OPTIONS:
                if eq:
                    raise DirectiveError(f"option --{name} takes no value")
                out.append((name, None))
            elif name in _OPTIONAL_VALUE_OPTIONS:
                out.append((name, value if eq else None))
            elif eq:
                out.append((name, value))
            elif i < len(args):
                out.append((name, args[i]))
                i += 1
            else:
                raise DirectiveError(f"option --{name} needs a value")
        elif arg.startswith("-") and len(arg) > 1:
            i = _parse_short_cluster(arg[1:], args, i, out)
    return out


def _parse_short_cluster(cluster: str, args: list[str], i: int, out: list) -> int:
    for pos, letter in enumerate(cluster):
        name = _SHORT_OPTIONS.get(letter)
        if name is None:
            raise DirectiveError(f"unknown option -{letter}")
        if name in _FLAG_OPTIONS:
            out.append((name, None))
            continue
        rest = cluster[pos + 1:]
        if rest:
            out.append((name, rest))
        elif i < len(args):
            out.append((name, args[i]))
            i += 1
        else:
            raise DirectiveError(f"option -{letter} needs a value")
        break
    return i


def _resolve_long(name: str) -> str:
    """getopt_long accepts any unambiguous prefix of a long option."""
    if name in _ALL_LONG:
        return name
    matches = [o for o in _ALL_LONG if o.startswith(name)]
    if len(matches) == 1:
        return matches[0]
    if not matches:
        raise DirectiveError(f"unknown option --{name}")
    raise DirectiveError(f"ambiguous option --{name} (could be {', '.join('--' + m for m in sorted(matches))})")


_COUNT = re.compile(r"^(\d+)([kKmMgGtT]?)$")
_SUFFIX = {"": 1, "k": 1024, "m": 1024**2, "g": 1024**3, "t": 1024**4}


def _count(text: str) -> int | None:
    match = _COUNT.match(text)
    if not match:
        return None
    return int(match.group(1)) * _SUFFIX[match.group(2).lower()]


def parse_gres(value: str) -> tuple[GresItem, ...]:
    """`--gres` list: `name[[:type]:count]` items separated by commas (`gres:` prefix as cli_filter reads it back)."""
    items: list[GresItem] = []
    for raw_item in value.split(","):
        item = raw_item.strip()
        if item.startswith("gres:") or item.startswith("gres/"):
            item = item[5:]
        if not item or item == "none":
            continue
        parts = item.split(":")
        flags = {"no_consume"}
        parts = [p for p in parts if p not in flags]
        if len(parts) == 1:
            items.append(GresItem(parts[0], None, 1))
        elif len(parts) == 2:
            count = _count(parts[1])
            items.append(GresItem(parts[0], None, count) if count is not None else GresItem(parts[0], parts[1], 1))
        elif len(parts) == 3 and _count(parts[2]) is not None:
            items.append(GresItem(parts[0], parts[1], _count(parts[2]) or 0))
        else:
            raise DirectiveError(f"invalid GRES item {raw_item!r} (expected name[:type][:count])")
    return tuple(items)


def parse_gpus(value: str) -> tuple[GresItem, ...]:
    """`--gpus`/`--gpus-per-node`/`--gpus-per-task`: `[type:]count`, comma separated."""
    items: list[GresItem] = []
    for raw_item in value.split(","):
        item = raw_item.strip()
        for prefix in ("gres:", "gpu:"):
            if item.startswith(prefix):
                item = item[len(prefix):]
        gpu_type, _, count_text = item.rpartition(":")
        count = _count(count_text)
        if count is None:
            raise DirectiveError(f"invalid GPU count in {raw_item!r} (expected [type:]count)")
        items.append(GresItem("gpu", gpu_type or None, count))
    return tuple(items)


# sbatch's input environment variables for the options xmem reads ("INPUT ENVIRONMENT VARIABLES" in sbatch(1)).
ENV_OPTIONS = {"SBATCH_ACCOUNT": "account", "SBATCH_PARTITION": "partition", "SBATCH_GRES": "gres",
               "SBATCH_GPUS": "gpus", "SBATCH_GPUS_PER_NODE": "gpus-per-node", "SBATCH_GPUS_PER_TASK": "gpus-per-task",
               "SBATCH_CONSTRAINT": "constraint", "SBATCH_JOB_NAME": "job-name", "SBATCH_ARRAY_INX": "array"}
ENV_LINE = -1  # the `line` of an option that came from an SBATCH_* variable


def build_request(directives: Iterable[Directive], cli_options: Mapping[str, str | None] | None = None,
                  env: Mapping[str, str] | None = None) -> tuple[SbatchRequest, list[tuple[int, str]]]:
    """Fold directives, then SBATCH_* variables of `env`, then the sbatch command line into an `SbatchRequest`:
    sbatch's order, each overriding the one before.

    Returns the request and the (line_no, reason) of values that could not be parsed."""
    ordered = list(directives)
    for variable, name in ENV_OPTIONS.items():
        if (env or {}).get(variable):
            ordered.append(Directive(name, env[variable], ENV_LINE))
    for name, value in (cli_options or {}).items():
        if name in _ALL_LONG:
            ordered.append(Directive(name, None if value in (None, "set") else str(value), 0))
    values: dict[str, str | None] = {}
    errors: list[tuple[int, str]] = []
    gres: tuple[GresItem, ...] = ()
    for d in ordered:
        values[d.option] = d.value
        if d.option == "gres" and d.value is not None:
            try:
                gres = parse_gres(d.value)  # a later --gres replaces an earlier one, as in sbatch
            except DirectiveError as e:
                errors.append((d.line_no, str(e)))
        elif d.option in ("gpus", "gpus-per-node", "gpus-per-task") and d.value:
            try:
                parse_gpus(d.value)
            except DirectiveError as e:
                errors.append((d.line_no, str(e)))
                values[d.option] = None
        elif d.option == "array" and d.value:
            try:
                array_task_ids(d.value)
            except DirectiveError as e:
                errors.append((d.line_no, str(e)))
    request = SbatchRequest(
        partition=values.get("partition"),
        gres=gres,
        gpus=values.get("gpus"),
        gpus_per_node=values.get("gpus-per-node"),
        gpus_per_task=values.get("gpus-per-task"),
        constraint=values.get("constraint"),
        account=values.get("account"),
        nodes=values.get("nodes"),
        ntasks=_int_or_none(values.get("ntasks"), "ntasks", ordered, errors),
        ntasks_per_node=_int_or_none(values.get("ntasks-per-node"), "ntasks-per-node", ordered, errors),
        job_name=values.get("job-name"),
        chdir=values.get("chdir"),
        array=values.get("array"),
        raw=tuple((d.option, d.value, d.line_no) for d in ordered),
    )
    line_no = next((d.line_no for d in reversed(ordered) if d.option in ("gres", "gpus", "gpus-per-node",
                                                                        "gpus-per-task")), 0)
    errors += [(line_no, reason) for reason in refused_gpu_mixes(request)]
    return request, errors


MAX_ARRAY_TASKS = 4_000_001  # Slurm's largest MaxArraySize: no job array is longer


def array_task_ids(spec: str) -> tuple[int, ...]:
    """The task ids of `--array` (`0-15:4`, `1,3,5-7`, `0-9%2`): sorted, each once; sbatch's syntax (the `%N`
    throttle says how many run at once, not which)."""
    ids: set[int] = set()
    for part in spec.split("%", 1)[0].split(","):
        match = re.fullmatch(r"\s*(\d+)(?:-(\d+)(?::(\d+))?)?\s*", part)
        if not match:
            raise DirectiveError(f"invalid --array task list {spec!r} (expected e.g. 0-15:4 or 1,3,5)")
        first, last, step = int(match[1]), int(match[2] or match[1]), int(match[3] or 1)
        if step < 1 or last < first or len(ids) + (last - first) // step >= MAX_ARRAY_TASKS:
            raise DirectiveError(f"invalid --array task list {spec!r} (an empty, reversed or too long range)")
        ids.update(range(first, last + 1, step))
    return tuple(sorted(ids))


def refused_gpu_mixes(request: SbatchRequest) -> list[str]:
    """GPU requests Slurm 22.05 refuses (checked on a real cluster, tests/jobscript/test_vs_sbatch.py)."""
    items = [i for i in request.gpu_items if i.count > 0]
    gpus = [i for i in items if i.name == "gpu"]
    reasons = []
    if any(i.type for i in gpus) and any(not i.type for i in gpus):
        reasons.append("sbatch refuses GPU requests with and without a type in one job")
    if gpus and any(i.name in ("mps", "shard") for i in items):
        reasons.append("Slurm refuses whole GPUs together with mps or shard in one job")
    return reasons


def _int_or_none(value: str | None, option: str, ordered: list[Directive], errors: list) -> int | None:
    if value is None:
        return None
    if value.isdigit():
        return int(value)
    line_no = next((d.line_no for d in reversed(ordered) if d.option == option), 0)
    errors.append((line_no, f"--{option}={value} is not a whole number"))
    return None
