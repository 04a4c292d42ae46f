"""What crosses the tracer's process boundary, typed: the request the estimator hands the traced program's side
(`TraceRequest`: the program, the iterations, the pretended GPU (`FakeGpu`: every fact the fake device reports,
taken from the catalog, `xmem.gpus`), the deadline, where to write; its command line made and read here only), and
the notes that side sends back with its trace (what the fake GPU assumed or left out, each a `NoteKind` with its
words for people), and the warm tracer's socket frames (`WarmRequest`, `WarmReply`: what its client,
`xmem.trace.warm`, and its server, `xmem.trace.child.warm_server`, say to each other).

Both sides import this module and nothing of the other's: the runner makes a request's argv, the child
(`xmem.trace.child.main`, and `follow` for the processes the program starts) reads it back; the child makes notes
and writes them into its result JSON (`notes_json`); the estimator reads them back (`notes_from_json`) and the
command line shows them by their kind, never by parsing their words. Nothing beyond the standard library; runs on
Python 3.10 too (the child runs on the job's interpreter).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import struct
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from enum import Enum
from typing import Any

UPPER_BOUND = "the figures are an upper bound there: nothing to do"


@dataclass(frozen=True)
class FakeGpu:
    """The GPU the traced program is shown: every fact the fake device reports (torch.cuda's device properties, NVML,
    Triton's driver), made from one catalog type by the estimator's side and read as it is by the child."""

    name: str  # torch.cuda.get_device_name and NVML's name
    total_bytes: int  # total_memory, mem_get_info's total, NVML's memory.total
    capability: tuple[int, int]
    multi_processor_count: int
    l2_cache_bytes: int
    max_threads_per_multi_processor: int
    shared_memory_per_block_optin: int  # what a kernel may ask for (Triton's max_shared_mem)
    registers_per_block: int
    warp_size: int = 32

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> FakeGpu:
        return cls(**{**data, "capability": tuple(data["capability"])})


@dataclass(frozen=True)
class TraceRequest:
    """One trace, as the estimator asks it of the traced side (`python -m xmem.trace [options] -- COMMAND`)."""

    command: tuple[str, ...]  # the program: script.py ARGS, -m module ARGS (or -c CODE, in a process it started)
    out: str  # where the result JSON (the Trace, or the error) is written
    gpu: FakeGpu  # what each of the node's fake GPUs is
    iterations: int = 3  # optimizer steps to trace
    device_count: int = 1  # the GPUs of the job's node (torch.cuda.device_count())
    deadline: float | None = None  # time.monotonic() by which a program short of its first step is decided on
    progress_fd: int | None = None  # where progress lines go (-1: set by whoever starts the process)

    def argv(self) -> list[str]:
        """The child's command line: options, then `--` and the program."""
        argv = ["--out", self.out, "--iterations", str(self.iterations), "--gpu", gpu_text(self.gpu),
                "--device-count", str(self.device_count)]
        if self.deadline is not None:
            argv += ["--deadline", f"{self.deadline:.3f}"]
        if self.progress_fd is not None:
            argv += ["--progress-fd", str(self.progress_fd)]
        return [*argv, "--", *self.command]

    @classmethod
    def from_argv(cls, argv: Sequence[str]) -> TraceRequest:
        """The request back from `argv()` (the child's side; exits with a usage line on a malformed one)."""
        args = _parser().parse_args(list(argv))
        command = args.command[1:] if args.command[:1] == ["--"] else args.command
        if not command:
            _parser().error("give the program after --")
        return cls(tuple(command), args.out, parse_gpu(args.gpu), args.iterations, args.device_count, args.deadline,
                   args.progress_fd)


def gpu_text(gpu: FakeGpu) -> str:
    """The GPU as one word of a command line or one value of the environment."""
    return json.dumps(gpu.to_json(), separators=(",", ":"))


def parse_gpu(text: str) -> FakeGpu:
    return FakeGpu.from_json(json.loads(text))


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m xmem.trace",
                                     description="The tracing child process: trace a program under fake CUDA.")
    parser.add_argument("--out", required=True, help="where to write the Trace JSON (or error JSON)")
    parser.add_argument("--iterations", type=int, default=3, help="optimizer steps (iterations) to trace")
    parser.add_argument("--gpu", required=True, help="the pretended GPU's facts, as JSON (FakeGpu)")
    parser.add_argument("--device-count", type=int, default=1)
    parser.add_argument("--progress-fd", type=int, default=None, help="file descriptor for progress lines")
    parser.add_argument("--deadline", type=float, default=None,
                        help="time.monotonic() at which a program still short of its first step is decided on "
                             "what it ran (the clock is the machine's: the caller sets it from its own timeout)")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- then the program: script.py ARGS or -m mod ARGS")
    return parser


