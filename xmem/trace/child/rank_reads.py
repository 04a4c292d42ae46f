"""Whether the traced program's ranks can run differently: where its own code tests the rank it reads.

A data-parallel job's ranks run the same program on same-shaped data, so one rank's trace stands for all of them.
They part where the program reads its rank and branches on it: `if rank == 0:` evaluation, checkpoint gathering or
logging, a remainder of work handed to the last rank. This module owns noticing that, in the traced child:
`torch.distributed.get_rank()`, called by the program's own files, answers a `RankNumber` (an int that notes where
it, or a number computed from it, is compared or tested for truth in the program's files); a read of the
launcher's `RANK` / `LOCAL_RANK` variables by the program's file counts where the name it is assigned to is tested
in that file's source. So do the training frameworks' answers (accelerate's `process_index` and
`is_main_process`, Lightning's `global_rank` and `is_global_zero`, ...) read there: a rank number is a RankNumber,
a main-process flag (a bool, which no class can extend) counts as tested where it is read. The estimate
(`xmem.rank_traces`) then traces the last rank too and answers the fuller one.

What does not count, and why. A library's own tests of the rank (its reads stay plain ints, and a RankNumber the
program hands it is noted only in the program's files): upstream's rank-dependent work gives rank 0 the extra
(HF Trainer's and Lightning's saving and logging on the main process, FSDP's `rank0_only` state dict), and rank 0
is traced anyway. Uneven shards: upstream cuts a tensor in torch.chunk's way (FSDP2's fully_shard, DTensor's
Shard placement, tensor parallelism), which gives the first ranks the full chunks and the last the remainder, or
pads to equal parts (FSDP1's FlatParameter, DeepSpeed ZeRO's partitions, DistributedSampler with
drop_last=False, which repeats indices so every rank has as many samples): rank 0's allocations are the same
sequence as any rank's, each no smaller, so rank 0 is the fullest and is traced alone.
Import only in the tracing child.
"""

from __future__ import annotations

import _collections_abc
import ast
import functools
import os
import sys
from typing import Any

from xmem.trace.child.attribution import _is_users
from xmem.trace.child.on_import import patch_on_import

RANK_VARIABLES = ("RANK", "LOCAL_RANK")  # what torchrun's agent (and accelerate's, deepspeed's) set per rank

_world_size = 1  # the largest default process group the program made
_tested_at: dict[str, None] = {}  # "file:line" of the program's tests of its rank, in order, once each


class RankNumber(int):
    """The program's rank (or a number computed from it): an int that notes where the program's own files compare
    it or test its truth. Arithmetic keeps the note-taking (`rank % 2 == 0`, `rank * per < n`)."""

    __hash__ = int.__hash__

    def __reduce__(self) -> Any:
        return int, (int(self),)  # pickled as the plain int another process can read

    def __bool__(self) -> bool:
        _note_test()
        return int(self) != 0


def _note_test() -> None:
    """Note the calling line (two frames up: past the RankNumber method) where it is the program's own."""
    frame = sys._getframe(2)
    if _is_users(frame.f_code.co_filename):
        _tested_at.setdefault(f"{frame.f_code.co_filename}:{frame.f_lineno}", None)


def _comparison(name: str) -> Any:
    compare = getattr(int, name)

    def noted(self: int, other: Any) -> Any:
        _note_test()
        return compare(int(self), other)
    noted.__name__ = name
    return noted


def _arithmetic(name: str) -> Any:
    compute = getattr(int, name)

    def kept(self: int, *other: Any) -> Any:
        result = compute(int(self), *other)
        return RankNumber(result) if type(result) is int else result
    kept.__name__ = name
    return kept


for _name in ("__eq__", "__ne__", "__lt__", "__le__", "__gt__", "__ge__"):
    setattr(RankNumber, _name, _comparison(_name))
for _name in ("__add__", "__radd__", "__sub__", "__rsub__", "__mul__", "__rmul__", "__floordiv__",
              "__rfloordiv__", "__mod__", "__rmod__", "__neg__", "__abs__", "__and__", "__rand__", "__xor__"):
    setattr(RankNumber, _name, _arithmetic(_name))


# The mapping machinery between a program's `os.environ.get(...)` / `os.getenv(...)` and the read itself
_MAPPING_FILES = (os.__file__, _collections_abc.__file__)


def _programs_frame(frame: Any) -> Any:
    """`frame`, or the first above it past os's mapping code, where it is the program's own; else None."""
    while frame is not None and frame.f_code.co_filename in _MAPPING_FILES:
        frame = frame.f_back
    return frame if frame is not None and _is_users(frame.f_code.co_filename) else None


def install() -> None:
    """Hand the program's files a RankNumber for `torch.distributed.get_rank()`, and note their reads of the
    launcher's rank variables; every other caller gets what it got before."""
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d
    get_rank = c10d.get_rank

    def get_rank_noted(group: Any = None) -> int:
        rank = get_rank(group)
        return RankNumber(rank) if _programs_frame(sys._getframe(1)) is not None else rank

    dist.get_rank = c10d.get_rank = get_rank_noted
    _note_environment_reads()
    for module_name, class_name in _FRAMEWORK_CLASSES:
        patch_on_import(module_name, functools.partial(_note_framework_reads, class_name=class_name))


# The training frameworks' answers to "which rank am I", where a program reads them: (module, class); the
# properties each has of RANK_PROPERTIES (ints: a RankNumber to the program) and MAIN_PROPERTIES (bools, which
# cannot be subclassed: reading one in the program's file is its test)
_FRAMEWORK_CLASSES = (
    ("accelerate.accelerator", "Accelerator"), ("accelerate.state", "PartialState"),
    ("accelerate.state", "AcceleratorState"),
    ("lightning.fabric.fabric", "Fabric"), ("lightning_fabric.fabric", "Fabric"),
    ("lightning.pytorch.trainer.trainer", "Trainer"), ("pytorch_lightning.trainer.trainer", "Trainer"),
    ("lightning.pytorch.core.module", "LightningModule"), ("pytorch_lightning.core.module", "LightningModule"),
)
RANK_PROPERTIES = ("process_index", "local_process_index", "global_rank", "local_rank")
MAIN_PROPERTIES = ("is_main_process", "is_local_main_process", "is_last_process", "is_global_zero")


def _note_framework_reads(module: Any, class_name: str) -> None:
    owner = getattr(module, class_name, None)
    if isinstance(owner, type):
        note_property_reads(owner)


def note_property_reads(owner: type) -> None:
    """`owner`'s rank properties, read by the program's files, answer a RankNumber; its main-process flags, read
    there, count as a test of the rank where they are read."""
    for name in (*RANK_PROPERTIES, *MAIN_PROPERTIES):
        found = vars(owner).get(name)
        if isinstance(found, property) and found.fget is not None and not hasattr(found.fget, "_notes_rank"):
            setattr(owner, name, property(_noting(found.fget, name in MAIN_PROPERTIES), found.fset, found.fdel,
                                          found.__doc__))


def _noting(read: Any, is_flag: bool) -> Any:
    def noted(self: Any) -> Any:
        value = read(self)
        frame = _programs_frame(sys._getframe(1))
        if frame is None:
            return value
        if is_flag:
            _tested_at.setdefault(f"{frame.f_code.co_filename}:{frame.f_lineno}", None)
            return value
        return RankNumber(value) if type(value) is int else value
    noted._notes_rank = True  # type: ignore[attr-defined]
    return noted


def _note_environment_reads() -> None:
    """os.environ's class, for this process, one that notes the program's reads of RANK_VARIABLES."""
    environ_class = type(os.environ)

    class RankNotingEnviron(environ_class):  # type: ignore[misc, valid-type]
        def __getitem__(self, key: str) -> str:
            value = super().__getitem__(key)
            if key in RANK_VARIABLES:
                _note_environment_read(sys._getframe(1))
            return value

    if environ_class.__name__ != "RankNotingEnviron":
        os.environ.__class__ = RankNotingEnviron


def _note_environment_read(frame: Any) -> None:
    """A launcher's rank variable read by the program's file (`rank = int(os.environ["RANK"])`): `int()` of a
    string cannot answer a RankNumber (Python copies an int subclass that `__int__` returns into a plain int), so
    the reading file's own source says instead whether the name the value goes into is ever tested there."""
    frame = _programs_frame(frame)
    if frame is None:
        return
    filename, line = frame.f_code.co_filename, frame.f_lineno
    for tested_line in _tests_of_names_read_at(filename, line):
        _tested_at.setdefault(f"{filename}:{tested_line}", None)


@functools.cache
def _parsed(filename: str) -> ast.Module | None:
    try:
        with open(filename, encoding="utf-8") as source:
            return ast.parse(source.read(), filename)
    except (OSError, SyntaxError, ValueError):
        return None


def _tests_of_names_read_at(filename: str, line: int) -> list[int]:
    """The lines of `filename` that test a name (`rank`, `self.rank`, `args.local_rank`) which the assignment at
    `line` gives a value."""
    tree = _parsed(filename)
    if tree is None:
        return []
    assigned = {name for node in ast.walk(tree) if isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign))
                and node.lineno <= line <= (node.end_lineno or node.lineno)
                for target in _targets(node) for name in _target_names(target)}
    return sorted({test.lineno for test in _tests(tree) if assigned & _names_in(test)})


def _targets(node: ast.AST) -> list[ast.AST]:
    return list(node.targets) if isinstance(node, ast.Assign) else [node.target]


def _target_names(target: ast.AST) -> set[str]:
    """The names an assignment binds: `rank`, `self.rank` -> "rank", `rank, world = ...` -> both."""
    if isinstance(target, (ast.Tuple, ast.List)):
        return {name for element in target.elts for name in _target_names(element)}
    if isinstance(target, ast.Attribute):
        return {target.attr}
    return {target.id} if isinstance(target, ast.Name) else set()


def _names_in(node: ast.AST) -> set[str]:
    """The variable and attribute names an expression holds (`self.rank % 2` -> {"self", "rank"})."""
    return {sub.id if isinstance(sub, ast.Name) else sub.attr
            for sub in ast.walk(node) if isinstance(sub, (ast.Name, ast.Attribute))}


def _tests(tree: ast.Module) -> list[ast.AST]:
    """Every comparison and every condition (of if, while, assert, a conditional expression, and, or, not)."""
    tests: list[ast.AST] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            tests.append(node)
        elif isinstance(node, (ast.If, ast.While, ast.IfExp, ast.Assert)):
            tests.append(node.test)
        elif isinstance(node, ast.BoolOp):
            tests.extend(node.values)
        elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
            tests.append(node.operand)
    return tests


def on_world_size(size: int) -> None:
    """The default process group's world size, as the program made it (it may be gone when the trace ends)."""
    global _world_size
    _world_size = max(_world_size, size)


def world_size() -> int:
    """The job's world size as the traced rank saw it: its process group's, else the launcher's WORLD_SIZE."""
    text = os.environ.get("WORLD_SIZE", "1")
    return max(_world_size, int(text) if text.isdigit() else 1)


def tested_at() -> list[str]:
    """Where the program's own files tested its rank ("file:line"), in the order first seen."""
    return list(_tested_at)