class NoteKind(Enum):
    """A kind of note. Its value is the stable id the result JSON carries; `quiet`: bookkeeping that cannot change
    the figures or the program's path (shown with --verbose only); `plain`: what it means for the user's job and
    what to do, its `{}`s filled by the note's `args` (None: the maker's own words are shown)."""

    plain: str | None
    quiet: bool

    def __new__(cls, note_id: str, plain: str | None = None, quiet: bool = False) -> NoteKind:
        kind = object.__new__(cls)
        kind._value_ = note_id
        kind.plain, kind.quiet = plain, quiet
        return kind

    # bookkeeping of the tracer: values only host code reads, a logged loss, the sandbox at work, ...
    HOST_MODEL_FAKE = "host_model_fake", None, True  # model tensors past the host limit are born fake
    SCALAR_STAND_IN = "scalar_stand_in", None, True  # a loop on such a value has its own note (LOOP_ENDED)
    FILES_PROTECTED = "files_protected", None, True  # the sandbox kept the program's writes
    TRACED_PER_CLASS = "traced_per_class", None, True  # GPU-dependent code paths: one trace per class, as it should
    GRAD_SCALER_STEPPED = "grad_scaler_stepped", None, True  # every step taken, the memory of a step counted
    CHECKPOINT_ON_HOST_FAKE = "checkpoint_on_host_fake", None, True  # as HOST_MODEL_FAKE, for loaded checkpoints
    # what the fake GPU assumed where real values were needed
    SELECTION_ASSUMED_ALL = "selection_assumed_all", (
        "the program selects GPU values by a condition (nonzero, a boolean mask): with no GPU the values are "
        f"unknown, so every element was counted as selected; {UPPER_BOUND}")
    UNIQUE_ASSUMED_DISTINCT = "unique_assumed_distinct", (
        f"torch.unique of GPU values was counted as if every value were distinct; {UPPER_BOUND}")
    BINCOUNT_ASSUMED = "bincount_assumed", (
        f"torch.bincount of GPU values was counted with one bin per element; {UPPER_BOUND}")
    BINCOUNT_TO_RANGE = "bincount_to_range"  # counted up to the highest value the input's range allows
    BINCOUNT_MINLENGTH = "bincount_minlength"  # its minlength bins, as if every value were below it
    NMS_KEPT_ALL = "nms_kept_all", (
        "non-maximum suppression (torchvision's nms) of GPU boxes was counted as keeping every box; "
        f"{UPPER_BOUND}")
    REPEAT_INTERLEAVE_LARGEST = "repeat_interleave_largest", (
        f"repeat_interleave with repeats held on the GPU was counted at its largest; {UPPER_BOUND}")
    LOOP_ENDED = "loop_ended", (  # args: the rounds answered True
        "a loop of the program waits on values computed on the GPU: with no GPU to compute them it was ended after "
        "{} rounds; if the job's memory grows with that loop, trace more steps (--iterations) or measure on a GPU")
    TENSORS_EQUAL = "tensors_equal", (  # args: the torch function
        "the program compares GPU tensors (torch.{}): with no GPU they were taken as equal; if the job's path "
        "depends on it, the figures are for the path where they are equal")
    VALUES_READ_AS_ONES = "values_read_as_ones", (  # args: numpy or tolist
        "the program reads GPU values on the host (.{}()): with no GPU it got ones; if the job's path depends on "
        "them, the figures are for that path")
    # what the figures leave out or depend on
    TORCHSCRIPT_UNFUSED = "torchscript_unfused"  # the GPU fuser was off: scripted code ran op by op
    CUDA_GRAPHS_EAGER = "cuda_graphs_eager", (
        "the program uses CUDA graphs: their private memory pool is not in the figures; ask for more than them, or "
        "measure one run on a GPU")
    MEMORY_SIZE_READ = "memory_size_read", (  # args: the memory shown ("80.0 GiB")
        "the program reads the GPU's memory size (it was shown {}) and may size its work by it, so on a GPU, MIG "
        "slice or MPS share of another size it may use another amount: estimate for the GPU type the job will get "
        "(--gpu)")
    FORWARD_ONLY = "forward_only", (  # args: the forward passes, what training there was, what ended the trace
        "the program ran {} forward passes and {} (until {}): the figures are the peak of what it ran, right for "
        "evaluation or inference; a training job that steps later than that needs a longer trace (--timeout)")
    GPUS_USED = "gpus_used", (  # args: how many
        "the program used {} GPUs: the figures are per GPU, for the one that holds the most")
    # made by the estimator, from several traces
    RANKS_TRACED = "ranks_traced"  # args: the rank whose figures are shown, the GPU type it is the fullest on


class Note(str):
    """One note: its maker's words (the string itself: what the records, the JSON's `warnings` and --verbose
    hold, unchanged), its kind (None: a note no kind describes, shown as made) and the values that fill the kind's
    words for people. A string, so every place that keeps or compares warnings keeps notes as they are."""

    kind: NoteKind | None
    args: tuple[str, ...]

    def __new__(cls, kind: NoteKind | None, text: str, *args: object) -> Note:
        note = super().__new__(cls, text)
        note.kind, note.args = kind, tuple(str(arg) for arg in args)
        return note

    def __getnewargs__(self) -> tuple[Any, ...]:  # copies and pickles keep the kind
        return (self.kind, str(self), *self.args)

    @property
    def quiet(self) -> bool:
        return self.kind is not None and self.kind.quiet

    def for_people(self) -> str:
        """What it means for the job and what to do (the kind's words), else the maker's own words."""
        if self.kind is None or self.kind.plain is None:
            return str(self)
        return self.kind.plain.format(*self.args)

    def to_json(self) -> dict[str, Any]:
        return {"kind": None if self.kind is None else self.kind.value, "text": str(self), "args": list(self.args)}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Note:
        kind = _KINDS_BY_ID.get(data.get("kind") or "")  # a kind this side does not know: shown as made
        return cls(kind, data["text"], *(data.get("args") or ()))


_KINDS_BY_ID = {kind.value: kind for kind in NoteKind}


def as_note(warning: str) -> Note:
    """A warning as a note: itself if it is one, else a note of no kind (words from a record made before notes
    were typed, or by a maker that gives none)."""
    return warning if isinstance(warning, Note) else Note(None, warning)


def notes_json(warnings: Iterable[str]) -> list[dict[str, Any]]:
    """The notes as the child's result JSON carries them (`"notes"`, beside the Trace's own fields)."""
    return [as_note(warning).to_json() for warning in warnings]


def notes_from_json(payload: dict[str, Any], warnings: Sequence[str]) -> list[str]:
    """The trace's warnings as notes again: from the result's `"notes"`, else (a result without them: a trace
    saved before notes were typed) the plain `warnings`."""
    notes = payload.get("notes")
    return list(warnings) if notes is None else [Note.from_json(note) for note in notes]


# ---- the network ---------------------------------------------------------------------------------------------------
# Set in the program's environment where the trace, not the job, made the node offline (runner.OFFLINE_NODE: the
# job set no HF_HUB_OFFLINE of its own). A model-hub download that then fails is the trace's lack of network, not
# the program's error: on a node with network it would have fetched (attribution._hub_offline).
OFFLINE_BY_THE_TRACE_ENV = "XMEM_OFFLINE_BY_THE_TRACE"


# ---- the warm tracer's socket ------------------------------------------------------------------------------------
# One connection is one job. The client sends FRAME_HEADER (the request's length) with two descriptors (the program's
# output, the progress pipe), then the WarmRequest's JSON. The server answers JSON lines (WarmReply): `declined`
# (the job runs cold), or `started`, then `status` when the job has ended. The client's one message after its
# request is STOP: end the job, as the cold helper is sent SIGTERM, which the server does within STOP_GRACE_S.
FRAME_HEADER = struct.Struct("!Q")
STOP = b"stop\n"
REQUEST_TIMEOUT_S = 10.0  # for the request to arrive whole and be answered `started` or `declined`
STOP_GRACE_S = 5  # as the runner gives the cold helper
DEFAULT_IDLE_S = 900.0  # a server with no request for this long ends (its `--idle`)


@dataclass(frozen=True)
class WarmRequest:
    """What the cold helper would be started with, sent to the server that forks it instead."""

    argv: tuple[str, ...]  # the cold command line: [python, -I, sandbox.py, OPTIONS..., --, TRACER...]
    env: dict[str, str]  # the program's environment, applied inside its sandbox
    cwd: str
    umask: int
    limits: dict[str, tuple[int, int]]  # resource limits by RLIMIT_ name: (soft, hard)
    gpu: FakeGpu  # the job's fake GPU (also in argv's --gpu): the server decides by it before any job code runs

    def encode(self) -> bytes:
        return json.dumps(asdict(self)).encode()

    @classmethod
    def decode(cls, body: bytes) -> WarmRequest:
        data = json.loads(body)
        return cls(tuple(data["argv"]), data["env"], data["cwd"], data["umask"],
                   {name: (soft, hard) for name, (soft, hard) in data["limits"].items()}, FakeGpu.from_json(data["gpu"]))


@dataclass(frozen=True)
class WarmReply:
    """One line of the server's: exactly one of the fields is set."""

    started: int | None = None  # the job's pid
    declined: str | None = None  # why the server cannot run it exactly as the cold child would
    status: int | None = None  # the job's end, as Popen.returncode gives it

    def line(self) -> bytes:
        return json.dumps({name: value for name, value in asdict(self).items() if value is not None}).encode() + b"\n"

    @classmethod
    def from_line(cls, line: bytes) -> WarmReply:
        return cls(**json.loads(line))


def peer_ids(connection: socket.socket) -> tuple[int, int]:
    """(uid, gid) of the process at the other end, as the kernel says: both ends speak only to their own user."""
    creds = connection.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    _, uid, gid = struct.unpack("3i", creds)
    return uid, gid


def with_option(argv: Sequence[str], name: str, value: str) -> list[str]:
    """`argv` with the value of option `name` replaced: options come before the program's arguments, so the first
    `name` is ours (the runner and the server set the descriptors and limits of a request's command line so)."""
    changed = list(argv)
    changed[changed.index(name) + 1] = value
    return changed


def alive(pid: int) -> bool:
    """Whether process `pid` runs (the server's `--caller`, the runner's owner of a scratch directory)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        return True
    return True
